"""A training run under torchrun (or alone) for tests/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_driver.py [replay] CONFIG.yaml ...
                                                                                     [real:CONFIG.yaml ...]

Several configs run one after another in the same processes (a process group is set up once: the
tests pay the processes' start-up once). `replay` swaps the rollout engine for one whose completions depend only on (prompt, sample index,
call): the same in one process and on two ranks, so a test can compare the two runs' parameters
on "the same sampled completions and rewards" -- real sampling can flip one token when two
layouts' logits differ in the last float bit, and the runs then part ways. `real:CONFIG` runs with
the engine the config names (the HF engine, or vLLM), and so does every config after it.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch

torch.set_num_threads(1)


class ReplayEngine:
    def __init__(self, tokenizer: Any, stop_ids: list[int]):
        self.tokenizer, self.stop_id, self.calls = tokenizer, stop_ids[0], 0

    def generate(self, prompts, params, first_prompt: int = 0):
        from rlft.rollout.contract import Completion
        from rlft.rollout.seeds import stream_seed

        call, self.calls = self.calls, self.calls + 1
        out = []
        for i, prompt in enumerate(prompts):
            for k in range(params.n):
                g = torch.Generator().manual_seed(stream_seed(0, "replay", call, (first_prompt + i) * params.n + k))
                n = int(torch.randint(1, params.max_new_tokens, (1,), generator=g))
                ids = torch.randint(5, 300, (n,), generator=g).tolist() + [self.stop_id]
                out.append(Completion(list(prompt), ids, self.tokenizer.decode(ids, skip_special_tokens=True),
                                      [0.0] * len(ids), "stop", i))
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


def use_replay_engine() -> None:
    import rlft.training.online as online
    from rlft.rollout.hf import generation_stop_ids

    online.rollout_engine = lambda cfg, policy, seed, dtype=None: ReplayEngine(
        policy.tokenizer, generation_stop_ids(policy.model, policy.tokenizer))


def main() -> int:
    from rlft.api import train

    import rlft.training.online as online

    args = sys.argv[1:]
    real = online.rollout_engine
    if args and args[0] == "replay":
        args = args[1:]
        use_replay_engine()
    status = []
    for config in args:
        if config.startswith("real:"):  # a real engine from here on (the config says which)
            online.rollout_engine, config = real, config.removeprefix("real:")
        status.append(train(config)["status"])
    return 0 if all(s == "completed" for s in status) else 1


if __name__ == "__main__":
    sys.exit(main())
