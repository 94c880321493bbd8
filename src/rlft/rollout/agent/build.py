"""The one builder of the turn driver: `agent` config -> tools, parser, environment, limits, and
the prompts checked with the tools' descriptions."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rlft.config import AgentConfig
from rlft.errors import ConfigError, DataError
from rlft.rollout.agent.environments import load_environment
from rlft.rollout.agent.tool_calls import pick_parser
from rlft.rollout.agent.tools import load_tools
from rlft.rollout.agent.turns import AgentLimits, TurnDriver
from rlft.rollout.contract import Engine


def turn_driver(cfg: AgentConfig, engine: Engine, tokenizer: Any, seed: int = 0,
                max_prompt_tokens: int | None = None, should_stop: Callable[[], bool] | None = None) -> Any:
    """The multi-turn driver `agent` configures: its tools loaded and checked, its parser chosen, its
    environment loaded and checked (its episodes seeded from the run's `seed`). `should_stop`: a
    stop request that ends the wait for an environment call (see TurnDriver)."""
    limits = AgentLimits(max_turns=cfg.max_turns, max_total_tokens=cfg.max_total_tokens,
                         max_tool_output_tokens=cfg.max_tool_output_tokens, tool_timeout_s=cfg.tool_timeout_s,
                         max_calls_per_turn=cfg.max_calls_per_turn, on_tool_error=cfg.on_tool_error,
                         env_step_timeout_s=cfg.env_step_timeout_s)
    environment = None if cfg.environment is None else \
        load_environment(cfg.environment, cfg.environment_args, seed, max_prompt_tokens)
    return TurnDriver(engine, tokenizer, load_tools(cfg.tools), pick_parser(cfg.parser, tokenizer.chat_template),
                      limits, cfg.check_drift, environment, cfg.tools_prompt, cfg.schedule, should_stop)


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
                 max_prompt_length: int, seed: int, should_stop: Callable[[], bool] | None = None) -> Any:
    """The turn driver the agent section `cfg` configures (None without one; an environment's
    episodes seeded from `seed`), each set of prompts checked with the tools' descriptions."""
    if cfg is None:
        return None
    if cfg.program is not None:
        from rlft.rollout.agent.program import program_driver  # lazy: needs the openai extra (FastAPI, uvicorn)

        return program_driver(cfg, engine, tokenizer, pick_parser(cfg.parser, tokenizer.chat_template))
    if cfg.environment is not None and cfg.environment.startswith("verifiers:"):
        from rlft.rollout.agent.verifiers_env import verifiers_driver  # lazy: verifiers and the openai extra

        return verifiers_driver(cfg, engine, tokenizer, pick_parser(cfg.parser, tokenizer.chat_template))
    driver = turn_driver(cfg, engine, tokenizer, seed, max_prompt_length, should_stop)
    for examples in example_sets:
        check_prompts_with_tools(driver, examples, max_prompt_length, cfg.max_total_tokens)
    return driver


