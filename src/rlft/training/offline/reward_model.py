"""Reward-model training: a one-logit sequence classifier on preference pairs.

- Model: `AutoModelForSequenceClassification(num_labels=1)` from a causal-LM checkpoint; the new
  score head reads the last non-pad token. Under LoRA the head is trained in full (peft
  `modules_to_save`) and the export merges it, so `final/` is a plain transformers folder that
  the `reward_model` reward loads.
- Inputs: prompt + answer rendered with the chat template exactly as that reward renders
  [user: prompt, assistant: completion], so training and scoring see the same tokens.
- Loss: Bradley-Terry -log sigmoid(r_c - r_r - margin) with the row's `margin` (else
  `reward_model.margin`), plus optional reward centering `center_coef * (r_c + r_r)^2`
  (arXiv:2312.09244), which pins the otherwise free offset of the scores near zero.
- Normalisation: summed over pairs, divided by the pairs of the whole optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from rlft.algorithms.preference_losses import bradley_terry
from rlft.config import DataConfig, RewardModelConfig
from rlft.data.mixing import TrainRows
from rlft.data.pairs import PreferenceExample, collate_pairs, load_preference_splits
from rlft.models.forward import packed_sequence_scores
from rlft.models.loading import LoadedModel, load_reward_model


def pair_scores(model: Any, batch: dict[str, torch.Tensor], packing: bool = False) -> torch.Tensor:
    """Scalar score of every row of a right-padded batch  # [N]; `packing`: padding-free forward."""
    packed = packed_sequence_scores(model, batch["input_ids"], batch["attention_mask"]) if packing else None
    if packed is not None:
        scores = packed[:, 0]
    else:
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    return scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores


class RewardModelObjective:
    title = "reward_model"
    progress_keys = ["loss", "lr", "grad_norm", "rm/accuracy", "eval/accuracy", "eval/margin"]
    load_model = staticmethod(load_reward_model)

    def __init__(self, data: DataConfig, settings: RewardModelConfig, chunk: int, seed: int = 0,
                 packing: bool = False):
        """`chunk`: pairs per forward when evaluating; `packing`: padding-free forwards."""
        self.seed = seed
        self.data, self.chunk, self.packing = data, chunk, packing
        self.default_margin, self.center_coef = settings.margin, settings.center_coef
        self.pad_id = 0

    def prepare(self, policy: LoadedModel) -> tuple[TrainRows, list[PreferenceExample], dict]:
        self.pad_id = policy.tokenizer.pad_token_id
        return load_preference_splits(policy.tokenizer, self.data, self.seed)

    def normaliser(self, examples: list[PreferenceExample]) -> float:
        return float(len(examples))

    def _scores(self, model: Any, examples: list[PreferenceExample]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(chosen scores [B], rejected scores [B], tokens in the batch)"""
        batch = {k: v.to(next(model.parameters()).device) for k, v in collate_pairs(examples, self.pad_id).items()}
        scores = pair_scores(model, batch, self.packing)  # [2B]
        n = len(examples)
        return scores[:n], scores[n:], float(batch["attention_mask"].sum())

    def _pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor,
                     examples: list[PreferenceExample]) -> tuple[torch.Tensor, dict[str, float]]:
        margins = [self.default_margin if e.margin is None else e.margin for e in examples]
        margin = torch.tensor(margins, dtype=chosen.dtype, device=chosen.device) if any(margins) else None
        per_pair, metrics = bradley_terry(chosen, rejected, margin=margin)
        if self.center_coef:
            per_pair = per_pair + self.center_coef * (chosen + rejected) ** 2
        metrics["scores/chosen"] = float(chosen.detach().mean())
        metrics["scores/rejected"] = float(rejected.detach().mean())
        return per_pair, metrics

    def loss(self, model: Any, examples: list[PreferenceExample],
             normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected, tokens = self._scores(model, examples)
        per_pair, metrics = self._pair_losses(chosen, rejected, examples)
        share = len(examples) / normaliser  # means over this micro-batch -> additive over the step
        return per_pair.sum() / normaliser, {**{k: v * share for k, v in metrics.items()}, "tokens": tokens}

    @torch.no_grad()
    def evaluate(self, policy: LoadedModel, examples: list[PreferenceExample]) -> dict[str, float]:
        """Held-out pairwise accuracy (share of pairs scored chosen > rejected), mean margin, loss,
        and `eval/prefers_longer`: among pairs of unequal answer length, the share where the RM
        scores the longer answer higher -- compare with the data's own `chosen_longer` to see a
        length bias the RM picked up."""
        model = policy.model
        model.eval()
        chosen, rejected = [], []
        for i in range(0, len(examples), self.chunk):
            c, r, _ = self._scores(model, examples[i:i + self.chunk])
            chosen.append(c)
            rejected.append(r)
        sc, sr = torch.cat(chosen), torch.cat(rejected)  # [N]
        per_pair, _ = self._pair_losses(sc, sr, examples)
        diff = sc - sr
        out = {"eval/loss": float(per_pair.mean()), "eval/accuracy": float((diff > 0).double().mean()),
               "eval/margin": float(diff.mean()), "eval/score_mean": float(torch.cat([sc, sr]).mean()),
               "eval/score_std": float(torch.cat([sc, sr]).std())}
        gap = torch.tensor([e.chosen.answer_tokens - e.rejected.answer_tokens for e in examples], device=diff.device)
        unequal = gap != 0
        if bool(unequal.any()):
            out["eval/prefers_longer"] = float(((diff * gap.sign()) > 0)[unequal].double().mean())
        return out
