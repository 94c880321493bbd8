"""Rollout engines: `hf` (the training model itself) and `vllm` (an optional extra)."""

from __future__ import annotations

from typing import Any

from rlft.config import RolloutConfig
from rlft.errors import RlftError
from rlft.rollout.base import Completion, Engine, SamplingParams


def build_engine(cfg: RolloutConfig, policy: Any, stop_ids: list[int], seed: int) -> Engine:
    if cfg.engine == "hf":
        from rlft.rollout.hf import HFEngine

        return HFEngine(policy.model, policy.tokenizer, stop_ids, policy.device, seed=seed, batch_size=cfg.batch_size,
                        fast_decode=cfg.fast_decode)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise RlftError("rollout.engine=vllm needs vLLM: pip install 'rlft[vllm]' (a CUDA GPU is required); "
                        "or use rollout.engine=hf") from None
    raise RlftError("rollout.engine=vllm is not available in this version; use rollout.engine=hf")


def sampling_params(cfg: RolloutConfig) -> SamplingParams:
    return SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, stop=tuple(cfg.stop))


__all__ = ["Completion", "Engine", "SamplingParams", "build_engine", "sampling_params"]
