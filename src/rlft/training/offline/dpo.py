"""DPO (arXiv:2305.18290) and its IPO / hinge variants as an offline objective.

- Sequence log-probs: the log-probs of each answer's target tokens (assistant text and its
  end-of-turn token), chosen and rejected from one forward over the batch [chosen; rejected];
  summed for DPO and the hinge, averaged per token for IPO (`LOGP_REDUCTION`: IPO's target
  margin 1/(2 beta) is on a per-token scale, arXiv:2310.12036).
- Reference: `Reference(policy)` -- the policy with adapters disabled under LoRA, else a frozen
  copy taken before training (and before a resume loads trained weights, so it is always the
  starting model). With `dpo.precompute_ref` every pair is scored once up front instead.
- Dropout is off in the policy: with it, the policy and the (dropout-free) reference would
  disagree on identical weights, and the implicit reward would be noise at step 0.
- Normalisation: per-pair losses are summed and divided by the number of pairs in the whole
  optimizer step, so gradient accumulation gives the gradient of one big batch.
- `dpo.nll_coef` adds the chosen answer's NLL (mean per token, then per pair), the auxiliary term
  of RPO (arXiv:2404.19733) that keeps DPO from lowering the chosen answers' likelihood.
"""

from __future__ import annotations

from typing import Any

import torch

from rlft.algorithms.preference_losses import LOGP_REDUCTION, PREFERENCE_LOSSES
from rlft.config import DataConfig, DpoConfig
from rlft.data.mixing import TrainRows
from rlft.data.pairs import PreferenceExample, collate_pairs, load_preference_splits
from rlft.models.forward import token_outputs
from rlft.models.loading import LoadedModel, Reference, disable_dropout


def sequence_logprobs(model: Any, batch: dict[str, torch.Tensor],
                      packing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's target tokens, their count)  # [N], [N]

    Only the positions that predict target tokens reach the LM head (`token_outputs`); `packing`
    runs the decoder padding-free."""
    target_mask = batch["target_mask"]  # [N, T]
    token_logps = token_outputs(model, batch["input_ids"], batch["attention_mask"], target_mask,
                                packing=packing).logprobs  # [N, T], 0 off the targets
    return token_logps.sum(-1), target_mask[:, 1:].sum(-1).to(token_logps.dtype)


class DpoObjective:
    title = "dpo"
    progress_keys = ["loss", "lr", "grad_norm", "rewards/accuracy", "rewards/margin",
                     "eval/rewards/accuracy", "eval/rewards/margin"]

    def __init__(self, data: DataConfig, dpo: DpoConfig, chunk: int, seed: int = 0, packing: bool = False):
        """`chunk`: pairs per forward outside training (reference scoring, evaluation); `packing`:
        padding-free forwards."""
        self.seed = seed
        self.data, self.dpo, self.chunk, self.packing = data, dpo, chunk, packing
        self.loss_fn = PREFERENCE_LOSSES[dpo.loss]
        self.mean_logps = LOGP_REDUCTION[dpo.loss] == "mean"
        self.pad_id = 0
        self.reference: Reference | None = None

    def prepare(self, policy: LoadedModel) -> tuple[TrainRows, list[PreferenceExample], dict]:
        self.pad_id = policy.tokenizer.pad_token_id
        disable_dropout(policy.model)
        train, evals, data_summary = load_preference_splits(policy.tokenizer, self.data, self.seed)
        self.reference = Reference(policy)
        if self.dpo.precompute_ref:
            for examples in (train.examples, evals):
                self._precompute(examples, policy.device)
            self.reference = None  # a full fine-tune's frozen copy is no longer needed
        return train, evals, data_summary

    def normaliser(self, examples: list[PreferenceExample]) -> float:
        return float(len(examples))

    def _batch(self, examples: list[PreferenceExample], device: torch.device) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in collate_pairs(examples, self.pad_id).items()}

    def _answer_logps(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(answer log-prob as the loss wants it: summed or per-token mean, answer tokens)  # [2B], [2B]"""
        logps, counts = sequence_logprobs(model, batch, self.packing)
        return (logps / counts if self.mean_logps else logps), counts

    @torch.no_grad()
    def _precompute(self, examples: list[PreferenceExample], device: torch.device) -> None:
        for i in range(0, len(examples), self.chunk):
            chunk = examples[i:i + self.chunk]
            with self.reference.model() as ref:
                logps, _ = self._answer_logps(ref, self._batch(chunk, device))
            for e, c, r in zip(chunk, logps[:len(chunk)].tolist(), logps[len(chunk):].tolist()):
                e.ref_chosen_logp, e.ref_rejected_logp = c, r

    @torch.no_grad()
    def _reference_logps(self, examples: list[PreferenceExample], batch: dict[str, torch.Tensor],
                         like: torch.Tensor) -> torch.Tensor:
        """[2B] reference log-probs in the batch's [chosen; rejected] order."""
        if all(e.ref_chosen_logp is not None for e in examples):
            values = [e.ref_chosen_logp for e in examples] + [e.ref_rejected_logp for e in examples]
            return torch.tensor(values, dtype=like.dtype, device=like.device)
        with self.reference.model() as ref:
            return self._answer_logps(ref, batch)[0]

    def _pair_losses(self, model: Any, examples: list[PreferenceExample],
                     ) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
        """Per-pair loss [B] with the preference metrics (means over these pairs)."""
        batch = self._batch(examples, next(model.parameters()).device)
        n = len(examples)
        logps, counts = self._answer_logps(model, batch)  # [2B]
        ref = self._reference_logps(examples, batch, logps)  # [2B]
        per_pair, metrics = self.loss_fn(logps[:n], logps[n:], ref[:n], ref[n:],
                                         beta=self.dpo.beta, label_smoothing=self.dpo.label_smoothing)
        nll = -(logps[:n] if self.mean_logps else logps[:n] / counts[:n])  # mean NLL per chosen token  # [B]
        if self.dpo.nll_coef:
            per_pair = per_pair + self.dpo.nll_coef * nll
        metrics["nll/chosen"] = float(nll.detach().mean())
        return per_pair, metrics, batch

    def loss(self, model: Any, examples: list[PreferenceExample],
             normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
        per_pair, metrics, batch = self._pair_losses(model, examples)
        share = len(examples) / normaliser  # means over this micro-batch -> additive over the step
        out = {k: v * share for k, v in metrics.items()}
        out["tokens"] = float(batch["attention_mask"].sum())
        return per_pair.sum() / normaliser, out

    @torch.no_grad()
    def evaluate(self, policy: LoadedModel, examples: list[PreferenceExample]) -> dict[str, float]:
        """Held-out loss and preference metrics; `eval/rewards/accuracy` is the share of pairs whose
        implicit reward beta * log(pi / ref) is higher for the chosen answer (0 at step 0, where
        the policy is the reference and every pair ties)."""
        model = policy.model
        model.eval()
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for i in range(0, len(examples), self.chunk):
            chunk = examples[i:i + self.chunk]
            per_pair, metrics, _ = self._pair_losses(model, chunk)
            loss_sum += float(per_pair.sum())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v * len(chunk)
        n = len(examples)
        return {"eval/loss": loss_sum / n, **{f"eval/{k}": v / n for k, v in totals.items()}}
