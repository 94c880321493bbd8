"""A verifiers 0.4 taskset for the examples' arithmetic task (agent.environment: verifiers:examples/verifiers_taskset.py).

Written against verifiers 0.4's v1 stack (`import verifiers.v1 as vf`): a module exporting its
`vf.Taskset`, whose tasks score a reply with `@vf.reward` methods (weighted) and `@vf.metric`
methods (logged). The taskset's config fields are what `agent.environment_args` set; v1 has no eval
split, so `split` here picks the held-out file and `agent.environment_eval_args: {split: heldout}`
asks for it. This file knows nothing about training.
"""

import json
import re
from pathlib import Path

import verifiers.v1 as vf

DATA = Path(__file__).resolve().parent / "data"
FILES = {"train": "arith_rl_prompts.jsonl", "heldout": "arith_heldout.jsonl"}
ANSWER = re.compile(r"The answer is\s*(-?\d+)\.?\s*$")


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = ANSWER.search(trace.last_reply or "")
        return 1.0 if found and found.group(1) == self.data.answer else 0.0

    @vf.reward(weight=0.2)
    async def answer_format(self, trace: vf.Trace) -> float:
        """1 when the reply ends with 'The answer is N.'"""
        return 1.0 if ANSWER.search(trace.last_reply or "") else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumsConfig(vf.TasksetConfig):
    split: str = "train"
    num_tasks: int = 2000


class Sums(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        lines = (DATA / FILES[self.config.split]).read_text().splitlines()[:self.config.num_tasks]
        for line in lines:
            row = json.loads(line)
            yield SumTask(SumData(prompt=row["prompt"], answer=row["answer"]), self.config.task)


__all__ = ["Sums"]
