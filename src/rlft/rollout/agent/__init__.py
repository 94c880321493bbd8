"""Multi-turn episodes above the engines: the turn driver calls the engine once per assistant turn,
runs tools and environment steps, and returns one `Completion` per episode with a loss mask.

- `build.py`: `turn_driver` / `agent_driver`, the one builder, from the `agent` config
- `turns.py`: the turn driver (token-in, token-out) and episode metrics
- `tools.py`, `tool_calls.py`: tools as Python functions; parsing and writing tool calls
- `environments.py`: the `Environment` protocol; `gem_env.py`: gem-llm environments through it
"""

from rlft.rollout.agent.build import agent_driver, check_prompts_with_tools, turn_driver

__all__ = ["agent_driver", "check_prompts_with_tools", "turn_driver"]
