"""A verifiers environment for the examples' arithmetic task (agent.environment: verifiers:examples/verifiers_env.py).

Written against verifiers' classic API (pip install 'rlft[verifiers]'), as environments on the
Environments Hub are: `load_environment(**kwargs)` returns a `vf.SingleTurnEnv` with its dataset,
held-out set, parser and rubric. rlft trains on its dataset with its rubric as the reward; this
file knows nothing about training.
"""

import json
import re
from pathlib import Path

import verifiers as vf
from datasets import Dataset

DATA = Path(__file__).resolve().parent / "data"


class AnswerParser(vf.Parser):
    """Reads the number after 'The answer is' (the examples' answer format)."""

    def parse(self, text: str):
        found = re.search(r"The answer is\s*(-?\d+)", text or "")
        return found.group(1) if found else None

    def get_format_reward_func(self):
        def format_reward_func(completion, **kwargs) -> float:
            """1 when the last answer ends with 'The answer is N.'"""
            answer = self.get_assistant_messages(completion)[-1:] if completion else []
            text = self._content_to_text(self._message_field(answer[0], "content", "")) if answer else ""
            return 1.0 if re.search(r"The answer is\s*-?\d+\.?\s*$", text or "") else 0.0

        return format_reward_func


def _rows(file: str, n: int) -> Dataset:
    rows = [json.loads(line) for line in (DATA / file).read_text().splitlines()[:n]]
    return Dataset.from_list([{"question": r["prompt"], "answer": r["answer"]} for r in rows])


def load_environment(num_train: int = 2000, num_eval: int = 200) -> vf.Environment:
    parser = AnswerParser()

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, parser.get_format_reward_func()], weights=[1.0, 0.2], parser=parser)
    return vf.SingleTurnEnv(dataset=_rows("arith_rl_prompts.jsonl", num_train),
                            eval_dataset=_rows("arith_heldout.jsonl", num_eval), parser=parser, rubric=rubric)
