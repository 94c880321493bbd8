"""The order rows are visited in: seeded, reshuffled every epoch, and resumable from a position."""

from __future__ import annotations

from typing import Callable

import torch


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """A permutation of range(n) for this epoch (the identity without shuffling); the same for the
    same (seed, epoch), so a resumed run visits rows exactly as an uninterrupted one."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


class PromptSampler:
    """An endless stream of row indices, epoch after epoch (online RL draws k prompts per step,
    across epoch boundaries); its position is checkpointed for exact resume."""

    def __init__(self, n: int, seed: int, shuffle: bool = True, order: Callable[[int], list[int]] | None = None):
        """`order(epoch)`: the epoch's `n` indices (mixed sources, data/mixing.py); default a
        seeded permutation of range(n)."""
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._order = order or (lambda epoch: epoch_order(n, seed, epoch, shuffle))
        self._cached: tuple[int, list[int]] | None = None
        self.epoch, self.index = 0, 0

    def _epoch_order(self) -> list[int]:
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (self.epoch, self._order(self.epoch))
        return self._cached[1]

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            grab = self._epoch_order()[self.index:self.index + (k - len(out))]
            out += grab
            self.index += len(grab)
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    @property
    def drawn(self) -> int:
        """Prompts drawn so far: the next one's draw number (it names the prompt's episode seeds)."""
        return self.epoch * self.n + self.index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


class BatchCursor:
    """Where an offline run is: epoch and batch within it (batches never cross an epoch)."""

    def __init__(self) -> None:
        self.epoch, self.batch = 0, 0

    def advance(self, steps_per_epoch: int) -> None:
        self.batch += 1
        if self.batch == steps_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = state["epoch"], state["batch"]
