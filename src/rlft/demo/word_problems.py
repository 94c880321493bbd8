"""Arithmetic word problems for the real-model demo: addition, subtraction and multiplication in
everyday sentences, with exact integer answers checked by the `math` reward.

Each problem is (template, a, b); the operand ranges set the difficulty. `make_splits` draws a
training pool and a held-out set with no (operation, a, b) in common, so held-out accuracy measures
problems the policy never saw. The prompt asks for a final line the `math` reward (and a format
regex) can read: "The answer is N."
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The system prompt replaces SmolLM2's default one; a worked one-line example is what made the
# model answer in a checkable form most often (no instruction alone did, on this 135M model).
SYSTEM_PROMPT = ("Solve the math problem. Example: Tom has 12 apples and buys 5 more. How many apples does Tom "
                 "have?\n12 + 5 = 17. The answer is 17.")
# A completion is format-compliant when it ends with the answer sentence (one line of work before it is fine).
FORMAT_REGEX = r"(?s).*The answer is -?\d+\.?"

# {a} and {b} are the operands; {name} a person. Every template's question has one integer answer.
TEMPLATES: dict[str, list[str]] = {
    "+": [
        "{name} has {a} stickers and gets {b} more from a friend. How many stickers does {name} have now?",
        "A farm collected {a} eggs on Monday and {b} eggs on Tuesday. How many eggs did it collect in total?",
        "A library has {a} novels and {b} comic books. How many books is that altogether?",
        "{name} walked {a} meters to the park and then {b} meters to the shop. How many meters did {name} walk?",
        "A school bought {a} red pencils and {b} blue pencils. How many pencils did it buy?",
    ],
    "-": [
        "{name} had {a} marbles and gave away {b} of them. How many marbles does {name} have left?",
        "A bakery made {a} cookies and sold {b}. How many cookies are left?",
        "A train had {a} passengers. At the station, {b} passengers got off. "
        "How many passengers are still on the train?",
        "{name} saved {a} dollars and spent {b} dollars on a gift. How many dollars does {name} have left?",
        "A tank held {a} liters of water and {b} liters leaked out. How many liters are left in the tank?",
    ],
    "*": [
        "Each box holds {a} crayons. How many crayons are in {b} boxes?",
        "{name} reads {a} pages every day. How many pages does {name} read in {b} days?",
        "A bus has {a} seats. How many seats are there on {b} buses?",
        "One ticket costs {a} dollars. How many dollars do {b} tickets cost?",
        "A garden has {b} rows with {a} tulips in each row. How many tulips are in the garden?",
    ],
}
NAMES = ["Ava", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hugo", "Isla", "Jamal", "Kira", "Leo",
         "Maya", "Noah", "Olivia", "Priya", "Sam", "Tara"]


@dataclass(frozen=True)
class Level:
    """Operand ranges of one operation (inclusive). For subtraction b < a, so answers are positive."""

    op: str
    a: tuple[int, int]
    b: tuple[int, int]
    weight: float = 1.0


# The demo's mix. Greedy accuracy of SmolLM2-135M-Instruct (as shipped, 4-bit, imported to fp32),
# 40 problems per range, 48 new tokens: a+b with a 10-99, b 2-9: 8%; both 10-99: 12%; a*b with
# a 2-12, b 2-9: 38%; a 11-30, b 2-9: 35%; a-b with a 10-99, b 2-9: 0%, and a 20-99, b 10-99: 0%.
# Subtraction is left out of the default mix: a group in which no sample is right carries no GRPO
# signal. The mix below starts near 20% held-out accuracy, much of the misses unfinished or
# unparsable answers rather than wrong sums.
DEFAULT_LEVELS = (
    Level("+", (10, 99), (2, 9)),
    Level("+", (10, 99), (10, 99)),
    Level("*", (2, 12), (2, 9)),
    Level("*", (11, 30), (2, 9)),
)


def answer_of(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def draw_problem(rng: random.Random, level: Level) -> tuple[str, int, int]:
    a = rng.randint(*level.a)
    b = rng.randint(level.b[0], min(level.b[1], a - 1) if level.op == "-" else level.b[1])
    return level.op, a, b


def render(rng: random.Random, op: str, a: int, b: int) -> str:
    return rng.choice(TEMPLATES[op]).format(a=a, b=b, name=rng.choice(NAMES))


def make_rows(problems: list[tuple[str, int, int]], rng: random.Random) -> list[dict[str, Any]]:
    """Prompt rows (system + user messages) with the exact answer, for the `math` reward."""
    return [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": render(rng, op, a, b)}],
             "answer": str(answer_of(op, a, b)), "op": op, "a": a, "b": b} for op, a, b in problems]


def make_splits(seed: int = 0, train_rows: int = 2000, heldout_rows: int = 300,
                levels: tuple[Level, ...] = DEFAULT_LEVELS) -> dict[str, list[dict[str, Any]]]:
    """Disjoint training and held-out rows: no (op, a, b) appears in both, nor twice in either."""
    rng = random.Random(seed)
    weights = [lv.weight for lv in levels]
    seen: set[tuple[str, int, int]] = set()
    drawn: list[tuple[str, int, int]] = []
    attempts = 0
    while len(drawn) < train_rows + heldout_rows:
        attempts += 1
        if attempts > 50 * (train_rows + heldout_rows):
            raise ValueError("the operand ranges are too narrow for this many distinct problems")
        problem = draw_problem(rng, rng.choices(levels, weights)[0])
        if problem not in seen:
            seen.add(problem)
            drawn.append(problem)
    return {"heldout": make_rows(drawn[:heldout_rows], rng), "train": make_rows(drawn[heldout_rows:], rng)}


def write_splits(out_dir: str | Path, seed: int = 0, train_rows: int = 2000, heldout_rows: int = 300,
                 levels: tuple[Level, ...] = DEFAULT_LEVELS) -> dict[str, Path]:
    """`train.jsonl` and `heldout.jsonl` in `out_dir` (rows: prompt, answer, op, a, b)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in make_splits(seed, train_rows, heldout_rows, levels).items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


if __name__ == "__main__":  # python -m rlft.demo.word_problems OUT_DIR [SEED]: the demo's two files
    import sys

    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m rlft.demo.word_problems OUT_DIR [SEED]")
    for split, path in write_splits(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 0, 1000, 300).items():
        print(f"{split}: {path}")
