"""The C heap on CPU runs: hand its free pages back to the operating system between the phases of an
online step when memory is tight, keep them when it is not.

On CPU every tensor is a malloc. glibc serves allocations below its mmap threshold from its heaps,
and the threshold rises with the first large free (to the size freed, up to 32 MiB): after that, a
micro-batch's activations of a few MiB to a few tens of MiB each live in the heap, and when they
are freed the pages stay resident. The next phase allocates tensors of other sizes (sampling's KV
cache and decode buffers after the update's activations, and back), which do not all fit the
holes, so the resident set grows past the live tensors. `malloc_trim(0)` returns every whole free
page of the heaps (madvise), at the cost of faulting them in again when reused.

Measured on the ~28M model's GRPO step (bf16-mixed, 32 rows x 146 tokens, 1 thread; numbers in
benchmarks/README.md, the memory fit): trimming after sampling and after the update lowered the
peak RSS by 70-200 MB, the step time within the run-to-run spread. Only CPU runs on glibc do it;
elsewhere (macOS, musl, a CUDA device, whose host side does not hold the activations) it does
nothing.

Trimming has a price: every page handed back is faulted in (and zeroed by the kernel) again when the
next phase allocates, and in a virtual machine a fault can cost far more than on bare metal.
Measured on a 2-core Xeon VM (the bench's large-full config, fp32, 4 steps, one thread, back to
back, medians of steps 2-4): trimming, 2.9-3.0M minor faults, 16.8-18.8 s of system time, 16.2-16.7
s/step; without the trims and with `keep_freed_pages`, 0.77-0.81M faults, 7.5-9.4 s, 12.9-13.0
s/step, peak RSS 3041-3201 MB (trimming: 3113-3208). bf16-mixed (the bench's large-full-defaults),
without the trims: 8.43 -> 7.05 s/step, peak RSS 2652 -> 2864 MB. So a run trims only when its
memory plan says memory is tight (`memory_fit.Fit.roomy` false); otherwise `keep_freed_pages` also
raises glibc's mmap and trim thresholds, so a step's large tensors are served from pages an
earlier step already faulted in (glibc's own thresholds stop at 32 MiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache
from typing import Any, Callable

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# allocations below this come from the heap, not from a fresh mapping each (a step's largest
# activations on a 7B model are a few hundred MiB); the heap's free top is returned above this
MMAP_THRESHOLD, TRIM_THRESHOLD = 256 * 2**20, 1024 * 2**20


def _libc_function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A glibc function by name, or None (not glibc: macOS, musl)."""
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    return _libc_function("malloc_trim", [ctypes.c_size_t])


@lru_cache(maxsize=1)
def _mallopt() -> Callable[[int, int], int] | None:
    return _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])


def keep_freed_pages(device: Any) -> bool:
    """Memory is plentiful: let glibc keep freed memory for reuse instead of unmapping or trimming
    it (process-wide, for the rest of the process). True where it took effect (CPU, glibc)."""
    if device.type != "cpu":
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # both set: glibc then stops adjusting the thresholds itself
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_free_heap(device: Any) -> None:
    """Return the heap's free pages to the OS when `device` (a torch.device) is the CPU."""
    if device.type != "cpu":
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
