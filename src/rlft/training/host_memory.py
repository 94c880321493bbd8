"""Hand the C heap's free pages back to the operating system between the phases of an online step.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache
from typing import Any, Callable


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap(device: Any) -> None:
    """Return the heap's free pages to the OS when `device` (a torch.device) is the CPU."""
    if device.type != "cpu":
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
