"""Rollouts with the training model itself: batched sampling with a KV cache.

The loop is ours rather than `model.generate` so that it records the sampling log-prob of every
token, stops on the chat template's end-of-turn token (a random model emits other special tokens
mid-completion), drops finished rows from the batch, and draws from a seeded generator whose state
is checkpointed (exact resume).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from rlft.rollout.base import Completion, SamplingParams
from rlft.train.logprobs import position_ids_for


class HFEngine:
    def __init__(self, model: Any, tokenizer: Any, stop_ids: Sequence[int], device: torch.device,
                 seed: int = 0, batch_size: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=device)
        self.device = device
        self.batch_size = batch_size
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.pad_id = tokenizer.pad_token_id
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    def sync_weights(self) -> None:
        """Same module as the trainer: nothing to copy."""

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[Completion]:
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        step = self.batch_size or len(rows)
        out: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(rows), step):
                    out += self._generate_batch(rows[start:start + step], params)
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, rows: list[tuple[int, list[int]]], params: SamplingParams) -> list[Completion]:
        n, width = len(rows), max(len(p) for _, p in rows)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long, device=self.device)
        attention = torch.zeros((n, width), dtype=torch.long, device=self.device)
        for r, (_, p) in enumerate(rows):  # left padding: every prompt ends at the same column
            input_ids[r, width - len(p):] = torch.tensor(p, device=self.device)
            attention[r, width - len(p):] = 1

        tokens = torch.full((n, params.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((n, params.max_new_tokens), device=self.device)
        lengths = torch.zeros(n, dtype=torch.long, device=self.device)
        stopped = torch.zeros(n, dtype=torch.bool, device=self.device)
        active = torch.arange(n, device=self.device)  # rows still generating, as indices into all rows
        positions = position_ids_for(attention)
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         use_cache=True, logits_to_keep=1)
        cache, logits = self._cache_of(out), out.logits[:, -1]
        next_pos = positions[:, -1:] + 1
        texts_needed = bool(params.stop)

        for t in range(params.max_new_tokens):
            token, logprob = self._sample(logits, params)
            tokens[active, t], logprobs[active, t] = token, logprob
            lengths[active] += 1
            done = torch.isin(token, self.stop_ids)
            if texts_needed:
                done |= self._hit_stop_string(tokens[active, : t + 1], params.stop)
            stopped[active] |= done
            if t + 1 == params.max_new_tokens:
                break
            if done.any():  # drop finished rows from the batch and the KV cache
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                active, token, attention, next_pos = active[keep], token[keep], attention[keep], next_pos[keep]
                cache.batch_select_indices(keep)
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
            out = self.model(input_ids=token[:, None], attention_mask=attention, position_ids=next_pos,
                             use_cache=True, **{self._cache_kw: cache})
            cache, logits = self._cache_of(out), out.logits[:, -1]
            next_pos = next_pos + 1
        return self._completions(rows, tokens, logprobs, lengths, stopped, params)

    @staticmethod
    def _cache_of(out: Any) -> Any:
        return out["cache"] if "cache" in out else out["past_key_values"]

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if params.temperature == 0:
            token = logits.argmax(-1)
            return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
        logits = logits / params.temperature
        logp = torch.log_softmax(logits, -1)  # the distribution the trainer's log-probs refer to
        filtered = logits
        if params.top_k and params.top_k < logits.shape[-1]:
            kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = filtered.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the token crossing top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            filtered = filtered.masked_fill(drop, float("-inf"))
        probs = torch.softmax(filtered, -1)
        token = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)

    def _hit_stop_string(self, generated: torch.Tensor, stops: tuple[str, ...]) -> torch.Tensor:
        tail = self.tokenizer.batch_decode(generated[:, -16:], skip_special_tokens=True)
        return torch.tensor([any(s in text for s in stops) for text in tail], device=self.device)

    def _completions(self, rows, tokens, logprobs, lengths, stopped, params) -> list[Completion]:
        out = []
        tokens, logprobs, lengths, stopped = tokens.cpu(), logprobs.cpu(), lengths.cpu(), stopped.cpu()
        for r, (prompt_index, prompt) in enumerate(rows):
            k = int(lengths[r])
            ids = tokens[r, :k].tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            for s in params.stop:
                if s in text:
                    text = text[: text.index(s)]
            out.append(Completion(prompt_ids=prompt, completion_ids=ids, text=text,
                                  logprobs=logprobs[r, :k].tolist(),
                                  finish_reason="stop" if bool(stopped[r]) else "length",
                                  prompt_index=prompt_index))
        return out

    @contextmanager
    def isolated_rng(self, seed: int) -> Iterator[None]:
        """Sample from a generator seeded with `seed`, then restore the rollout generator: evals
        are reproducible and never change the training trajectory."""
        saved = self.generator.get_state()
        self.generator.manual_seed(seed)
        try:
            yield
        finally:
            self.generator.set_state(saved)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
