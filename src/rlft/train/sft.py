"""SFT: masked next-token loss on assistant tokens; eval loss, format compliance and (when rewards
are configured) accuracy on the held-out split."""

from __future__ import annotations

import math
from typing import Any

import torch

from rlft.data.loading import read_rows
from rlft.data.prompts import PromptExample
from rlft.data.sft import SftExample, collate_sft, make_sft_encoder
from rlft.data.validate import check_rows
from rlft.eval.generation import evaluate_prompts
from rlft.models.template import encode_prompt, end_of_turn_ids
from rlft.rewards.base import RewardScorer
from rlft.rollout.hf import HFEngine, generation_stop_ids
from rlft.train.logprobs import sft_token_nll
from rlft.train.session import TrainingSession


class SftObjective:
    title = "sft"
    progress_keys = ["loss", "lr", "grad_norm", "eval/loss", "eval/format_compliance", "eval/accuracy"]

    def __init__(self) -> None:
        self.pad_id = 0
        self.scorer: RewardScorer | None = None

    def prepare(self, session: TrainingSession) -> tuple[list[SftExample], list[SftExample]]:
        cfg, tok = session.config, session.policy.tokenizer
        self.pad_id = tok.pad_token_id
        self.end_ids = end_of_turn_ids(tok)
        encode = make_sft_encoder(tok, self.end_ids, cfg.data.max_length, cfg.data.max_prompt_length)
        train = check_rows(read_rows(cfg.data.train, cfg.data.split), encode, cfg.data.train, "SFT", cfg.data.on_invalid)
        if cfg.rewards:
            self.scorer = RewardScorer(cfg.rewards)
        evals: list[SftExample] = []
        if cfg.data.eval:  # eval rows are scored by the rewards: they need the fields those read
            needs = self.scorer.required_fields if self.scorer else ()
            encode_eval = make_sft_encoder(tok, self.end_ids, cfg.data.max_length, cfg.data.max_prompt_length, needs)
            evals = check_rows(read_rows(cfg.data.eval, cfg.data.eval_split or cfg.data.split), encode_eval,
                               cfg.data.eval, "SFT eval", cfg.data.on_invalid)
        return train, evals

    def normaliser(self, examples: list[SftExample]) -> float:
        # Targets are predicted from the previous position, so position 0 is never one.
        return float(sum(sum(e.target_mask[1:]) for e in examples))

    def loss(self, model: Any, examples: list[SftExample], normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
        batch = collate_sft(examples, self.pad_id)
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        nll = sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"])
        return nll / normaliser, {"tokens": float(batch["attention_mask"].sum())}

    @torch.no_grad()
    def evaluate(self, session: TrainingSession, examples: list[SftExample]) -> dict[str, float]:
        model = session.policy.model
        model.eval()
        total, count = 0.0, 0.0
        for i in range(0, len(examples), 32):
            chunk = examples[i:i + 32]
            batch = {k: v.to(session.policy.device) for k, v in collate_sft(chunk, self.pad_id).items()}
            total += float(sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"]))
            count += self.normaliser(chunk)
        metrics = {"eval/loss": total / count, "eval/perplexity": math.exp(min(total / count, 50.0))}
        tok = session.policy.tokenizer
        engine = HFEngine(model, tok, generation_stop_ids(model, tok), session.policy.device,
                          seed=session.config.seed, batch_size=session.config.eval.batch_size)
        prompts = [PromptExample(e.where, e.prompt_messages, encode_prompt(session.policy.tokenizer, e.prompt_messages),
                                 e.fields) for e in examples]
        result = evaluate_prompts(engine, prompts, session.config.eval, self.scorer, seed=session.config.seed)
        metrics.update(result.metrics)
        return metrics
