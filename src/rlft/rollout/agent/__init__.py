"""Multi-turn episodes above the engines: the turn driver calls the engine once per assistant turn,
runs tools and environment steps, and returns one `Completion` per episode with a loss mask.

- `build.py`: `turn_driver` / `agent_driver`, the one builder, from the `agent` config
- `turns.py`: the turn driver (token-in, token-out) and episode metrics
- `tools.py`, `tool_calls.py`: tools as Python functions; parsing and writing tool calls
- `environments.py`: the `Environment` protocol; `gem_env.py`: gem-llm environments through it
- `program.py`, `endpoint.py`: agent programs on the policy's OpenAI-compatible endpoint;
  `verifiers_env.py`: verifiers environments as such programs
"""

from rlft.rollout.agent.build import agent_driver, check_prompts_with_tools, turn_driver
from rlft.rollout.agent.verifiers_env import reward_specs

__all__ = ["agent_driver", "check_prompts_with_tools", "reward_specs", "turn_driver"]
