"""The `reward_model_ensemble` reward: several reward models score every sample, combined into one.

One reward model is a noisy, exploitable proxy; an ensemble's mean lowers the variance of a single
model, and its spread measures where the models stop agreeing: where the policy has wandered off
the data they were trained on, which is where reward hacking happens (Coste et al., "Reward Model
Ensembles Help Mitigate Overoptimization", arXiv:2310.02743; Eisenstein et al., arXiv:2312.09244).

- `combine`: `mean`; `min` (the worst case over members: WCO in Coste et al.); `pessimistic`,
  mean - lam * std (their UWO uses the variance; the std keeps the penalty in reward units, so
  `lam` counts standard deviations). The std is over the K members (ddof 0: the spread of these
  models, not an estimate for a larger population of them).
- Notes per sample (`Scored.info`): `disagreement` (that std) and each member's score
  (`member_0`, ...). Their step means are logged as `reward/<name>/disagreement` and
  `reward/<name>/member_<i>`; the scorer also logs `reward/disagreement` in the total's units,
  which the `reward_disagreement` health detector watches (disagreement rising with the reward).
- Tokenizers: members score text. Each renders the conversation with its own tokenizer and chat
  template, exactly as a lone `reward_model` does, so a member may use a tokenizer other than the
  policy's or the other members' (re-tokenizing text costs little next to a forward pass). The
  one token count that enters the reward, the length penalty (`length_coef`), is applied once
  after combining and counts the *policy's* completion tokens, so it cannot differ by member.
- Members should score on a common scale (one recipe, other seeds or data splits): `mean` and
  `min` of models with different offsets mostly measure the offsets.
"""

from __future__ import annotations

import math
import os
from typing import Any

from rlft.rewards.reward_model import raw_scorer, shape_score
from rlft.rewards.scores import Scored
from rlft.rewards.scoring import arg_field, register_reward

COMBINERS = ("mean", "min", "pessimistic")


def combine_scores(scores: list[float], combine: str, lam: float = 1.0) -> tuple[float, float]:
    """(the members' scores combined, their std with ddof 0).

    >>> combine_scores([1.0, 3.0], "mean")  # std = sqrt(((1-2)^2 + (3-2)^2) / 2) = 1
    (2.0, 1.0)
    >>> combine_scores([1.0, 3.0], "pessimistic", lam=0.5), combine_scores([1.0, 3.0], "min")  # 2 - 0.5 * 1
    ((1.5, 1.0), (1.0, 1.0))
    """
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    combined = {"mean": mean, "min": min(scores), "pessimistic": mean - lam * std}[combine]
    return combined, std


@register_reward("reward_model_ensemble")
def reward_model_ensemble(paths: list[str], combine: str = "mean", lam: float | None = None, batch_size: int = 8,
                          max_length: int = 2048, device: str = "cpu", dtype: str = "fp32", label: int = 0,
                          length_coef: float = 0.0, clip: float | None = None) -> Any:
    """Score with every reward model in `paths` and combine (see the module docstring); the other
    arguments are those of `reward_model`, the same for every member."""
    lam = _check_args(paths, combine, lam)
    members = [raw_scorer(p, batch_size, max_length, device, dtype, label, field=arg_field(f"paths[{j}]"))[0]
               for j, p in enumerate(paths)]

    def batch(prompts: list[Any], completions: list[str], rows: list[dict[str, Any]]) -> list[Scored]:
        per_member = [member(prompts, completions, rows) for member in members]  # [K][N]
        out = []
        for i, row in enumerate(rows):
            scores = [m[i] for m in per_member]
            value, std = combine_scores(scores, combine, lam)
            # the policy's token count (the trainer's), one for all members whatever their tokenizers
            value = shape_score(value, int(row.get("completion_tokens", 0)), length_coef, clip)
            out.append(Scored(value, {"disagreement": std, **{f"member_{k}": s for k, s in enumerate(scores)}}))
        return out

    def reward(prompt: Any, completion: str, **row: Any) -> Scored:
        return batch([prompt], [completion], [row])[0]

    reward.batch = batch
    return reward


def _check_args(paths: Any, combine: Any, lam: Any) -> float:
    """`lam` as used (1.0 for pessimistic when unset); ValueError naming the arg and its fix."""
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths) or len(paths) < 2:
        raise ValueError(f"args.paths={paths!r}; an ensemble needs a list of at least two reward model folders "
                         "(one model has no disagreement: use the reward_model reward)")
    resolved = [os.path.realpath(os.path.expanduser(p)) for p in paths]
    dupes = sorted({p for p, r in zip(paths, resolved) if resolved.count(r) > 1})
    if dupes:
        raise ValueError(f"args.paths lists {dupes} more than once; a repeated member only doubles its weight and "
                         "understates the disagreement. Give each model once")
    if combine not in COMBINERS:
        raise ValueError(f"args.combine={combine!r}; choose one of {', '.join(COMBINERS)}")
    if lam is not None and combine != "pessimistic":
        raise ValueError(f"args.lam={lam!r} only applies to combine: pessimistic (mean - lam * std); drop it, or "
                         "set combine: pessimistic")
    lam = 1.0 if lam is None else lam
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"args.lam={lam!r}; it must be a number >= 0 (how many stds to subtract)")
    return float(lam)
