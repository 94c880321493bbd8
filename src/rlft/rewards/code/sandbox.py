"""Parent side of the code sandbox: run one program per call in a fresh interpreter, isolated, and
decide the verdict here, never in the untrusted process.

Layers, strongest first (which ones this machine gives: `isolation_layers()`):
- a fresh `python -I` interpreter per program (never exec or a Python fork of the trainer), in its
  own session, with an allowlisted environment (HOME = a temp dir; no secrets), stdin closed;
- network, PID, mount, IPC/UTS namespaces (root, or wherever unshare is allowed): no network at
  all; everything the program starts dies with the namespace's init; private /proc and a
  size-bounded tmpfs over /tmp, /var/tmp, /dev/shm so writes vanish and cannot fill the disk;
- an unprivileged uid per run from a pool (root only), so file permissions protect the host, and
  RLIMIT_NPROC is per run; every process of that uid is swept (SIGKILL) after the run;
- seccomp: socket() for AF_UNIX/INET/INET6/PACKET fails (the network fallback without netns);
- rlimits (address space, CPU, file size, processes, open files), a wall-clock deadline per case
  and for the run, and capped output.

Run as root without a working uid drop, we refuse (infra error) rather than run code as root.
Where layers are missing the sandbox is weaker, and `isolation_layers()` says so: without a
mount namespace the sandbox uid must be able to read the Python installation (a pyenv under
/root is hidden from it); as a non-root user there is no uid pool, so a daemon that leaves its
process group survives unless a PID namespace is available.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from rlft.rewards.code import isolation
from rlft.rewards.code.cases import BadTests, Credit, Verdict, grade, parse_tests, unverifiable, zero

log = logging.getLogger(__name__)

HARNESS = Path(__file__).with_name("harness.py")
LAYER_NAMES = ("netns", "pidns", "mountns", "ipcns", "seccomp", "uid")
# Far above the ranges distributions hand out (system < 1000, users < 60000, systemd dynamic
# users 61184-65519); overridable where the uid map is smaller (e.g. inside a user namespace).
UID_BASE = int(os.environ.get("RLFT_SANDBOX_UID_BASE", "1900000000"))
UID_POOL_SIZE = 64
STARTUP_GRACE_S = 5.0  # interpreter start + setup, beyond the program's own time budget
MAX_CONCURRENT = max(4, 2 * (os.cpu_count() or 1))


@dataclass(frozen=True)
class Limits:
    """Per-program resource limits. Conservative on purpose: a sandbox bug must not be able to
    take the machine down (1 GiB still imports numpy)."""

    memory_mb: int = 1024  # RLIMIT_AS
    processes: int = 64  # RLIMIT_NPROC (threads count too)
    file_size_mb: int = 64  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE
    output_kb: int = 1024  # stdout / return value kept per case; beyond it the case is killed
    output_total_mb: int = 32  # the same, over all cases of one program
    tmpfs_mb: int = 128  # the private /tmp (the working directory) under a mount namespace

    def for_job(self) -> dict[str, int]:
        return {"AS": self.memory_mb << 20, "NPROC": self.processes, "FSIZE": self.file_size_mb << 20,
                "NOFILE": self.open_files, "CORE": 0, "output_bytes": self.output_kb << 10,
                "output_total_bytes": self.output_total_mb << 20, "tmpfs_bytes": self.tmpfs_mb << 20}


def _child_env(workdir: str) -> dict[str, str]:
    # An allowlist, not a copy: API keys and tokens in the trainer's environment stay there.
    # One BLAS/OpenMP thread, or numpy's thread pool alone can exceed RLIMIT_NPROC on a big host.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------ uid pool

_swept_stale = False


def _sandbox_root() -> Path:
    root = Path(tempfile.gettempdir()) / f"rlft-sandbox-{os.geteuid()}"
    root.mkdir(mode=0o711, exist_ok=True)
    st = root.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{root} is not owned by us or is writable by others; remove it")
    os.chmod(root, 0o711)  # others may traverse (a sandbox uid reaches its own dir), not list
    global _swept_stale
    if not _swept_stale:  # left by trainers killed mid-run; no run lives for an hour
        _swept_stale = True
        for old in root.glob("run-*"):
            if time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
    return root


def _lock_dir() -> Path:
    """One place per host, whatever TMPDIR each trainer has: two trainers with different temp
    dirs must still see each other's uid leases."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path("/tmp")
    path = base / f"rlft-sandbox-locks-{os.geteuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.geteuid():
        raise RuntimeError(f"{path} is not owned by us; remove it")
    return path


class UidPool:
    """Exclusive sandbox uids, leased with flock so that threads and other trainer processes on
    the host never share one (a shared uid would let runs signal each other and share NPROC)."""

    def __init__(self, base: int, size: int, lock_dir: Path):
        self.uids = [u for u in range(base, base + size) if not _uid_exists(u)]
        self.lock_dir = lock_dir
        self._next = 0
        self._mutex = threading.Lock()

    def describe(self) -> str:
        return f"pool of {len(self.uids)} uids from {self.uids[0]}" if self.uids else "empty pool"

    @contextmanager
    def lease(self, wait_s: float = 120.0) -> Iterator[int]:
        end = time.monotonic() + wait_s
        while True:
            with self._mutex:
                start, self._next = self._next, (self._next + 1) % max(1, len(self.uids))
            for uid in self.uids[start:] + self.uids[:start]:
                fd = os.open(self.lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                try:
                    isolation.sweep_uid(uid)  # leftovers of a trainer that crashed mid-run
                    yield uid
                    return
                finally:
                    try:
                        isolation.sweep_uid(uid)
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        os.close(fd)
            if time.monotonic() > end:
                raise TimeoutError(f"no free sandbox uid after {wait_s:.0f}s")
            time.sleep(0.02)


def _uid_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


_state_lock = threading.Lock()
_pool: UidPool | None = None
_layers_cache: dict[frozenset[str], dict[str, Any]] = {}
_slots = threading.BoundedSemaphore(MAX_CONCURRENT)


def _uid_pool() -> UidPool | None:
    global _pool
    if os.geteuid() != 0:
        return None
    with _state_lock:
        if _pool is None:
            _pool = UidPool(UID_BASE, UID_POOL_SIZE, _lock_dir())
        return _pool


# ------------------------------------------------------------------------------ layers

def isolation_layers(disable: Iterable[str] = ()) -> dict[str, bool | str]:
    """Which layers work here, found by running a harmless program once (cached per process)."""
    key = frozenset(disable)
    unknown = key - set(LAYER_NAMES)
    if unknown:
        raise ValueError(f"unknown isolation layers {sorted(unknown)}; known: {', '.join(LAYER_NAMES)}")
    with _state_lock:
        if key in _layers_cache:
            return dict(_layers_cache[key])
    layers = _probe(key)
    if layers.get("working"):  # a failed probe is retried on the next call
        with _state_lock:
            _layers_cache[key] = layers
    return dict(layers)


# Imports modules the harness has not loaded (a C extension among them): proves the sandbox uid
# can read the Python installation, not just run what the harness preloaded.
_PROBE_PROGRAM = "import decimal, fractions, zipfile\nprint(1)"


def _probe(disabled: frozenset[str]) -> dict[str, bool | str]:
    want = {name: name not in disabled for name in LAYER_NAMES}
    pool = _uid_pool() if want["uid"] else None
    want["uid"] = pool is not None and bool(pool.uids)
    for attempt in range(2):
        report, error = _execute(_PROBE_PROGRAM, "stdio", None, [{"stdin": ""}], 5.0, 5.0, Limits(),
                                 want, strict=False, pool=pool if want["uid"] else None)
        problem = _probe_problem(report, error)
        if problem is None:
            out: dict[str, bool | str] = dict(report["layers"])
            if out.get("uid"):
                out["uid"] = pool.describe()
            return {**out, "working": True, "fresh_interpreter": True, "env_allowlist": True}
        if attempt == 0 and want["seccomp"] and "seccomp" in problem:
            log.warning("sandbox probe failed with seccomp (%s); retrying without it", problem)
            want["seccomp"] = False
    if want["uid"] and "ModuleNotFoundError" in problem:
        problem += ("; the sandbox uid cannot read the Python installation (e.g. a pyenv under /root): "
                    "allow mount namespaces, or install Python where other users can read it")
    log.error("sandbox probe failed: %s", problem)
    return {**{n: False for n in LAYER_NAMES}, "working": False, "problem": problem}


def _probe_problem(report: dict | None, error: str | None) -> str | None:
    if report is None or report.get("error"):
        return error or report["error"]
    case = (report.get("cases") or [{}])[0]
    if case.get("setup_error"):
        return case["setup_error"]
    if case.get("stdout") != "1\n":
        last = (case.get("stderr") or "").strip().splitlines()[-1:] or [f"status {case.get('status')}"]
        return f"a harmless probe program failed in the sandbox: {last[0]}"
    return None


# ------------------------------------------------------------------------------ running

def run_program(code: str, tests: Any, timeout: float = 10.0, *, case_timeout: float | None = None,
                limits: Limits = Limits(), credit: Credit = Credit(), disable: Iterable[str] = ()) -> Verdict:
    """Run `code` against `tests` (a dict or JSON string, see cases.py) in the sandbox.

    `timeout` bounds the program's wall-clock time over all cases; `case_timeout` (default:
    `timeout`) bounds each case. Returns a Verdict; score None means unverifiable.
    """
    try:
        suite = parse_tests(tests)
    except BadTests as exc:
        return unverifiable("bad_tests", str(exc))
    total = len(suite.cases)
    layers = isolation_layers(disable)
    if not layers.get("working"):
        return unverifiable("infra_error", f"the sandbox does not work here: {layers.get('problem')}", total, layers)
    if os.geteuid() == 0 and not layers.get("uid"):
        return unverifiable("infra_error", "refusing to run untrusted code as root: no sandbox uid could be "
                            "used (set RLFT_SANDBOX_UID_BASE to a free uid range)", total, layers)
    want = {name: bool(layers.get(name)) for name in LAYER_NAMES}
    case_timeout = timeout if case_timeout is None else min(case_timeout, timeout)
    report, error = _execute(code, suite.mode, suite.fn_name, suite.child_cases(), timeout, case_timeout,
                             limits, want, strict=True, pool=_uid_pool() if want["uid"] else None)
    if report is None or report.get("error"):
        return unverifiable("infra_error", error or report["error"], total, layers)
    run_layers = {**layers, **{k: v for k, v in report.get("layers", {}).items() if k != "uid"}}
    if report.get("syntax_error"):
        return zero("syntax_error", report["syntax_error"], credit, total, run_layers)
    cases = report.get("cases", [])
    if len(cases) != total:
        return unverifiable("infra_error", f"sandbox reported {len(cases)} cases for {total} tests", total, run_layers)
    broken = next((c["setup_error"] for c in cases if c.get("setup_error")), None)
    if broken:
        return unverifiable("infra_error", broken, total, run_layers)
    return grade(suite, cases, credit, run_layers)


def _execute(code: str, mode: str, fn_name: str | None, cases: list[dict], timeout: float,
             case_timeout: float, limits: Limits, want: dict[str, bool], strict: bool,
             pool: UidPool | None) -> tuple[dict | None, str | None]:
    """Start the harness for one program and read its report. (report, None) or (None, why)."""
    try:
        with _slots, (pool.lease() if pool else nullcontext(None)) as uid:
            workdir = tempfile.mkdtemp(prefix="run-", dir=_sandbox_root())
            try:
                job = {"code": code, "mode": mode, "fn_name": fn_name, "cases": cases, "timeout": timeout,
                       "case_timeout": case_timeout, "limits": limits.for_job(), "layers": want,
                       "strict": strict, "uid": uid, "gid": uid, "host_workdir": workdir,
                       "parent_pid": os.getpid()}
                return _launch(job, workdir, timeout + STARTUP_GRACE_S)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    except (OSError, TimeoutError, RuntimeError) as exc:
        return None, f"sandbox could not start: {type(exc).__name__}: {exc}"


def _launch(job: dict, workdir: str, wall_s: float) -> tuple[dict | None, str | None]:
    read_fd, write_fd = os.pipe()
    job["result_fd"] = write_fd
    job_path = os.path.join(workdir, "job.json")
    with open(os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(job, f)
    try:
        # start_new_session: the harness leads its own process group, killed as a whole below.
        # No preexec_fn: nothing but exec runs between fork and the new interpreter.
        proc = subprocess.Popen([sys.executable, "-I", "-B", str(HARNESS), job_path], cwd=workdir,
                                env=_child_env(workdir), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
    finally:
        os.close(write_fd)
    try:
        # JSON may spell one output byte as up to 6 (\u00XX); stderr tails add 8 KiB per case.
        cap = 6 * job["limits"]["output_total_bytes"] + len(job["cases"]) * (64 << 10) + (1 << 20)
        result, stderr, problem = _read_until_eof(proc, read_fd, time.monotonic() + wall_s, cap)
    finally:
        os.close(read_fd)
        _kill_group(proc)
    if problem == "late":
        return None, f"the sandbox did not finish within {wall_s:.1f}s (timeout + startup grace)"
    if problem == "too_big":
        return None, f"the sandbox report exceeded {cap} bytes"
    try:
        return json.loads(result), None
    except ValueError:
        tail = stderr.decode("utf-8", "replace").strip()[-2000:]
        return None, f"the sandbox harness exited with code {proc.returncode} without a report: {tail}"


def _read_until_eof(proc: subprocess.Popen, read_fd: int, deadline: float,
                    cap: int) -> tuple[bytes, bytes, str | None]:
    sel = selectors.DefaultSelector()
    sel.register(read_fd, selectors.EVENT_READ, "result")
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
    bufs = {"result": bytearray(), "stderr": bytearray()}
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(bufs["result"]), bytes(bufs["stderr"]), "late"
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.data]
                buf += chunk
                if key.data == "stderr":
                    del buf[:-16384]
                elif len(buf) > cap:  # the harness caps per case; this is only a backstop
                    return b"", bytes(bufs["stderr"]), "too_big"
        return bytes(bufs["result"]), bytes(bufs["stderr"]), None
    finally:
        sel.close()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the harness's process group before reaping it: while the leader is unreaped its
    pgid cannot be recycled, so this never signals an unrelated group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stderr.close()
