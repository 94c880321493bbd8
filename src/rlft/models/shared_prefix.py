"""Each prompt once per group: the G completions of a prompt packed behind one copy of it.

A GRPO group is G rows `[prompt | completion k]` with the same prompt. Here the rows of a
micro-batch that share a prompt become one segment `[prompt | c1 | c2 | ... | ck]`:
- position ids run 0..p-1 over the prompt and restart at p for every completion, so each token
  sits at the position it has in its own row;
- a 4D attention mask lets a prompt token see the prompt causally, and a completion token see the
  whole prompt and its own completion causally, never another completion.
Every completion token then attends to exactly the keys/values it has in its own row, so the
outputs equal the plain forward's; the prompt's tokens are computed once, and autograd sums the
gradient the k completions send into them (the state of the prompt's last token, which predicts
every completion's first token, is gathered k times and its gradient summed by the gather).

Segments (and rows whose prompt no other row shares) go into bins, first-fit decreasing, no
longer than the longest segment; a bin's unused tail is its own dummy sequence. The mask is dense:
sdpa and eager compute every query-key pair of a bin, masked or not. A segment of G long
completions can cost more attention than it saves, so `auto` splits a group into segments of k
completions by a cost model (`AttentionCost`), and keeps the plain layout when that is cheaper.

Only transformers' attention implementations that honour a custom 4D mask can take this (eager,
sdpa); `supports_shared_prefix` checks it once per model on a small batch against the plain
forward (flash-attention kernels take no 4D mask: the probe fails, the plain path is used).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from rlft.models.packing import fit_bins, row_spans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionCost:
    """Relative cost of the work a forward does: `token` per token through a layer's linears,
    `pair` per query-key pair a layer's attention computes (dense, masked or not)."""

    token: float
    pair: float

    @classmethod
    def of(cls, config: Any) -> "AttentionCost":
        """From a transformers config (see `from_shape`)."""
        cfg = getattr(config, "text_config", None) or config
        h = int(getattr(cfg, "hidden_size", 0) or 0)
        if not h:
            return cls(1.0, 0.0)
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        return cls.from_shape(h, heads, int(getattr(cfg, "head_dim", None) or h // heads),
                              int(getattr(cfg, "num_key_value_heads", None) or heads),
                              int(getattr(cfg, "intermediate_size", None) or 4 * h))

    @classmethod
    def from_shape(cls, hidden: int, heads: int, head_dim: int, kv_heads: int, intermediate: int) -> "AttentionCost":
        """2 FLOPs per weight for the linears (q, k, v, o, a gated MLP), 4 per pair and head
        dimension for QK^T and PV, plus about 16 per pair and head for the mask, softmax and their
        backward, which run at memory speed (a rough figure: it only has to rank layouts whose
        costs differ by large factors)."""
        token = 2.0 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate)
        return cls(token, 4.0 * heads * head_dim + 16.0 * heads)

    def segment(self, prompt: int, completions: list[int]) -> float:
        n = prompt + sum(completions)
        return self.token * n + self.pair * n * n


@dataclass
class SharedRows:
    """A padded batch `[B, W]` laid out with shared prompts; `flat_index` maps each real token of
    the batch to its place in the flattened `[bins * L]` layout (rows sharing a prompt map their
    prompt tokens to the same places); -1 on padding."""

    input_ids: Tensor  # [bins, L]
    position_ids: Tensor  # [bins, L]
    segment: Tensor  # [bins, L] long: tokens of different segments never see each other
    part: Tensor  # [bins, L] long: 0 on a prompt, k >= 1 on the k-th completion of its segment
    flat_index: Tensor  # [B, W] long
    shared_rows: int  # rows whose prompt is computed for another row too

    def attention_mask(self, kind: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """`[bins, 1, L, L]`: True (or 0 in an additive mask) where query i may attend key j."""
        cols = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        same = self.segment[:, :, None] == self.segment[:, None, :]
        causal = (cols[None, :] <= cols[:, None])[None]
        visible = (self.part[:, None, :] == 0) | (self.part[:, None, :] == self.part[:, :, None])
        allowed = (same & causal & visible)[:, None]  # [bins, 1, Lq, Lk]
        if kind == "bool":
            return allowed
        # eager attention adds the mask to the scores (transformers' own eager masks are additive)
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)


@dataclass
class _Segment:
    prompt: tuple[int, int]  # (row, first column) of the prompt copy it computes
    prompt_len: int
    rows: list[int]  # rows whose completion follows, in order


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> Tensor:
    """Index of each row's prompt among the batch's distinct prompts  # [B]. A prompt is the
    row's real tokens in the first `prompt_width` columns (left-padded)."""
    prompts = input_ids[:, :prompt_width].masked_fill(~attention_mask[:, :prompt_width].bool(), -1)
    return torch.unique(prompts, dim=0, return_inverse=True)[1]


def share_prefixes(input_ids: Tensor, attention_mask: Tensor, prompt_width: int,
                   cost: AttentionCost | None = None, pad_id: int = 0) -> SharedRows | None:
    """The shared-prompt layout of a `[left-padded prompt | right-padded completion]` batch whose
    prompts fill the first `prompt_width` columns. `cost`: split groups into segments where that
    is cheaper and return None when the plain padding-free layout is (None: one segment per
    group). Also None when no two rows share a prompt."""
    if prompt_width <= 0:
        return None
    first, lengths = row_spans(attention_mask)
    starts, lens = first.tolist(), lengths.tolist()
    group_of = prompt_groups(input_ids, attention_mask, prompt_width).tolist()
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group_of):
        if lens[row] > 0:
            members.setdefault(g, []).append(row)
    def completion(r: int) -> int:  # tokens after the prompt columns
        return starts[r] + lens[r] - max(prompt_width, starts[r])

    segments = []
    for rows in members.values():
        p = max(prompt_width - starts[rows[0]], 0)  # the same prompt: the same first column
        k = len(rows) if cost is None else completions_per_segment(cost, p, [completion(r) for r in rows])
        k = k if p else 1  # no prompt tokens: nothing to share
        segments += [_Segment((rows[i], starts[rows[i]]), p, rows[i:i + k]) for i in range(0, len(rows), k)]
    if all(len(s.rows) == 1 for s in segments):
        return None
    seg_lens = [s.prompt_len + sum(completion(r) for r in s.rows) for s in segments]
    if cost is not None and _layout_cost(cost, seg_lens) >= _layout_cost(cost, [n for n in lens if n > 0]):
        return None
    return _lay_out(input_ids, prompt_width, segments, seg_lens, starts, lens, pad_id)


def completions_per_segment(cost: AttentionCost, prompt: int, outs: list[int]) -> int:
    """How many of a group's completions to put behind one prompt copy: the cheapest k."""
    def total(k: int) -> float:
        return sum(cost.segment(prompt, outs[i:i + k]) for i in range(0, len(outs), k))

    return min(range(1, len(outs) + 1), key=lambda k: (total(k), -k))


def _layout_cost(cost: AttentionCost, seg_lens: list[int]) -> float:
    """Tokens plus dense attention of first-fit-decreasing bins as wide as the longest segment."""
    width = max(seg_lens)
    return cost.token * sum(seg_lens) + cost.pair * len(fit_bins(seg_lens, width)) * width * width


def _lay_out(input_ids: Tensor, prompt_width: int, segments: list[_Segment], seg_lens: list[int],
             starts: list[int], lens: list[int], pad_id: int) -> SharedRows:
    width = max(seg_lens)
    bins = fit_bins(seg_lens, width)
    shape = (len(bins), width)
    ids = torch.full(shape, pad_id, dtype=input_ids.dtype)
    pos = torch.empty(shape, dtype=torch.long)
    seg_id = torch.empty(shape, dtype=torch.long)
    part = torch.empty(shape, dtype=torch.long)
    flat = torch.full(tuple(input_ids.shape), -1, dtype=torch.long)
    src = input_ids.cpu()
    shared, n_seg = 0, 0
    for b, members in enumerate(bins):
        at = 0
        for s in (segments[i] for i in members):
            row, col = s.prompt
            p = s.prompt_len
            ids[b, at:at + p], pos[b, at:at + p], part[b, at:at + p] = src[row, col:col + p], torch.arange(p), 0
            seg_id[b, at:at + p] = n_seg
            prompt_at = torch.arange(b * width + at, b * width + at + p)
            at += p
            for k, r in enumerate(s.rows, start=1):
                c0 = max(prompt_width, starts[r])
                n = starts[r] + lens[r] - c0
                ids[b, at:at + n], pos[b, at:at + n] = src[r, c0:c0 + n], p + torch.arange(n)
                seg_id[b, at:at + n], part[b, at:at + n] = n_seg, k
                flat[r, c0 - p:c0] = prompt_at
                flat[r, c0:c0 + n] = torch.arange(b * width + at, b * width + at + n)
                at += n
            shared += len(s.rows) - 1
            n_seg += 1
        pos[b, at:] = torch.arange(width - at)  # the dummy tail: a segment of its own
        seg_id[b, at:], part[b, at:] = n_seg, 1
        n_seg += 1
    device = input_ids.device
    return SharedRows(ids.to(device), pos.to(device), seg_id.to(device), part.to(device), flat.to(device), shared)


# ---------------------------------------------------------------------------------------------
# Which models take it: checked once per module


Forward = Callable[[Tensor, Tensor | None, Tensor], Tensor]  # (ids, 4D mask, positions) -> [b, L, X]

_KINDS: "weakref.WeakKeyDictionary[Any, str | None]" = weakref.WeakKeyDictionary()


def mask_kind(module: Any, run: Forward, vocab: int, device: torch.device, probing: Callable[[], Any]) -> str | None:
    """The 4D mask `module` takes ('bool' for sdpa and others, 'additive' for eager), or None when
    a probe shows that the shared layout does not give what each row gives alone. The probe runs
    once per module, inside `probing()` (no gradients, eval mode)."""
    if module not in _KINDS:
        impl = str(getattr(getattr(module, "config", None), "_attn_implementation", None) or "eager")
        kind = "additive" if impl == "eager" else "bool"
        with probing():
            works = _probe(run, kind, vocab, device)
        if not works:
            log.warning("%s (attention %s): a custom 4D attention mask is not honoured; each prompt is computed once "
                        "per row (training.shared_prefix has no effect)", type(module).__name__, impl)
            kind = None
        _KINDS[module] = kind
    return _KINDS[module]


def _probe(run: Forward, kind: str, vocab: int, device: torch.device) -> bool:
    """Two prompts (3 and 5 tokens) with completions of 2, 4, 1 and 3, 2 tokens: the shared layout
    gives each row's outputs alone, at float32 rounding of the model's dtype."""
    torch_ids = (torch.arange(40, device=device) * 7 + 3) % vocab
    prompts = [torch_ids[:3], torch_ids[3:8]]
    rows = [(0, 2), (0, 4), (0, 1), (1, 3), (1, 2)]
    width_p, width_c = 5, 4
    batch = torch.zeros(len(rows), width_p + width_c, dtype=torch.long, device=device)
    mask = torch.zeros_like(batch)
    singles = []
    for i, (g, n) in enumerate(rows):
        p = prompts[g]
        comp = torch_ids[10 + 5 * i:10 + 5 * i + n]
        batch[i, width_p - len(p):width_p], batch[i, width_p:width_p + n] = p, comp
        mask[i, width_p - len(p):width_p + n] = 1
        singles.append(torch.cat([p, comp]))
    layout = share_prefixes(batch, mask, width_p)
    try:
        out = run(layout.input_ids, layout.attention_mask(kind), layout.position_ids)
        flat = out.reshape(-1, out.shape[-1])
        for i, row in enumerate(singles):
            alone = run(row[None], None, torch.arange(len(row), device=device)[None])[0]
            got = flat[layout.flat_index[i][mask[i].bool()]]
            tol = 1e-3 if alone.dtype == torch.float32 else 5e-2
            if not bool(((got.float() - alone.float()).abs().max()) <= tol * max(1.0, float(alone.abs().max()))):
                return False
    except Exception as exc:  # an implementation that refuses a 4D mask
        log.info("shared-prefix probe failed: %s", exc)
        return False
    return True


def window_allows(config: Any, longest_row: int) -> bool:
    """A sliding-window layer masks by distance, which the custom mask does not: only rows no
    longer than the window (where it masks nothing) may be laid out this way."""
    cfg = getattr(config, "text_config", None) or config
    window = getattr(cfg, "sliding_window", None)
    active = window is not None and getattr(cfg, "use_sliding_window", True) is not False
    return not active or longest_row <= int(window)
