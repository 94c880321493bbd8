"""`RolloutBatch`: completions as padded tensors with explicit masks.

Layout `[left-padded prompt | right-padded completion]`: every completion starts at the same
column, so a forward pass computes logits for the completion columns only (`logits_to_keep`), and
per-token tensors are `[N, T]` over completion positions. Padding is never inside
`completion_mask`, so it never reaches a loss or a metric.

`completion_mask` is the one loss mask: the tokens the policy sampled. A multi-turn episode's
inserted tool/environment tokens are attended to (`attention_mask`) but are not in it, so every
loss, KL, entropy, advantage and per-token metric that takes it skips them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlft.rollout.contract import Completion


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, P + T]
    attention_mask: torch.Tensor  # [N, P + T]
    completion_mask: torch.Tensor  # [N, T] bool: sampled by the policy (the loss mask)
    sampling_logprobs: torch.Tensor  # [N, T] float32, 0 on padding and inserted tokens
    group_ids: torch.Tensor  # [N] long
    truncated: torch.Tensor  # [N] bool: finish_reason == 'length'

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]

    @classmethod
    def from_completions(cls, completions: list[Completion], group_ids: list[int], pad_id: int,
                         device: torch.device) -> "RolloutBatch":
        n = len(completions)
        p = max(len(c.prompt_ids) for c in completions)
        t = max(1, max(len(c.completion_ids) for c in completions))
        input_ids = torch.full((n, p + t), pad_id, dtype=torch.long)
        attention = torch.zeros((n, p + t), dtype=torch.long)
        cmask = torch.zeros((n, t), dtype=torch.bool)
        logprobs = torch.zeros((n, t), dtype=torch.float32)
        for i, c in enumerate(completions):
            lp, lc = len(c.prompt_ids), len(c.completion_ids)
            input_ids[i, p - lp:p] = torch.tensor(c.prompt_ids)
            input_ids[i, p:p + lc] = torch.tensor(c.completion_ids, dtype=torch.long)
            attention[i, p - lp:p + lc] = 1
            cmask[i, :lc] = torch.tensor(c.mask, dtype=torch.bool)
            logprobs[i, :lc] = torch.tensor(c.logprobs)
        logprobs = logprobs.where(cmask, 0.0)
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        return cls(input_ids.to(device), attention.to(device), cmask.to(device), logprobs.to(device),
                   torch.tensor(group_ids, device=device), truncated.to(device))

    def loss_mask(self, mask_truncated: bool = False) -> torch.Tensor:
        """The tokens every loss and per-token metric takes  # [N, T] bool: sampled by the policy,
        less the rows cut at their length limit when `mask_truncated` (DAPO's overlong filter)."""
        return self.completion_mask & ~self.truncated[:, None] if mask_truncated else self.completion_mask

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        """A subset of rows with the columns that are padding for all of them trimmed away."""
        sub = RolloutBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})
        used_prompt = sub.attention_mask[:, : -self.completion_len].any(0)
        first = int(used_prompt.nonzero()[0]) if used_prompt.any() else 0
        # by attention, not the loss mask: an inserted token after the last sampled one stays in the row
        used = sub.attention_mask[:, -self.completion_len:].bool().any(0)
        last = int(used.nonzero().max()) + 1 if used.any() else 1
        keep_cols = self.input_ids.shape[1] - self.completion_len + last
        return RolloutBatch(sub.input_ids[:, first:keep_cols], sub.attention_mask[:, first:keep_cols],
                            sub.completion_mask[:, :last], sub.sampling_logprobs[:, :last], sub.group_ids,
                            sub.truncated)
