"""A training run under torchrun (or alone) for tests/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_driver.py [replay|replay-calls]
                                                   CONFIG.yaml ... [calls:CONFIG.yaml ...] [real:CONFIG.yaml ...]

Several configs run one after another in the same processes (a process group is set up once: the
tests pay the processes' start-up once). `replay` swaps the rollout engine for one whose completions depend only on (prompt, sample index,
call): the same in one process and on two ranks, so a test can compare the two runs' parameters
on "the same sampled completions and rewards" -- real sampling can flip one token when two
layouts' logits differ in the last float bit, and the runs then part ways. `real:CONFIG` runs with
the engine the config names (the HF engine, or vLLM), and so does every config after it;
`calls:CONFIG` runs with the `replay-calls` engine (below), and so does every config after it.
`replay-calls`: the replay engine writes a calculator call as every other completion (by its
stream), so the runs' agent sections get multi-turn episodes; and, as a real engine's, a sample
cut by a lower max_new_tokens is a prefix of the longer one (the turn driver asks each round for
the most tokens any live episode may still take, which depends on the episodes sharing it).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch

torch.set_num_threads(1)
FAIL_ENV = "DIST_DRIVER_FAIL"  # "RANK@CALL": that rank's replay engine raises at that call (its step CALL + 1)


class ReplayEngine:
    def __init__(self, tokenizer: Any, stop_ids: list[int], tool_calls: bool = False):
        self.tokenizer, self.stop_id, self.calls, self.tool_calls = tokenizer, stop_ids[0], 0, tool_calls

    def generate(self, prompts, params, first_prompt: int = 0, streams=None):
        """Named as the engine contract names streams: a later turn (`streams`) continues the last call."""
        from rlft.rollout.contract import Completion
        from rlft.rollout.seeds import request_seeds

        call = self.calls if streams is None else self.calls - 1
        self.calls += streams is None
        if os.environ.get(FAIL_ENV) == f"{os.environ.get('RANK', '0')}@{call}":  # a bug on one rank's engine
            raise RuntimeError(f"the replay engine failed at call {call}")
        seeds = request_seeds(0, "replay", call, len(prompts), params.n, first_prompt, streams)
        out = []
        for r, seed in enumerate(seeds):
            g = torch.Generator().manual_seed(seed)
            if self.tool_calls and int(torch.randint(0, 2, (1,), generator=g)):
                a, b = torch.randint(0, 100, (2,), generator=g).tolist()
                call = {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}
                text = f"<tool_call>{json.dumps(call)}</tool_call>"
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                n = int(torch.randint(1, 64 if self.tool_calls else params.max_new_tokens, (1,), generator=g))
                ids = torch.randint(5, 300, (n,), generator=g).tolist()
            ids.append(self.stop_id)
            finish = "stop" if len(ids) <= params.max_new_tokens else "length"
            ids = ids[: params.max_new_tokens]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Completion(list(prompts[r // params.n]), ids, text, [0.0] * len(ids), finish, r // params.n))
        return out

    def sync_weights(self) -> None:
        pass

    @contextmanager
    def isolated_rng(self, seed: int) -> Iterator[None]:
        saved = self.calls
        yield
        self.calls = saved

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]

    def close(self) -> None:
        pass


def use_replay_engine(tool_calls: bool = False) -> None:
    import rlft.training.online.loop as online
    from rlft.rollout.hf import generation_stop_ids

    online.rollout_engine = lambda cfg, policy, seed, dtype=None: ReplayEngine(
        policy.tokenizer, generation_stop_ids(policy.model, policy.tokenizer), tool_calls)


def main() -> int:
    from rlft.api import train

    import rlft.training.online.loop as online

    args = sys.argv[1:]
    real = online.rollout_engine
    if args and args[0] in ("replay", "replay-calls"):
        use_replay_engine(tool_calls=args[0] == "replay-calls")
        args = args[1:]
    status = []
    for config in args:
        if config.startswith("real:"):  # a real engine from here on (the config says which)
            online.rollout_engine, config = real, config.removeprefix("real:")
        elif config.startswith("calls:"):  # the replay engine writing tool calls from here on
            use_replay_engine(tool_calls=True)
            config = config.removeprefix("calls:")
        status.append(train(config)["status"])
    return 0 if all(s == "completed" for s in status) else 1


if __name__ == "__main__":
    sys.exit(main())
