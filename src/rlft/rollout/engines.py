"""Building an engine: `hf` (the training model itself) or `vllm` (an optional extra).

`build_engine` is the one way to make an engine, for training rollouts and evaluations alike.
"""

from __future__ import annotations

from typing import Any

import torch

from rlft.config import RolloutConfig, VllmSettings
from rlft.errors import ConfigError
from rlft.models.precision import DTYPES
from rlft.rollout.contract import Engine, SamplingParams
from rlft.rollout.hf import HFEngine, generation_stop_ids


def build_engine(policy: Any, seed: int, engine: str = "hf", batch_size: int | None = None,
                 fast_decode: bool = True, vllm: VllmSettings | None = None,
                 dtype: torch.dtype | None = None) -> Engine:
    """An engine that samples from `policy` (a LoadedModel), stopping where `model.generate`
    would (the chat template's end-of-turn token, EOS and the checkpoint's declared EOS ids).
    `dtype`: what rollouts compute in when it is not the weights' own (see `rollout_dtype`)."""
    stop_ids = generation_stop_ids(policy.model, policy.tokenizer)
    if engine == "hf":
        return HFEngine(policy.model, policy.tokenizer, stop_ids, policy.device, seed=seed, batch_size=batch_size,
                        fast_decode=fast_decode, compute_dtype=dtype)
    from rlft.rollout.vllm_engine import VLLMEngine  # lazy: vLLM is an optional extra, loaded only when chosen

    return VLLMEngine(policy, stop_ids, seed, vllm, dtype)


def rollout_engine(cfg: RolloutConfig, policy: Any, seed: int, dtype: torch.dtype | None = None, push: bool = True,
                   version_prefix: str | None = None, adapter_dir: Any = None) -> Engine:
    """The training run's engine, as `rollout` configures it. With `rollout.servers`: one that
    samples on them (`push`: this rank sends the weights; `version_prefix`: the same on every
    rank; `adapter_dir`: where a LoRA policy's adapters go for the servers to load)."""
    if cfg.servers:
        from rlft.rollout.servers.engine import ServerEngine  # lazy: needs httpx and vLLM's transfer engines

        return ServerEngine(policy, generation_stop_ids(policy.model, policy.tokenizer), seed, cfg.servers, cfg.server,
                            push=push, version_prefix=version_prefix, adapter_dir=adapter_dir)
    return build_engine(policy, seed, cfg.engine, cfg.batch_size, cfg.fast_decode, cfg.vllm, dtype)


def rollout_dtype(name: str, precision: Any, device: torch.device | None = None) -> torch.dtype | None:
    """rollout.dtype resolved against the run's precision (models/precision.py): 'auto' samples in
    training's compute dtype (bf16 under bf16-mixed, the weights' dtype otherwise). None: the
    weights' own dtype, no casting."""
    dtype = precision.compute_dtype if name == "auto" else DTYPES[name]
    if dtype == torch.float16 and device is not None and device.type != "cuda":
        raise ConfigError("rollout.dtype=fp16 needs a CUDA GPU; on CPU use bf16 or fp32")
    if dtype == torch.float32 and precision.weight_dtype != torch.float32:
        raise ConfigError("rollout.dtype=fp32 with bf16 weights (training.precision=bf16): rollouts compute in "
                          "the weights' dtype; drop rollout.dtype or train in bf16-mixed")
    return None if dtype in (None, precision.weight_dtype) else dtype


def sampling_params(cfg: RolloutConfig) -> SamplingParams:
    return SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, stop=tuple(cfg.stop))
