"""Hostile programs against the code sandbox.

Every program here is only ever passed to `run_program` (never run in this process). For each:
no test credit, nothing outside its temp dir changes (a canary tree is hashed before and after),
no process of a sandbox uid (or a harness fork) survives 2 s later, and this process lives.
The programs run concurrently so the suite stays fast.
"""

import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlft.rewards.code import isolation_layers, run_program
from rlft.rewards.code import sandbox

TIMEOUT = 2.0
EXPECTED = "expected-" + secrets.token_hex(6)
STDIO = {"cases": [{"stdin": "1\n", "stdout": EXPECTED}, {"stdin": "2\n", "stdout": EXPECTED}]}
CALL = {"fn_name": "solve", "cases": [{"input": [1], "output": EXPECTED}, {"input": [2], "output": [EXPECTED]}]}


def make_canary(root: Path) -> Path:
    canary = root / "canary"
    (canary / "sub").mkdir(parents=True)
    for name, text in (("a.txt", "alpha"), ("sub/b.txt", "beta"), ("victim.txt", "keep me")):
        (canary / name).write_text(text)
        (canary / name).chmod(0o666)
    for d in (canary, canary / "sub"):
        d.chmod(0o777)  # world-writable: only the sandbox, not file modes, protects it
    return canary


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        h.update(f"{path.relative_to(root)}|{st.st_mode}|{st.st_size}".encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def leftover_processes() -> list[str]:
    """Processes of a sandbox uid, or forks of the harness, still alive."""
    pool = range(sandbox.UID_BASE, sandbox.UID_BASE + sandbox.UID_POOL_SIZE)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        uids = {int(x) for x in status.split("\nUid:")[1].split("\n")[0].split()}
        state = status.split("\nState:")[1].split()[0]
        if state not in ("Z", "X") and (uids & set(pool) or "harness.py" in cmdline):
            found.append(f"{entry}: {cmdline[:80]}")
    return found


def hostile_programs(canary: Path, port: int) -> dict[str, tuple[str, dict]]:
    trainer = os.getpid()
    pwned, victim = canary / "pwned", canary / "victim.txt"
    return {
        "rm_rf_home_os_system": (f"import os\nos.system('rm -rf ~ {canary} 2>/dev/null')\nprint('PASSED')", STDIO),
        "rmtree_home": (f"import os, shutil\nshutil.rmtree(os.path.expanduser('~'), ignore_errors=True)\n"
                        f"shutil.rmtree('{canary}', ignore_errors=True)\nprint('ok')", STDIO),
        "subprocess_shell": (f"import subprocess\nsubprocess.run(['touch', '{pwned}'])\n"
                             f"subprocess.run('echo x > {victim}; touch {pwned}', shell=True)\nprint('ok')", STDIO),
        "ctypes_libc_system": (f"import ctypes\nctypes.CDLL(None).system(b'touch {pwned}; rm -f {victim}')\nprint(1)", STDIO),
        "subclasses_escape": ("w = [c for c in ().__class__.__bases__[0].__subclasses__() if c.__name__ == '_wrap_close'][0]\n"
                              f"w.__init__.__globals__['system']('touch {pwned}')\nprint(1)", STDIO),
        "write_outside": (f"for p in ['{victim}', '{pwned}', '/etc/rlft-pwned']:\n"
                          "    try:\n        open(p, 'w').write('x')\n    except OSError as e:\n        print(e)", STDIO),
        "kill_parents": (f"import os, signal\nfor pid in (os.getppid(), {trainer}, 1):\n"
                         "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(e)\n"
                         f"try:\n    os.killpg(os.getpgid({trainer}), signal.SIGKILL)\nexcept OSError as e:\n    print(e)\n"
                         "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print(e)\nprint('alive')", STDIO),
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", STDIO),
        "daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                   "        time.sleep(1.0)\n"
                   f"        for p in ('{pwned}', os.path.expanduser('~/still-here')):\n"
                   "            try:\n                open(p, 'w').write('x')\n            except OSError:\n                pass\n"
                   "        while True:\n            time.sleep(0.1)\n    os._exit(0)\nprint('started')", STDIO),
        "infinite_loop": ("while True:\n    pass", STDIO),
        "endless_input": ("while True:\n    input()", STDIO),
        "print_1gb": ("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)", STDIO),
        # one file past RLIMIT_FSIZE, then many just under it: the private tmpfs fills, not the disk
        "huge_file": ("import os\nwith open(os.path.expanduser('~/big'), 'wb') as f:\n"
                      "    for _ in range(1024):\n        f.write(b'x' * (1 << 20))", STDIO),
        "many_files": ("import os\nfor i in range(64):\n    with open(os.path.expanduser(f'~/big{i}'), 'wb') as f:\n"
                       "        for _ in range(60):\n            f.write(b'x' * (1 << 20))", STDIO),
        "memory_bomb": ("try:\n    x = bytearray(8 << 30)\nexcept MemoryError:\n    pass\n"
                        "a = []\nwhile True:\n    a.append(bytearray(64 << 20))", STDIO),
        "socket_outside": ("import socket\ns = socket.create_connection(('8.8.8.8', 53), timeout=1)\n"
                           "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nu.sendto(b'x', ('8.8.8.8', 53))\nprint('sent')", STDIO),
        "socket_localhost": (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                             "s.sendall(b'hello')\nprint('connected')", STDIO),
        "sys_exit_first": ("import sys\nsys.exit(0)\nprint('never')", STDIO),
        "os_exit_first": ("import os\nos._exit(0)\ndef solve(x):\n    return x", CALL),
        "eq_always_true": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                           "    def __ne__(self, other):\n        return False\n"
                           "class Text(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n"
                           "def solve(x):\n    return Anything() if x == 1 else [Text('no')]", CALL),
        "skip_test": ("import unittest\nraise unittest.SkipTest('skip')\ndef solve(x):\n    return x", CALL),
        "write_conftest": ("import os\nsrc = 'import pytest\\ndef pytest_runtest_makereport(item, call):\\n    pass\\n'\n"
                           f"for d in ('.', os.path.expanduser('~'), '{canary}'):\n"
                           "    try:\n        open(os.path.join(d, 'conftest.py'), 'w').write(src)\n    except OSError:\n        pass\n"
                           "print('PASSED')", STDIO),
        "print_passed": ("print('PASSED')\nprint('All tests passed')\nprint('OK')", STDIO),
    }


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.setblocking(False)
    yield srv
    srv.close()


def accepted(srv: socket.socket) -> bool:
    try:
        srv.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def test_hostile_programs_get_no_credit_and_leave_no_trace(tmp_path, listener):
    assert isolation_layers()["working"]
    canary = make_canary(tmp_path)
    before = tree_hash(canary)
    programs = hostile_programs(canary, listener.getsockname()[1])
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        verdicts = dict(zip(programs, pool.map(lambda p: run_program(p[0], p[1], timeout=TIMEOUT), programs.values())))
    elapsed = time.monotonic() - start
    time.sleep(2.0)  # a process that escaped would act (and be visible) now
    problems = [f"{name}: {v.status} score={v.score} parts={v.parts} {v.message}"
                for name, v in verdicts.items() if v.score is None or v.parts["tests"] != 0.0]
    assert not problems, "\n".join(problems)
    assert tree_hash(canary) == before
    assert not (canary / "pwned").exists() and not Path("/etc/rlft-pwned").exists()
    assert not accepted(listener)
    assert not leftover_processes()
    assert os.getpid() > 0 and elapsed < 60  # still here, and quick
    # each failure is the expected kind of failure (not, say, a sandbox that never ran the code)
    assert verdicts["infinite_loop"].status == "timeout"
    assert verdicts["print_1gb"].status == "output_limit"
    assert verdicts["endless_input"].status == "runtime_error"
    assert verdicts["eq_always_true"].status == "runtime_error"
    assert "not plain JSON" in verdicts["eq_always_true"].cases[0].detail
    assert verdicts["kill_parents"].status == "wrong_answer"  # it ran to the end and printed
    assert "File too large" in verdicts["huge_file"].cases[0].detail
    assert "No space left" in verdicts["many_files"].cases[0].detail or verdicts["many_files"].status == "timeout"


@pytest.mark.parametrize("disable, errno_name", [(["netns"], "EACCES"), (["seccomp"], "ENETUNREACH")])
def test_each_network_layer_alone_blocks_localhost_and_outside(listener, disable, errno_name):
    """Force one layer off: seccomp alone (the fallback where namespaces are unavailable) and the
    network namespace alone each stop a connection. The verdict itself says whether it failed
    (expected output 'blocked ...'), and the listener saw nothing."""
    code = ("import errno, socket\n"
            f"for addr in [('127.0.0.1', {listener.getsockname()[1]}), ('8.8.8.8', 53)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=1)\n        print('connected')\n"
            "    except OSError as e:\n        print('blocked', errno.errorcode.get(e.errno, e))\n")
    expected = f"blocked {errno_name}\nblocked {errno_name}"
    v = run_program(code, {"cases": [{"stdin": "", "stdout": expected}]}, timeout=5, disable=disable)
    assert v.layers[disable[0]] is False and all(v.layers[k] for k in {"netns", "seccomp"} - set(disable))
    assert v.status == "ok", v.message
    assert not accepted(listener)


def test_the_network_check_can_fail(listener):
    """With both network layers off (a harmless connect to our own listener), the connection
    goes through: the test above would notice a sandbox that does not block."""
    code = (f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=2)\n"
            "print('connected')\n")
    v = run_program(code, {"cases": [{"stdin": "", "stdout": "connected"}]}, timeout=5, disable=["netns", "seccomp"])
    assert v.status == "ok", v.message
    assert accepted(listener)


def test_daemon_is_swept_without_pid_namespace(tmp_path):
    """Force the fallback: no PID namespace, so the uid sweep must end a setsid daemon."""
    if os.geteuid() != 0:
        pytest.skip("the uid sweep needs root")
    marker = tmp_path / "alive"
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        while True:\n            time.sleep(0.1)\n    os._exit(0)\nprint('started')")
    v = run_program(daemon, {"cases": [{"stdin": "", "stdout": "started"}]}, timeout=5, disable=["pidns"])
    assert v.layers["pidns"] is False and v.status == "ok", v.message
    time.sleep(1.0)
    assert not leftover_processes()
    assert not marker.exists()


def test_a_dying_trainer_takes_its_sandboxes_with_it():
    """SIGKILL the process that called run_program mid-run: the harness and everything under it
    must go too (parent-death signal on the harness and the zygote), not linger until timeout."""
    workdirs = set(sandbox._sandbox_root().glob("run-*"))
    trainer = subprocess.Popen([sys.executable, "-c", (
        "from rlft.rewards.code import run_program\n"
        "run_program('while True:\\n    pass', {'cases': [{'stdin': '', 'stdout': 'x'}]}, timeout=60)\n")])
    try:
        deadline = time.monotonic() + 30
        while not leftover_processes():  # wait for the sandbox to be running
            assert time.monotonic() < deadline and trainer.poll() is None, "the sandbox never started"
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 2.0
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leftover_processes()
    for stale in set(sandbox._sandbox_root().glob("run-*")) - workdirs:  # its finally never ran
        shutil.rmtree(stale, ignore_errors=True)
