"""Rollouts with the training model itself: batched sampling with a KV cache.

The loop is ours rather than `model.generate` so that it records the sampling log-prob of every
token, stops on the chat template's end-of-turn token (a random model emits other special tokens
mid-completion), drops finished rows from the batch, and draws each completion's tokens from its
own seeded stream (rollout/seeds.py): the samples do not depend on the batch a completion shares
or on the rank that generates it, and a resumed run continues the same streams.

The n samples of a prompt share one prefill: each distinct prompt of a batch runs through the
model once and its KV cache (and last logits) are copied to its n rows, where a prefill per row
computed the same prompt n times. Same maths; the prefill's batch is smaller, which can change
float rounding in the last bit (see tests/test_rollout.py for what holds).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from rlft.models.forward import position_ids_for
from rlft.models.precision import autocast_to
from rlft.models.template import end_of_turn_ids
from rlft.rollout.continuous import ContinuousBatch
from rlft.rollout.contract import Completion, SamplingParams
from rlft.rollout.fast_decode import LeanDecoder, left_padded
from rlft.rollout.seeds import SamplingStreams, call_number, request_seeds


def generation_stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """Stop on the chat template's end-of-turn token and EOS, and on every EOS id the checkpoint's
    generation_config declares (as `model.generate` would), so rlft samples stop where other tools'
    do on the same checkpoint."""
    ids = list(end_of_turn_ids(tokenizer))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    declared = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
    for tok in [declared] if isinstance(declared, int) else list(declared or []):
        if tok not in ids:
            ids.append(tok)
    return ids


class HFEngine(SamplingStreams):
    STATE_NAME = "hf"

    def __init__(self, model: Any, tokenizer: Any, stop_ids: Sequence[int], device: torch.device,
                 seed: int = 0, batch_size: int | None = None, fast_decode: bool = True,
                 compute_dtype: torch.dtype | None = None, share_prefill: bool = True):
        self.model = model
        self.compute_dtype = compute_dtype  # autocast to it (bf16 rollouts from fp32 master weights)
        self.tokenizer = tokenizer
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=device)
        self.device = device
        self.batch_size = batch_size
        self._seed, self._stream, self._calls = seed, "train", 0
        self.pad_id = tokenizer.pad_token_id
        self.fast_decode = fast_decode
        self.share_prefill = share_prefill  # one prefill per distinct prompt (False: one per row, as before)
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    def sync_weights(self) -> None:
        """Same module as the trainer: nothing to copy."""

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, first_prompt: int = 0,
                 streams: Sequence[str] | None = None) -> list[Completion]:
        """`first_prompt` and `streams` name the sampling streams (see `Engine.generate`): completion
        k of a prompt draws from the same stream wherever it is generated."""
        call, self._calls = call_number(self._calls, streams)
        if not prompts:
            return []
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        seeds = request_seeds(self._seed, self._stream, call, len(prompts), params.n, first_prompt, streams)
        step = self.batch_size or len(rows)
        out: list[Completion] = []
        with self.sampling():
            for start in range(0, len(rows), step):
                out += self._generate_batch(rows[start:start + step], seeds[start:start + step], params)
        return out

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """The model in eval mode, without gradients, autocast to the rollout dtype; as it was after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), autocast_to(self.device, self.compute_dtype):
                yield
        finally:
            self.model.train(was_training)

    def continuous(self, params: SamplingParams) -> Any:
        """A continuous batch (rollout/continuous.py) for one request's turns, claiming its call as
        `generate` would for the first turn; None where the lean decoder cannot run this model."""
        decoder = LeanDecoder.build(self.model, 1, self.compute_dtype) if self.fast_decode else None
        if decoder is None:
            return None
        call, self._calls = call_number(self._calls, None)
        return ContinuousBatch(self, params, call, decoder)

    def _uniforms(self, seeds: list[int], steps: int) -> torch.Tensor:
        """[rows, steps] uniforms, row r from its own stream: one draw per token position."""
        out = torch.empty((len(seeds), steps))
        for r, seed in enumerate(seeds):
            out[r] = torch.rand(steps, generator=torch.Generator().manual_seed(seed))
        return out.to(self.device)

    def _generate_batch(self, rows: list[tuple[int, list[int]]], seeds: list[int],
                        params: SamplingParams) -> list[Completion]:
        n = len(rows)
        input_ids, attention = left_padded([p for _, p in rows], self.pad_id, self.device)
        width = input_ids.shape[1]

        tokens = torch.full((n, params.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((n, params.max_new_tokens), device=self.device)
        lengths = torch.zeros(n, dtype=torch.long, device=self.device)
        stopped = torch.zeros(n, dtype=torch.bool, device=self.device)
        active = torch.arange(n, device=self.device)  # rows still generating, as indices into all rows
        positions = position_ids_for(attention)
        logits, cache = self._prefill(rows, input_ids, attention, positions)
        decoder = self._decoder(cache, width + params.max_new_tokens)
        del cache  # the decoder holds (or copied) the prefill's cache
        next_pos = positions[:, -1:] + 1
        texts_needed = bool(params.stop)
        uniforms = self._uniforms(seeds, params.max_new_tokens) if params.temperature > 0 else None  # [n, T]

        for t in range(params.max_new_tokens):
            token, logprob = self._sample(logits, params, None if uniforms is None else uniforms[active, t])
            tokens[active, t], logprobs[active, t] = token, logprob
            lengths[active] += 1
            done = (token[:, None] == self.stop_ids).any(-1)
            if texts_needed:
                done |= self._hit_stop_string(tokens[active, max(0, t - 15): t + 1], params.stop)
            stopped[active] |= done
            if t + 1 == params.max_new_tokens:
                break
            if done.any():  # drop finished rows from the batch and the KV cache
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                active, token, attention, next_pos = active[keep], token[keep], attention[keep], next_pos[keep]
                decoder.select(keep)
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
            logits = decoder.step(token, next_pos, attention)
            next_pos = next_pos + 1
        return self._completions(rows, tokens, logprobs, lengths, stopped, params)

    def _prefill(self, rows: list[tuple[int, list[int]]], input_ids: torch.Tensor, attention: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The last logits `[n, V]` and the KV cache of every row, each distinct prompt computed once."""
        first: dict[int, int] = {}  # prompt index -> its first row
        source = torch.tensor([first.setdefault(i, r) for r, (i, _) in enumerate(rows)], device=self.device)  # [n]
        unique = torch.tensor(sorted(first.values()), device=self.device)  # [U]
        share = self.share_prefill and unique.numel() < len(rows)
        pick = unique if share else slice(None)
        out = self.model(input_ids=input_ids[pick], attention_mask=attention[pick], position_ids=positions[pick],
                         use_cache=True, logits_to_keep=1)
        logits, cache = out.logits[:, -1], self._cache_of(out)
        if not share:
            return logits, cache
        to_unique = torch.searchsorted(unique, source)  # [n]: row -> its prompt's place in the prefill
        if not hasattr(cache, "batch_select_indices"):  # a cache we cannot copy rows of: prefill per row
            self.share_prefill = False  # (and from now on, without the shared prefill first)
            out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            return out.logits[:, -1], self._cache_of(out)
        cache.batch_select_indices(to_unique)
        return logits[to_unique], cache

    def _decoder(self, cache: Any, capacity: int) -> Any:
        lean = LeanDecoder.build(self.model, capacity, self.compute_dtype) if self.fast_decode else None
        if lean is None:
            return _ModelDecoder(self.model, cache, self._cache_kw)
        lean.load_cache(cache)
        return _LeanAdapter(lean)

    @staticmethod
    def _cache_of(out: Any) -> Any:
        return out["cache"] if "cache" in out else out["past_key_values"]

    def _sample(self, logits: torch.Tensor, params: SamplingParams,
                u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if params.temperature == 0:
            token = logits.argmax(-1)
            return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
        logits = logits / params.temperature
        logp = torch.log_softmax(logits, -1)  # the distribution the trainer's log-probs refer to
        if not params.top_k and params.top_p >= 1.0:
            token = self._draw(logp.exp(), u)
            return token, logp.gather(-1, token[:, None]).squeeze(-1)
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
        token = self._draw(torch.softmax(filtered, -1), u)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)

    @staticmethod
    def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row by inverse CDF: each row's uniform draw `u` [B] against its cumulative
        probabilities (cheaper than `torch.multinomial` for one sample; the same distribution)."""
        cdf = probs.cumsum(-1)  # [B, V]
        return (cdf <= u[:, None] * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)

    def _hit_stop_string(self, tails: Any, stops: tuple[str, ...]) -> torch.Tensor:
        """Per row, whether its last tokens (`tails`: each row's last 16 or fewer ids) hold a stop string."""
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return torch.tensor([any(s in text for s in stops) for text in texts], device=self.device)

    def _completions(self, rows, tokens, logprobs, lengths, stopped, params) -> list[Completion]:
        tokens, logprobs, lengths, stopped = tokens.cpu(), logprobs.cpu(), lengths.cpu(), stopped.cpu()
        return [self._completion(prompt_index, prompt, tokens[r, :int(lengths[r])].tolist(),
                                 logprobs[r, :int(lengths[r])].tolist(), bool(stopped[r]), params.stop)
                for r, (prompt_index, prompt) in enumerate(rows)]

    def _completion(self, prompt_index: int, prompt: list[int], ids: list[int], logprobs: list[float], stopped: bool,
                    stop: tuple[str, ...]) -> Completion:
        """One sampled turn; its text ends before the first stop string (its ids keep every token)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in stop:
            if s in text:
                text = text[: text.index(s)]
        return Completion(prompt_ids=prompt, completion_ids=ids, text=text, logprobs=logprobs,
                          finish_reason="stop" if stopped else "length", prompt_index=prompt_index)

    def close(self) -> None:
        """Nothing to free: the engine samples with the trainer's own model."""


class _ModelDecoder:
    """One token through the model's own forward and KV cache."""

    def __init__(self, model: Any, cache: Any, cache_kw: str):
        self.model, self.cache, self.cache_kw = model, cache, cache_kw

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)

    def step(self, token: torch.Tensor, positions: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=token[:, None], attention_mask=attention, position_ids=positions,
                         use_cache=True, **{self.cache_kw: self.cache})
        self.cache = HFEngine._cache_of(out)
        return out.logits[:, -1]


class _LeanAdapter:
    def __init__(self, lean: LeanDecoder):
        self.lean = lean

    def select(self, rows: torch.Tensor) -> None:
        self.lean.select(rows)

    def step(self, token: torch.Tensor, positions: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return self.lean.step(token, positions, attention.bool())
