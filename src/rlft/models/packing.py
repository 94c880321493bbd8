"""Padding-free forwards: the rows of a padded micro-batch laid end to end, with position ids that
restart at 0 for every row, so no pad token is ever computed.

How transformers (5.x) keeps packed rows apart: when a forward gets `position_ids` but no
`attention_mask` and no cache, `masking_utils.find_packed_sequence_indices` starts a new sequence
wherever a position id is not the previous one plus 1, and the causal mask becomes block-diagonal
(sdpa and eager, CPU and CUDA). flash_attention_2/3 read the same resets as `cu_seqlens` (varlen
kernels), but only for a batch of one sequence (`_is_packed_sequence` checks batch_size == 1).

Bins: with a dense mask (sdpa, eager) attention over one long packed sequence costs
(sum of lengths)^2, more than the padded batch's rows x width^2. So rows go into bins no longer
than the widest row (first-fit decreasing): no bin costs more than one padded row, and the few
bins carry almost no padding. The tail of a bin that is not full is its own dummy sequence
(positions from 0 again), so it attends to nothing real and nothing attends to it. Varlen flash
kernels have no quadratic mask, so there all rows go into one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# attention implementations that honour position-id resets in a batch of several packed rows
MULTI_ROW = ("sdpa", "eager", "flex_attention")


@dataclass
class PackedRows:
    input_ids: Tensor  # [bins, L]
    position_ids: Tensor  # [bins, L]
    flat_index: Tensor  # [B, T] long: where each token of the padded batch sits in the packed [bins * L]; -1 on padding

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


def row_spans(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(first valid column, length) of every row  # [B], [B]; each row's tokens must be contiguous
    (left padding, right padding, or both, as in a rollout batch)."""
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    first = mask.long().argmax(-1)
    cols = torch.arange(mask.shape[1], device=mask.device)
    inside = (cols[None, :] >= first[:, None]) & (cols[None, :] < (first + lengths)[:, None])
    if not bool((inside == mask).all()):
        raise ValueError("packing needs each row's tokens contiguous in the attention mask (padding only at the ends)")
    return first, lengths


def fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: rows (indices) per bin, each bin's total length <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack_rows(input_ids: Tensor, attention_mask: Tensor, multi_row: bool = True, pad_id: int = 0) -> PackedRows:
    """Pack a padded batch `[B, T]`: into bins no longer than the widest row (`multi_row`, for
    dense-mask attention), or into one sequence `[1, sum(len)]` (varlen flash kernels)."""
    first, lengths = row_spans(attention_mask)
    lens = [int(n) for n in lengths.tolist()]
    starts = [int(f) for f in first.tolist()]
    widest = max(max(lens), 1)
    groups = fit_bins(lens, widest) if multi_row else [[i for i in range(len(lens)) if lens[i] > 0]]
    width = max(max(sum(lens[i] for i in g) for g in groups), 1)
    ids = torch.full((len(groups), width), pad_id, dtype=input_ids.dtype)
    pos = torch.empty((len(groups), width), dtype=torch.long)
    flat_index = torch.full(tuple(input_ids.shape), -1, dtype=torch.long)
    src = input_ids.cpu()
    for b, group in enumerate(groups):
        at = 0
        for i in group:
            n, s = lens[i], starts[i]
            ids[b, at:at + n] = src[i, s:s + n]
            pos[b, at:at + n] = torch.arange(n)
            flat_index[i, s:s + n] = torch.arange(b * width + at, b * width + at + n)
            at += n
        pos[b, at:] = torch.arange(width - at)  # the dummy tail: a sequence of its own
    device = input_ids.device
    return PackedRows(ids.to(device), pos.to(device), flat_index.to(device))
