"""The lifetime of a multi-process run's processes: none outlives the one that started it.

`python -m rlft.training.torchrun ARGS` is torchrun (torch.distributed.run ARGS) as `rlft train --nproc`
starts it (see rlft/cli/launch.py). It gets SIGTERM when the launcher dies (Linux: PR_SET_PDEATHSIG),
and a SIGINT / SIGTERM, which torchrun passes to every rank, ends it with the shell's status
(128 + the signal's number) instead of torchrun's traceback: the ranks have said where they saved.
A rank that fails ends it with that rank's status and one line, not torchrun's report: the ranks
printed their errors.
Each rank watches its own parent (`watch_parent`), so a killed torchrun leaves no rank behind.
No torch import at module level: the ranks import this early, and so do tests' stand-in ranks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "RLFT_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGTERM to this process when `parent` dies (kept across exec; Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the ranks' own parent watch still ends them
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        sys.exit(128 + signal.SIGTERM)


_watching = False


def watch_parent(grace_s: float, poll_s: float = 1.0) -> None:
    """End this process when the one that started it (torchrun) dies, instead of training on as
    an orphan: SIGTERM to itself (a rank saves and stops, as for any SIGTERM), and if it is still
    running `grace_s` later (a collective that cannot finish), exit. Once per process."""
    global _watching
    if _watching:
        return
    _watching = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="rlft-watch-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    launcher = os.environ.pop(LAUNCHER_ENV, None)
    if launcher is not None:
        die_with_parent(int(launcher))
    try:
        torchrun(argv)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:  # the ranks said why above (an `error:` line, or a bug's traceback)
        # the rank that ended by itself, not one torchrun stopped after it (SIGTERM; its times are whole seconds)
        stopped = (-signal.SIGTERM, 128 + signal.SIGTERM)
        rank, failure = min(exc.failures.items(), key=lambda f: (f[1].exitcode in stopped, f[1].timestamp, f[0]))
        code = failure.exitcode
        print(f"rlft: rank {rank} ended with status {code}; the job stopped (the ranks' errors are above)",
              file=sys.stderr)
        return code if code > 0 else 128 - code if code < 0 else 1  # -N: killed by signal N
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
