"""Forward passes that return only what the losses need.

Logits are computed for the completion positions only (`logits_to_keep`), and log-softmax is
taken for the sampled token alone, in row chunks, so a `[B, T, V]` float32 tensor is never
materialised twice (the vocabulary of a real model is 150k wide).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding, so a padded row computes what the unpadded row would."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int = 0,
                   hidden: bool = False):
    """Logits `[B, keep, V]` for the last `keep` positions (all positions when keep == 0); with
    `hidden`, also the last hidden state of those positions `[B, keep, H]`."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask),
                use_cache=False, logits_to_keep=keep, output_hidden_states=hidden)
    if not hidden:
        return out.logits
    last = out.hidden_states[-1]
    return out.logits, (last[:, -keep:] if keep else last)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits to float32 for the softmax; float64 (exactness tests) stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def selected_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      chunk_rows: int = 16) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position: `[B, T, V], [B, T] -> [B, T]` float32."""
    out = []
    for start in range(0, logits.shape[0], chunk_rows):
        block = _upcast(logits[start:start + chunk_rows])
        if temperature != 1.0:
            block = block / temperature
        picked = block.gather(-1, targets[start:start + chunk_rows, :, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(block, dim=-1))
    return torch.cat(out)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 16) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: `[B, T, V] -> [B, T]` float32."""
    out = []
    for start in range(0, logits.shape[0], chunk_rows):
        block = _upcast(logits[start:start + chunk_rows])
        if temperature != 1.0:
            block = block / temperature
        logp = F.log_softmax(block, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float = 1.0, entropy: str = "none", hidden: bool = False):
    """Log-probs of the last `completion_len` tokens of each row (the completion region of a
    `[left-padded prompt | right-padded completion]` batch): `[B, Tc]`, plus the entropy per
    position when `entropy` is 'metric' (no gradient) or 'grad' (for an entropy bonus), plus the
    hidden states `[B, Tc, H]` of the positions that predicted them when `hidden` (a value head)."""
    out = forward_logits(model, input_ids, attention_mask, keep=completion_len + 1, hidden=hidden)
    logits, states = out if hidden else (out, None)
    logits = logits[:, :-1]  # [B, Tc, V]
    targets = input_ids[:, -completion_len:]
    logprobs = selected_logprobs(logits, targets, temperature)
    if entropy == "none":
        ent = None
    elif entropy == "grad":
        ent = entropy_from_logits(logits, temperature)
    else:
        with torch.no_grad():
            ent = entropy_from_logits(logits.detach(), temperature)
    if hidden:
        return logprobs, ent, states[:, :-1]
    return logprobs, ent


def sft_token_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Summed NLL of the target tokens (`target_mask[:, t]` marks token t as a target)."""
    logits = forward_logits(model, input_ids, attention_mask)  # [B, T, V]
    mask = target_mask[:, 1:]
    picked = logits[:, :-1][mask]  # [n_targets, V]: only target rows are upcast
    return F.cross_entropy(_upcast(picked), input_ids[:, 1:][mask], reduction="sum")
