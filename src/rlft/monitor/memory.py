"""Peak live tensor bytes on CPU, to check the memory planner against real training steps.

A process's RSS on CPU is dominated by the runtime (libraries, allocator caches, Python), so it
cannot tell whether a planner's activation estimate is right. What the planner predicts is the
bytes held by tensor storages at once; this measures exactly that.

How: a `TorchDispatchMode` sees every tensor operation (forward, autograd's backward, the
optimizer) below autograd. Each storage an operation reads or writes is registered the first time
it is seen, with its size; a `weakref.finalize` on the storage's Python object subtracts the size
when the storage is freed. Storage Python objects are preserved by torch for as long as the C++
storage lives (also when only the autograd graph holds it), so the finalizer fires at the real
free, not when a Python name goes away.

What is not counted: storages that no operation touches while the tracker is on (a tensor made
before entry and never used again), and memory that is not a tensor storage (allocator slack,
the Python heap). Pre-existing tensors (the model's weights) are counted from their first use.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class MemoryReport:
    peak_bytes: int
    current_bytes: int
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the peak while each phase was on

    def table(self) -> str:
        rows = [("peak", self.peak_bytes), *sorted(self.phase_peaks.items())]
        return "\n".join(f"{name:<24} {b / 2**20:10.2f} MiB" for name, b in rows)


class LiveTensorTracker(TorchDispatchMode):
    """Context manager: peak of live tensor-storage bytes on one device type (default CPU).

        with LiveTensorTracker() as tracker:
            with tracker.phase("update"):
                loss.backward()
        tracker.peak_bytes, tracker.phase_peaks["update"]
    """

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device = torch.device(device).type
        self.current_bytes = 0
        self.peak_bytes = 0
        self.phase_peaks: dict[str, int] = {}
        self._phases: list[str] = []
        self._live: dict[int, int] = {}  # id(storage object) -> bytes counted for it

    # -- bookkeeping ------------------------------------------------------------------------
    def _release(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def _see(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device or tensor.is_sparse or tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. nested wrappers)
            return
        key, size = id(storage), storage.nbytes()
        known = self._live.get(key)
        if known is None:
            weakref.finalize(storage, self._release, key)
            self._live[key] = size
            self._grow(size)
        elif known != size:  # resized in place (resize_, set_)
            self._live[key] = size
            self._grow(size - known)

    def _grow(self, delta: int) -> None:
        self.current_bytes += delta
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        for name in self._phases:
            if self.current_bytes > self.phase_peaks.get(name, 0):
                self.phase_peaks[name] = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten((args, kwargs, out))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._see(leaf)
        return out

    # -- phases -----------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak reached while this block runs (also counted in the overall peak)."""
        self._phases.append(name)
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current_bytes)
        try:
            yield
        finally:
            self._phases.remove(name)

    def report(self) -> MemoryReport:
        return MemoryReport(self.peak_bytes, self.current_bytes, dict(self.phase_peaks))


def track_phase(tracker: LiveTensorTracker, owner: Any, attribute: str, name: str) -> Any:
    """Wrap `owner.attribute` (a function or method) so each call runs inside `tracker.phase(name)`;
    returns the original, to restore with `setattr(owner, attribute, original)`."""
    original = getattr(owner, attribute)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with tracker.phase(name):
            return original(*args, **kwargs)

    setattr(owner, attribute, wrapped)
    return original
