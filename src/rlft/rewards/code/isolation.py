"""Linux isolation primitives for the code sandbox: namespaces, mounts, seccomp, rlimits, sweeps.

Stdlib only, on purpose: `harness.py` runs in a fresh `python -I` interpreter and loads this file
by path, so it must not import rlft (whose package imports pydantic, and elsewhere torch).
Python 3.11 has no `os.unshare` or mount API, so those go through libc with ctypes.

Every function here is called by the harness before untrusted code runs, or by the parent
(`sweep_uid`) after it ran; none of them runs untrusted code.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import signal
import struct
import time

# <linux/sched.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# <linux/mount.h>
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
# <linux/prctl.h>
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SECCOMP_MODE_FILTER = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


# ---------------------------------------------------------------------------------------------
# seccomp: the network fallback when namespaces are unavailable (e.g. inside a container whose
# runtime blocks unshare). socket() for network families fails with EACCES; so do io_uring calls,
# since IORING_OP_SOCKET can create a socket without the socket syscall.

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NR_SOCKET = {"x86_64": 41, "aarch64": 198}
_NR_IO_URING = (425, 426, 427)  # setup / enter / register: same numbers on both arches
_X32_SYSCALL_BIT = 0x40000000  # x86_64 also accepts x32-ABI numbers; deny them all
AF_UNIX, AF_INET, AF_INET6, AF_PACKET = 1, 2, 10, 17
# AF_UNIX too: abstract unix sockets ignore file permissions and reach host daemons when there is
# no network namespace. socketpair() stays allowed (asyncio and multiprocessing pipes need it).
BLOCKED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_PACKET)

_LD_W_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_RET_ERRNO = 0x00050000


def seccomp_available() -> bool:
    return platform.machine() in _AUDIT_ARCH


def _assemble(program: list[tuple]) -> bytes:
    """Tiny BPF assembler: ('label', name) marks a position; jumps name labels, not offsets."""
    labels, pos = {}, 0
    for ins in program:
        if ins[0] == "label":
            labels[ins[1]] = pos
        else:
            pos += 1
    out, pos = [], 0
    for ins in program:
        if ins[0] == "label":
            continue
        code, k, jt, jf = ins[0], ins[1], (ins[2] if len(ins) > 2 else None), (ins[3] if len(ins) > 3 else None)
        rel = lambda target: 0 if target is None else labels[target] - (pos + 1)  # noqa: E731
        out.append(struct.pack("HBBI", code, rel(jt), rel(jf), k))
        pos += 1
    return b"".join(out)


def seccomp_filter_bytes(machine: str | None = None) -> bytes:
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        raise OSError(errno.ENOSYS, f"no seccomp filter for architecture {machine}")
    deny = _RET_ERRNO | errno.EACCES
    program: list[tuple] = [
        (_LD_W_ABS, 4),  # seccomp_data.arch
        (_JEQ, _AUDIT_ARCH[machine], None, "kill"),  # a foreign ABI (i386 socketcall) is killed
        (_LD_W_ABS, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":
        program.append((_JGE, _X32_SYSCALL_BIT, "deny", None))
    program += [(_JEQ, nr, "deny", None) for nr in _NR_IO_URING]
    program += [
        (_JEQ, _NR_SOCKET[machine], None, "allow"),
        (_LD_W_ABS, 16),  # low 32 bits of args[0] (little-endian): the address family
        *[(_JEQ, fam, "deny", None) for fam in BLOCKED_FAMILIES],
        ("label", "allow"), (_RET, _RET_ALLOW),
        ("label", "deny"), (_RET, deny),
        ("label", "kill"), (_RET, _RET_KILL_PROCESS),
    ]
    return _assemble(program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp_net_filter() -> None:
    """Irreversible for this process and its descendants. Sets no_new_privs first (required)."""
    code = seccomp_filter_bytes()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p).value)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "seccomp")


# ---------------------------------------------------------------------------------------------
# mounts (inside a fresh mount namespace only)

def private_mounts_and_proc() -> None:
    """Stop our mounts propagating to the host, then mount a procfs that shows only the new PID
    namespace (the host's processes and their command lines disappear from /proc)."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def fresh_tmpfs(path: str, size_bytes: int, mode: int = 0o1777) -> None:
    """A size-bounded tmpfs over a world-writable directory: writes there vanish with the run and
    cannot fill the host disk."""
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={size_bytes},nr_inodes=4096,mode={mode:o}")


def blocked_ancestor(path: str) -> str | None:
    """The top-most directory on `path` that other users cannot traverse (e.g. /root, 0700, when
    Python was installed under it by pyenv), or None when an unprivileged uid can reach `path`."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            if not os.stat(current).st_mode & 0o001:
                return current
        except OSError:
            return None
    return None


def bind_read_only(fd: int, target: str) -> None:
    """Bind-mount the directory open as `fd` (O_PATH, opened before the mounts hid it) on `target`."""
    os.makedirs(target, exist_ok=True)
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def is_under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


# ---------------------------------------------------------------------------------------------
# rlimits and credentials

def set_rlimits(limits: dict[str, int | tuple[int, int]]) -> None:
    """`limits` maps RLIMIT_* suffixes (e.g. 'AS', 'NPROC') to a value (soft = hard) or a
    (soft, hard) pair."""
    for name, value in limits.items():
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (soft, hard))


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid:
        raise OSError(errno.EPERM, "credentials did not change")
    try:  # paranoia: a process that can regain root must never run user code
        os.setuid(0)
    except PermissionError:
        return
    raise OSError(errno.EPERM, "setuid(0) succeeded after dropping privileges")


# ---------------------------------------------------------------------------------------------
# sweeping: kill every process of a sandbox uid (processes that left the process group)

def _status_fields(pid: str) -> tuple[set[int], str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    uids: set[int] = set()
    state = "?"
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uids = {int(x) for x in line.split()[1:]}
        elif line.startswith("State:"):
            state = line.split()[1]
    return uids, state


def pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real, effective, saved or fs uid is `uid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:  # cheap pre-filter: /proc/PID is owned by the process's effective uid
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
            except OSError:
                continue
            fields = _status_fields(entry)
            if fields and uid in fields[0] and fields[1] not in ("Z", "X"):
                out.append(int(entry))
    return out


def sweep_uid(uid: int, deadline_s: float = 5.0) -> int:
    """SIGKILL every process of `uid` until none is left; returns how many were signalled.

    A pidfd pins the process before the uid is re-checked, so a pid recycled by an unrelated
    process between listing and killing is never signalled. Loops because a fork bomb may spawn
    new processes while we kill; RLIMIT_NPROC bounds how many it can have at once.
    """
    if uid == 0:
        raise ValueError("refusing to sweep uid 0")
    killed, end = 0, time.monotonic() + deadline_s
    while True:
        pids = pids_of_uid(uid)
        if not pids:
            return killed
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                fields = _status_fields(str(pid))
                if fields and uid in fields[0]:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        if time.monotonic() > end:
            raise TimeoutError(f"processes of sandbox uid {uid} survive SIGKILL: {pids[:10]}")
        time.sleep(0.005)
