"""The one place that turns a per-token loss [N, T] into the scalar that is back-propagated.

Pass the GLOBAL normalisers (tokens / sequences in the whole optimizer batch, across micro-batches
and ranks): then the sum of the micro-batch losses equals the full-batch loss, and so do the
gradients. With the per-micro-batch defaults, gradient accumulation silently re-weights samples.
"""

from __future__ import annotations

from torch import Tensor

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")


def aggregate(per_token: Tensor, mask: Tensor, mode: str, *, num_tokens: float | None = None,
              num_sequences: float | None = None, constant: float | None = None) -> Tensor:
    """Reduce per_token [N, T] over mask [N, T] to a scalar.

    - token_mean: sum(x) / num_tokens (default: tokens in mask). Every token weighs the same, so
      long answers weigh more (DAPO, arXiv:2503.14476).
    - sequence_mean: sum_i [sum_t x_it / len_i] / num_sequences (default: rows with >= 1 token).
      Every sequence weighs the same (the original GRPO); empty rows contribute 0.
    - constant: sum(x) / (num_sequences * constant) (Dr. GRPO, arXiv:2503.20783, constant =
      max completion length): no length bias; num_sequences defaults as in sequence_mean.
    An empty mask gives a zero loss (still connected to the graph), never NaN.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid modes: {', '.join(AGGREGATIONS)}")
    mask = mask.bool()
    x = per_token.where(mask, 0.0)  # [N, T] NaN in padding must not leak through x * 0
    lengths = mask.sum(-1)  # [N]
    if num_sequences is None:
        num_sequences = float((lengths > 0).sum())
    if mode == "token_mean":
        denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
        return x.sum() / max(denom, 1.0)
    if mode == "sequence_mean":
        per_seq = x.sum(-1) / lengths.clamp(min=1).to(x.dtype)  # [N]
        return per_seq.sum() / max(float(num_sequences), 1.0)
    if constant is None or constant <= 0:
        raise ValueError(f"loss aggregation 'constant' needs constant > 0 (got {constant}); "
                         "Dr. GRPO uses the maximum completion length")
    return x.sum() / (max(float(num_sequences), 1.0) * float(constant))
