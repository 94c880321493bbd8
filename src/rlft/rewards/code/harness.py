"""Child side of the code sandbox. Run by `sandbox.py` as `python -I -B harness.py JOB`; never
imported by the trainer.

Process tree (one per completion):

    trainer ── harness "outer" (root, host PID namespace; only waits)
                 └── "zygote" (trusted harness code; PID 1 of a new PID namespace when allowed)
                       └── one forked child per test case: limits, uid drop, seccomp, then the
                           untrusted program; its descendants die with it (see `_kill_case`)

The job file holds the program and the test *inputs* only: expected outputs never leave the
parent, so nothing in here can tell what a pass looks like. The zygote reports, per case, what the
program wrote (stdout, a JSON-serialised return value) on a pipe the untrusted children never
hold; the parent compares. A setup pipe, closed before untrusted code starts, tells a sandbox
failure (infra error, reward None) from a program failure.

Stdlib only (see isolation.py for why).
"""

from __future__ import annotations

import atexit
import builtins
import importlib.util
import json
import os
import select
import signal
import stat
import sys
import time
import traceback
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("rlft_sandbox_isolation", os.path.join(_HERE, "isolation.py"))
iso = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(iso)

SETUP_OK = b"ok"
# World-writable places that get a private tmpfs in the mount namespace: writes there would
# otherwise outlive the run (and /tmp could fill the host disk).
_SCRATCH_MOUNTS = (("/var/tmp", 16 << 20), ("/dev/shm", 16 << 20), ("/run/lock", 1 << 20))
_STDERR_TAIL = 8192


class LayerError(Exception):
    """A requested isolation layer could not be set up (strict jobs stop here: infra error)."""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ------------------------------------------------------------------------------ outer + zygote

def _enter_namespaces(want: dict, strict: bool, active: dict) -> None:
    for name, flag in (("netns", iso.CLONE_NEWNET), ("mountns", iso.CLONE_NEWNS),
                       ("pidns", iso.CLONE_NEWPID), ("ipcns", iso.CLONE_NEWIPC | iso.CLONE_NEWUTS)):
        active[name] = False
        if not want.get(name):
            continue
        try:
            iso.unshare(flag)
            active[name] = True
        except OSError as exc:
            if strict:
                raise LayerError(f"{name}: {exc}") from None


def _interpreter_paths() -> list[str]:
    """Directories the program's imports need (the Python install, the venv, site-packages),
    as spelled and as resolved (a symlink may lead through a directory we hide); nested ones are
    dropped since their ancestor is exposed whole."""
    spelled = [p for p in (sys.base_prefix, sys.prefix, sys.exec_prefix, *sys.path) if p and os.path.isdir(p)]
    paths = {os.path.abspath(p) for p in spelled} | {os.path.realpath(p) for p in spelled}
    return sorted(p for p in paths if not iso.is_under(p, paths - {p}))


def _prepare_filesystem(job: dict, active: dict, strict: bool) -> str:
    """Returns the working directory the program runs in (its HOME)."""
    active["tmpfs"] = False
    if active.get("mountns"):
        try:
            needed = _interpreter_paths()
            fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in needed}
            if active.get("pidns"):
                iso.private_mounts_and_proc()
            else:
                iso.mount("none", "/", None, iso.MS_REC | iso.MS_PRIVATE)
            # Hide directories the sandbox uid may not enter (e.g. /root) behind an empty tmpfs,
            # then bind the interpreter's own directories back, read-only.
            covered = sorted({b for p in needed if (b := iso.blocked_ancestor(p))})
            for path in covered:
                iso.fresh_tmpfs(path, 1 << 20, mode=0o755)
            iso.fresh_tmpfs("/tmp", job["limits"]["tmpfs_bytes"])
            covered.append("/tmp")
            for path, size in _SCRATCH_MOUNTS:
                if os.path.isdir(path):
                    iso.fresh_tmpfs(path, size)
                    covered.append(path)
            for path in needed:
                if iso.is_under(path, covered):
                    iso.bind_read_only(fds[path], path)
                os.close(fds[path])
            active["tmpfs"] = True
            return "/tmp/work"
        except OSError as exc:
            if strict:
                raise LayerError(f"mounts: {exc}") from None
    return job["host_workdir"]


def _ensure_workdir(path: str, uid: int | None, gid: int | None) -> None:
    """(Re)make the working directory before each case: the previous case may have removed it
    (`rm -rf ~`), replaced it with a symlink, or chmod-ed it. No untrusted process is alive at
    this point (the previous case was swept), so checking then fixing by path cannot race."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)  # a symlink or file planted in its place: never follow it as root
            raise FileNotFoundError(path)
    except FileNotFoundError:
        os.mkdir(path, 0o700)
    if uid is not None:
        os.chown(path, uid, gid, follow_symlinks=False)
    os.chmod(path, 0o700)


def main(argv: list[str]) -> int:
    job_path = argv[1]
    with open(job_path) as f:
        job = json.load(f)
    os.unlink(job_path)
    result_fd, strict, want = job["result_fd"], job["strict"], job["layers"]
    # If the trainer dies mid-run, so do we (and with the zygote, the whole PID namespace).
    iso.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != job["parent_pid"]:
        return 1  # the trainer died before the line above took effect
    active: dict = {}
    try:
        _enter_namespaces(want, strict, active)
        if active.get("pidns"):
            # unshare(CLONE_NEWPID) applies to children only: the zygote is PID 1 of the new
            # namespace; when it exits the kernel kills everything left inside.
            pid = os.fork()
            if pid:
                os.close(result_fd)
                _, status = os.waitpid(pid, 0)
                return os.waitstatus_to_exitcode(status) & 0xFF
            iso.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by fork; outer dies -> we die
        report = _zygote(job, active, strict)
    except LayerError as exc:
        report = {"layers": active, "error": f"isolation layer failed: {exc}"}
    except Exception:  # a harness bug: say so, never a verdict on the program
        report = {"layers": active, "error": "harness crashed:\n" + traceback.format_exc(limit=5)}
    _write_all(result_fd, json.dumps(report, ensure_ascii=False).encode())
    os.close(result_fd)  # the parent's EOF: it need not wait for interpreter teardown
    return 0


def _zygote(job: dict, active: dict, strict: bool) -> dict:
    workdir = _prepare_filesystem(job, active, strict)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    iso.prctl(iso.PR_SET_DUMPABLE, 0)  # same-uid children cannot ptrace or read our memory
    active["uid"] = job.get("uid") is not None
    active["seccomp"] = bool(want_seccomp := job["layers"].get("seccomp")) and iso.seccomp_available()
    if want_seccomp and not active["seccomp"] and strict:
        raise LayerError("seccomp: unsupported architecture")
    active["rlimits"] = True
    try:  # compiling untrusted text is bounded too: a pathological nesting must not eat the host
        iso.set_rlimits({"AS": job["limits"]["AS"]})
        code_obj = compile(job["code"], "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
        return {"layers": active, "syntax_error": f"{type(exc).__name__}: {exc}", "cases": []}
    ctx = dict(job=job, workdir=workdir, code=code_obj, active=active, reaped={},
               output_left=job["limits"]["output_total_bytes"])
    if job["uid"] is None:  # RLIMIT_NPROC counts the whole (shared) uid: budget on top of it
        ctx["nproc"] = _threads_of_uid(os.getuid()) + job["limits"]["NPROC"]
    else:
        ctx["nproc"] = job["limits"]["NPROC"]
    cases, start = [], time.monotonic()
    for index, case in enumerate(job["cases"]):
        deadline = min(time.monotonic() + job["case_timeout"], start + job["timeout"])
        if time.monotonic() >= deadline:
            cases.append({"status": "not_run"})
            continue
        cases.append(_run_case(ctx, case, deadline))
        if cases[-1].get("setup_error"):
            break
    return {"layers": active, "syntax_error": None, "cases": cases}


def _threads_of_uid(uid: int) -> int:
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    text = f.read()
            except OSError:
                continue
            if f"\nUid:\t{uid}\t" in text:
                total += int(text.split("\nThreads:\t", 1)[1].split("\n", 1)[0])
    return total


# ------------------------------------------------------------------------------ one test case

def _run_case(ctx: dict, case: dict, deadline: float) -> dict:
    job = ctx["job"]
    _ensure_workdir(ctx["workdir"], job["uid"], job["gid"])
    stdin_fd = os.memfd_create("stdin")
    _write_all(stdin_fd, case.get("stdin", "").encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    pipes = {name: os.pipe() for name in ("stdout", "stderr", "result", "setup")}
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the case process must never return into the zygote's loop, whatever happens
        try:
            _child(ctx, case, stdin_fd, {k: w for k, (_, w) in pipes.items()})
        finally:
            os._exit(127)
    os.close(stdin_fd)
    for _, w in pipes.values():
        os.close(w)
    readers = {r: name for name, (r, _) in pipes.items()}
    out, reason, status = _collect(ctx, pid, readers, deadline)
    report = {
        "status": reason or "exited",
        "time": round(time.monotonic() - started, 4),
        "stdout": out["stdout"].decode("utf-8", "replace"),
        "stderr": out["stderr"][-_STDERR_TAIL:].decode("utf-8", "replace"),
        "result": out["result"].decode("utf-8", "replace") if out["result"] else None,
        "exit_code": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
    }
    if out["setup"] != SETUP_OK:
        report["setup_error"] = out["setup"].decode("utf-8", "replace") or "case process died during setup"
    return report


def _collect(ctx: dict, pid: int, readers: dict[int, str], deadline: float):
    cap = min(ctx["job"]["limits"]["output_bytes"], ctx["output_left"])
    out = {name: bytearray() for name in readers.values()}
    pidfd, exited, reason = os.pidfd_open(pid), False, None
    open_fds = set(readers)
    while open_fds or not exited:
        remaining = deadline - time.monotonic()
        if exited:  # whatever is left was written by stray descendants, which are dead now
            remaining = min(remaining, 0.5)
        if remaining <= 0:
            reason = reason or (None if exited else "timeout")
            break
        ready, _, _ = select.select(list(open_fds) + ([] if exited else [pidfd]), [], [], remaining)
        for fd in ready:
            if fd == pidfd:
                exited = True
                _kill_case(ctx, pid)  # daemons may hold the pipes open: end them before draining
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
                continue
            name = readers[fd]
            out[name] += chunk
            if name == "stderr":
                del out[name][:-_STDERR_TAIL]
            elif len(out[name]) > cap:  # printing 1 GB: stop at the cap instead of buffering it
                del out[name][cap:]
                reason, exited = "output_limit", True
                _kill_case(ctx, pid)
                open_fds.discard(fd)
    _kill_case(ctx, pid)
    ctx["output_left"] -= len(out["stdout"]) + len(out["result"])
    status = ctx["reaped"].pop(pid, None)
    if status is None:
        _, status = os.waitpid(pid, 0)
    for fd in list(readers) + [pidfd]:
        os.close(fd)
    return out, reason, status


def _kill_case(ctx: dict, pid: int) -> None:
    """End the case process and everything it started, by the strongest means available."""
    try:
        os.killpg(pid, signal.SIGKILL)  # its own group; descendants may have left it (setsid)
    except ProcessLookupError:
        pass
    if ctx["active"].get("pidns") and os.getpid() == 1:
        # kill(-1) from a namespace's init reaches every other process of that namespace only
        # (guarded by getpid() == 1: on the host it would mean every process we may signal).
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap_all(ctx["reaped"])
    elif ctx["job"].get("uid") is not None:
        iso.sweep_uid(ctx["job"]["uid"])


def _reap_all(reaped: dict[int, int]) -> None:
    """As PID 1 we inherit the orphans: reap every child, keeping statuses for `_collect`."""
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)
        else:
            reaped[pid] = status


# ------------------------------------------------------------------------------ case child

def _child(ctx: dict, case: dict, stdin_fd: int, w: dict[str, int]) -> None:
    """Runs in the forked case process. Sets every limit, then runs the untrusted program."""
    job = ctx["job"]
    try:
        os.setpgid(0, 0)
        for target, fd in ((0, stdin_fd), (1, w["stdout"]), (2, w["stderr"]), (3, w["result"]), (4, w["setup"])):
            os.dup2(fd, target)
        os.closerange(5, 1 << 20)
        limits = {k: job["limits"][k] for k in ("AS", "FSIZE", "NOFILE", "CORE")}
        limits["NPROC"] = ctx["nproc"]
        # CPU: soft limit -> SIGXCPU (reported as a timeout), hard limit one second later.
        cpu = int(job["case_timeout"]) + 1
        limits["CPU"] = (cpu, cpu + 1)
        iso.set_rlimits(limits)
        if job["uid"] is not None:
            iso.drop_privileges(job["uid"], job["gid"])
        iso.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        if ctx["active"]["seccomp"]:
            iso.install_seccomp_net_filter()
        else:
            iso.prctl(iso.PR_SET_NO_NEW_PRIVS, 1)
        os.chdir(ctx["workdir"])
        os.umask(0o077)
        _write_all(4, SETUP_OK)
        os.close(4)
    except BaseException as exc:
        try:
            _write_all(4, f"case setup failed: {type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(125)
    exit_code = 1
    try:
        exit_code = _run_untrusted(ctx["code"], job, case)
    finally:
        os._exit(exit_code)


def _run_untrusted(code_obj, job: dict, case: dict) -> int:
    atexit._clear()  # the program's atexit hooks run (fast-IO idioms flush there), not ours
    call_mode = job["mode"] == "call"
    module = types.ModuleType("solution" if call_mode else "__main__")
    module.__file__ = "solution.py"
    module.__builtins__ = builtins
    sys.modules[module.__name__] = module
    sys.argv = ["solution.py"]
    exit_code = 0
    try:
        exec(code_obj, module.__dict__)
        if call_mode:
            value = _resolve(module, job["fn_name"])(*case["args"])
            _write_all(3, json.dumps({"value": _to_json(value)}).encode())
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        exit_code = 1
        try:
            traceback.print_exc()
        except BaseException:  # MemoryError while formatting: the exit code still says it
            pass
    try:
        if "threading" in sys.modules:  # as at interpreter exit: wait for non-daemon threads
            sys.modules["threading"]._shutdown()  # (the `Thread(target=main)` big-stack idiom)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    return exit_code & 0xFF


def _resolve(module, fn_name: str):
    fn = getattr(module, fn_name, None)
    if callable(fn) and not isinstance(fn, type):
        return fn
    cls = getattr(module, "Solution", None)  # LeetCode style: class Solution with the method
    if isinstance(cls, type) and callable(getattr(cls, fn_name, None)):
        return getattr(cls(), fn_name)
    raise NameError(f"the program defines no function {fn_name!r} (nor Solution.{fn_name})")


def _to_json(value, depth: int = 0):
    """Plain JSON types only, checked by exact type: an object with a rigged __eq__ or a str
    subclass with a rigged __repr__ is not an answer."""
    if depth > 100:
        raise ValueError("return value nested deeper than 100 levels")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind in (list, tuple):
        return [_to_json(v, depth + 1) for v in value]
    if kind is dict and all(type(k) is str for k in value):
        return {k: _to_json(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"return value of type {kind.__name__} is not plain JSON (use int/float/str/bool/None/list/dict)")


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    os._exit(code)  # skip finalisation: nothing is left to flush, and exit is on the parent's clock
