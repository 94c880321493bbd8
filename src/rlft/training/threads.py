"""How many CPU threads torch uses for a run, given how busy the machine is.

OpenMP threads busy-wait for each other: with torch's default (one per core) and another job on
one of two cores, every example trained 10-40x slower than with one thread. So when
`training.num_threads` is unset the run takes at most the cores the 1-minute load average leaves
free (at least one), and when it is set above that, it says so.
"""

from __future__ import annotations

import os
from typing import Callable


def cores_and_load() -> tuple[int, float] | None:
    """(cores this process may run on, 1-minute load average), or None where the platform has no
    load average (Windows)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return cores, load


def choose_threads(requested: int | None, default: int, cores: int, load: float,
                   processes: int = 1, workers: int = 1) -> tuple[int, str, bool]:
    """(threads, the line that says why, whether that line is a warning). `default`: what torch
    would use; `processes`: ranks of this run sharing the machine (torchrun), each getting its
    share of the free cores; `workers`: threads of one process running torch at once (an async
    run's sampler and trainer), each taking `threads` (torch's count holds in every thread)."""
    free = max(1, (cores - int(load)) // max(processes * workers, 1))
    state = f"the 1-minute load average {load:.1f} leaves {free} of {cores} cores free" + (
        f" per process ({processes} processes)" if processes > 1 else "") + (
        " per thread (the rollout sampler and the trainer run at once)" if workers > 1 else "")
    if requested is None:
        threads = max(1, min(default, free))
        why = "torch's default;" if threads == default else f"torch would use {default}, but"
        return threads, (f"threads: {threads} (training.num_threads unset; {why} {state}; set "
                         "training.num_threads to choose)"), False
    if requested > free:
        return requested, (f"training.num_threads={requested}, but {state}: threads waiting on busy cores can make "
                           f"every step 10-40x slower. Set training.num_threads={free} (or leave it unset to "
                           "choose by load)"), True
    return requested, "", False


def set_run_threads(requested: int | None, say: Callable[[str, bool], None], workers: int = 1) -> int:
    """Set torch's thread count for this process as `choose_threads` decides; `say(line,
    is_warning)` gets its line. Returns the count."""
    import torch

    measured = cores_and_load()
    if measured is None:  # no load to go by: what the user asked for, else torch's own choice
        if requested:
            torch.set_num_threads(requested)
        return torch.get_num_threads()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    threads, line, warning = choose_threads(requested, torch.get_num_threads(), *measured, processes=processes,
                                            workers=workers)
    torch.set_num_threads(threads)
    if line:
        say(line, warning)
    return threads
