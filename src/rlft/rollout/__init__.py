"""Rollout engines: `hf` (the training model itself) and `vllm` (an optional extra).

`build_engine` is the one way to make an engine, for training rollouts and evaluations alike.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlft.config import AgentConfig, RolloutConfig, VllmSettings
from rlft.errors import ConfigError, DataError
from rlft.models.precision import DTYPES
from rlft.rollout.contract import Completion, Engine, SamplingParams


def build_engine(policy: Any, seed: int, engine: str = "hf", batch_size: int | None = None,
                 fast_decode: bool = True, vllm: VllmSettings | None = None,
                 dtype: torch.dtype | None = None) -> Engine:
    """An engine that samples from `policy` (a LoadedModel), stopping where `model.generate`
    would (the chat template's end-of-turn token, EOS and the checkpoint's declared EOS ids).
    `dtype`: what rollouts compute in when it is not the weights' own (see `rollout_dtype`)."""
    from rlft.rollout.hf import HFEngine, generation_stop_ids

    stop_ids = generation_stop_ids(policy.model, policy.tokenizer)
    if engine == "hf":
        return HFEngine(policy.model, policy.tokenizer, stop_ids, policy.device, seed=seed, batch_size=batch_size,
                        fast_decode=fast_decode, compute_dtype=dtype)
    # imports vLLM only now: a missing vLLM is one RlftError with the install hint
    from rlft.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(policy, stop_ids, seed, vllm, dtype)


def rollout_engine(cfg: RolloutConfig, policy: Any, seed: int, dtype: torch.dtype | None = None) -> Engine:
    """The training run's engine, as `rollout` configures it."""
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


def turn_driver(cfg: AgentConfig, engine: Engine, tokenizer: Any, seed: int = 0,
                max_prompt_tokens: int | None = None) -> Any:
    """The multi-turn driver `agent` configures: its tools loaded and checked, its parser chosen, its
    environment loaded and checked (its episodes seeded from the run's `seed`)."""
    from rlft.rollout.environments import load_environment
    from rlft.rollout.tool_calls import pick_parser
    from rlft.rollout.tools import load_tools
    from rlft.rollout.turns import AgentLimits, TurnDriver

    limits = AgentLimits(max_turns=cfg.max_turns, max_total_tokens=cfg.max_total_tokens,
                         max_tool_output_tokens=cfg.max_tool_output_tokens, tool_timeout_s=cfg.tool_timeout_s,
                         max_calls_per_turn=cfg.max_calls_per_turn, on_tool_error=cfg.on_tool_error)
    environment = None if cfg.environment is None else \
        load_environment(cfg.environment, cfg.environment_args, seed, max_prompt_tokens)
    return TurnDriver(engine, tokenizer, load_tools(cfg.tools), pick_parser(cfg.parser, tokenizer.chat_template),
                      limits, cfg.check_drift, environment, cfg.tools_prompt, cfg.schedule)


def tool_transcripts(cfg: AgentConfig, tokenizer: Any) -> Any:
    """SFT's view of `agent`: the tools it presents and the call syntax it writes, as rollouts do."""
    from rlft.data.tool_transcripts import TranscriptEncoder
    from rlft.rollout.tool_calls import pick_parser, pick_writer
    from rlft.rollout.tools import load_tools

    return TranscriptEncoder(tokenizer, load_tools(cfg.tools), pick_parser(cfg.parser, tokenizer.chat_template),
                             pick_writer(cfg.parser, tokenizer.chat_template), cfg.max_tool_output_tokens,
                             cfg.tools_prompt)


def check_prompts_with_tools(driver: Any, prompts: Sequence[Any], limit: int, budget: int) -> None:
    """The tool descriptions lengthen every prompt: check them against data.max_prompt_length as
    the episodes will see them, and prompt plus episode budget against a vLLM engine's length,
    before the first step."""
    longest = 0
    for e in prompts:
        n = len(driver.encoder.prompt_ids(e.messages))
        if n > limit:
            raise DataError(f"{e.where}: with the agent's tool descriptions the prompt is {n} tokens, longer than "
                            f"data.max_prompt_length ({limit}); raise data.max_prompt_length or shorten the "
                            "tools' docstrings")
        longest = max(longest, n)
    room = getattr(driver.engine, "max_model_len", None)  # a vLLM engine holds at most this many tokens
    if room is not None and longest + budget > room:
        raise ConfigError(f"agent: a prompt of {longest} tokens (tool descriptions included) plus the episode's "
                          f"agent.max_total_tokens={budget} exceeds the vLLM engine's max_model_len={room}; raise "
                          "rollout.vllm.max_model_len or lower agent.max_total_tokens")


def agent_driver(cfg: AgentConfig | None, engine: Any, tokenizer: Any, example_sets: Sequence[Sequence[Any]],
                 max_prompt_length: int, seed: int) -> Any:
    """The turn driver the agent section `cfg` configures (None without one; an environment's
    episodes seeded from `seed`), each set of prompts checked with the tools' descriptions."""
    if cfg is None:
        return None
    driver = turn_driver(cfg, engine, tokenizer, seed, max_prompt_length)
    for examples in example_sets:
        check_prompts_with_tools(driver, examples, max_prompt_length, cfg.max_total_tokens)
    return driver


def sampling_params(cfg: RolloutConfig) -> SamplingParams:
    return SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, stop=tuple(cfg.stop))


__all__ = ["Completion", "Engine", "SamplingParams", "agent_driver", "build_engine", "check_prompts_with_tools", "rollout_dtype",
           "rollout_engine", "sampling_params", "tool_transcripts", "turn_driver"]
