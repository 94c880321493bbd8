"""SFT: masked next-token loss on assistant tokens; eval loss, format compliance and (when rewards
are configured) accuracy on the held-out split."""

from __future__ import annotations

import math
from typing import Any

import torch

from rlft.config import AgentConfig, DataConfig, EvalConfig, RewardSpec, ScoringConfig
from rlft.data.mixing import TrainRows, read_train_rows
from rlft.data.prompts import PromptExample, prompt_example
from rlft.data.readers import read_rows
from rlft.data.sft_examples import SftExample, collate_sft, make_sft_encoder
from rlft.data.tool_transcripts import tool_transcripts
from rlft.data.validate import check_rows
from rlft.eval.generation import evaluate_prompts
from rlft.models.forward import sft_token_nll
from rlft.models.loading import LoadedModel
from rlft.models.template import end_of_turn_ids
from rlft.rewards.scoring import build_scorer
from rlft.rollout import build_engine


class SftObjective:
    title = "sft"
    progress_keys = ["loss", "lr", "grad_norm", "eval/loss", "eval/format_compliance", "eval/accuracy"]

    def __init__(self, data: DataConfig, evaluation: EvalConfig, rewards: list[RewardSpec], seed: int = 0,
                 scoring: ScoringConfig | None = None, packing: bool = False, agent: AgentConfig | None = None):
        """`packing`: padding-free forwards for the loss (same numbers). `agent`: rows are tool-use
        transcripts, encoded with its tools and call syntax as rollouts will see them."""
        self.data, self.evaluation, self.seed, self.packing, self.agent = data, evaluation, seed, packing, agent
        # eval accuracy needs rewards; built here so a bad reward spec fails before training
        self.scorer = build_scorer(rewards, scoring) if rewards else None
        self.pad_id = 0

    def prepare(self, policy: LoadedModel) -> tuple[TrainRows, list[SftExample], dict[str, Any]]:
        d, tok = self.data, policy.tokenizer
        self.pad_id = tok.pad_token_id
        end_ids = end_of_turn_ids(tok)
        transcripts = tool_transcripts(self.agent, tok) if self.agent else None
        encode = make_sft_encoder(tok, end_ids, d.max_length, d.max_prompt_length, transcripts=transcripts)
        train = read_train_rows(d, self.seed, lambda path: check_rows(read_rows(path, d.split, d.max_row_bytes), encode,
                                                                      path, "SFT", d.on_invalid))
        evals: list[SftExample] = []
        if d.eval:  # eval rows are scored by the rewards: they need the fields those read
            needs = self.scorer.required_fields if self.scorer else ()
            encode_eval = make_sft_encoder(tok, end_ids, d.max_length, d.max_prompt_length, needs, transcripts)
            evals = check_rows(read_rows(d.eval, d.eval_split or d.split, d.max_row_bytes), encode_eval, d.eval, "SFT eval",
                               d.on_invalid)
        return train, evals, {}

    def normaliser(self, examples: list[SftExample]) -> float:
        # Targets are predicted from the previous position, so position 0 is never one.
        return float(sum(sum(e.target_mask[1:]) for e in examples))

    def loss(self, model: Any, examples: list[SftExample], normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
        batch = collate_sft(examples, self.pad_id)
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        nll = sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"], self.packing)
        return nll / normaliser, {"tokens": float(batch["attention_mask"].sum())}

    @torch.no_grad()
    def evaluate(self, policy: LoadedModel, examples: list[SftExample]) -> dict[str, float]:
        model = policy.model
        model.eval()
        total, count = 0.0, 0.0
        for i in range(0, len(examples), 32):
            chunk = examples[i:i + 32]
            batch = {k: v.to(policy.device) for k, v in collate_sft(chunk, self.pad_id).items()}
            total += float(sft_token_nll(model, batch["input_ids"], batch["attention_mask"], batch["target_mask"],
                                         self.packing))
            count += self.normaliser(chunk)
        metrics = {"eval/loss": total / count, "eval/perplexity": math.exp(min(total / count, 50.0))}
        engine = build_engine(policy.unsharded(), self.seed, batch_size=self.evaluation.batch_size)
        prompts = [prompt_example(policy.tokenizer, e.where, e.prompt_messages, e.fields) if e.prompt_ids is None
                   else PromptExample(e.where, e.prompt_messages, e.prompt_ids, e.fields,
                                      policy.tokenizer.decode(e.prompt_ids))
                   for e in examples]
        result = evaluate_prompts(engine, prompts, self.evaluation, self.scorer, seed=self.seed)
        metrics.update(result.metrics)
        return metrics
