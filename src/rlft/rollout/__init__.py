"""Rollout engines: `hf` (the training model itself) and `vllm` (an optional extra).

`build_engine` is the one way to make an engine, for training rollouts and evaluations alike.
"""

from __future__ import annotations

from typing import Any

from rlft.config import RolloutConfig, VllmSettings
from rlft.rollout.contract import Completion, Engine, SamplingParams


def build_engine(policy: Any, seed: int, engine: str = "hf", batch_size: int | None = None,
                 fast_decode: bool = True, vllm: VllmSettings | None = None) -> Engine:
    """An engine that samples from `policy` (a LoadedModel), stopping where `model.generate`
    would (the chat template's end-of-turn token, EOS and the checkpoint's declared EOS ids)."""
    from rlft.rollout.hf import HFEngine, generation_stop_ids

    stop_ids = generation_stop_ids(policy.model, policy.tokenizer)
    if engine == "hf":
        return HFEngine(policy.model, policy.tokenizer, stop_ids, policy.device, seed=seed, batch_size=batch_size,
                        fast_decode=fast_decode)
    # imports vLLM only now: a missing vLLM is one RlftError with the install hint
    from rlft.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(policy, stop_ids, seed, vllm)


def rollout_engine(cfg: RolloutConfig, policy: Any, seed: int) -> Engine:
    """The training run's engine, as `rollout` configures it."""
    return build_engine(policy, seed, cfg.engine, cfg.batch_size, cfg.fast_decode, cfg.vllm)


def sampling_params(cfg: RolloutConfig) -> SamplingParams:
    return SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, stop=tuple(cfg.stop))


__all__ = ["Completion", "Engine", "SamplingParams", "build_engine", "rollout_engine", "sampling_params"]
