"""Worked two-digit addition: the demo's task, its datasets, and synthetic preference pairs for the
DPO and reward-model examples and tests.

The answers use a worked-carry format ("3+8=11, carry 1. 5+9+1=15. The answer is 151.").
`make_datasets` writes the demo's SFT, RL and held-out splits (disjoint problems); the SFT answers
come from a sloppy annotator who forgets to add the carry in most carry cases, so imitation
learns the format and the mistake while a verifiable reward can teach the sum.

For preference pairs the rejected answer is a hard negative -- the same format with one slip, not nonsense:

- `forgot_carry`: the carry is stated but not added ("carry 1. 5+9+0=14. The answer is 141.")
- `spurious_carry`: a carry is added that was never there ("carry 0. 2+6+1=9. ...")
- `wrong_final`: every step right, the final answer miscopied (one digit off)

Telling them apart means checking the answer against itself, not spotting a word; chosen and
rejected have the same length up to a digit, so length says nothing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

KINDS = ("forgot_carry", "spurious_carry", "wrong_final")
# What examples/data/arith_pref_{train,heldout}.jsonl hold: write_preference_data("examples/data", **EXAMPLE_DATA)
EXAMPLE_DATA = dict(train_rows=2000, heldout=200, seed=0)


def worked_answer(a: int, b: int, added: int | None = None, final: int | None = None) -> str:
    """The worked solution; `added` overrides the carry added to the tens, `final` the answer."""
    units = a % 10 + b % 10
    carry = units // 10
    added = carry if added is None else added
    tens = a // 10 + b // 10 + added
    final = tens * 10 + units % 10 if final is None else final
    return f"{a % 10}+{b % 10}={units}, carry {carry}. {a // 10}+{b // 10}+{added}={tens}. The answer is {final}."


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def all_problems(seed: int) -> list[tuple[int, int]]:
    """Every two-digit addition problem, shuffled with `seed`."""
    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(problems)
    return problems


def make_datasets(out: Path, seed: int = 0, heldout: int = 200, sft_rows: int = 2000, rl_rows: int = 2000,
                  forget_rate: float = 0.7) -> dict[str, Path]:
    """The demo's disjoint SFT, RL-prompt and held-out splits as JSONL; only the SFT answers are
    sloppy (the carry is dropped in `forget_rate` of the carry cases)."""
    rng = random.Random(seed)  # one stream: the shuffle, then the annotator's slips
    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(problems)
    splits = {"heldout": problems[:heldout], "sft": problems[heldout:heldout + sft_rows],
              "rl_prompts": problems[heldout + sft_rows:heldout + sft_rows + rl_rows]}
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.jsonl" for name in ("sft", "rl_prompts", "heldout")}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for a, b in splits["sft"]:
        forget = (a % 10 + b % 10 >= 10) and rng.random() < forget_rate
        rows["sft"].append({"prompt": question(a, b), "completion": worked_answer(a, b, added=0 if forget else None),
                            "answer": str(a + b)})
    rows["rl_prompts"] = [{"prompt": question(a, b), "answer": str(a + b)} for a, b in splits["rl_prompts"]]
    # held-out rows carry the correct worked solution, for eval loss and reading
    rows["heldout"] = [{"prompt": question(a, b), "completion": worked_answer(a, b), "answer": str(a + b)}
                       for a, b in splits["heldout"]]
    # the demo's eval suites: the carry problems (what the sloppy SFT data gets wrong and RL must
    # fix) and the no-carry ones (what SFT already taught, which RL must keep)
    carries = [(a % 10 + b % 10 >= 10) for a, b in splits["heldout"]]
    rows["heldout_carry"] = [r for r, c in zip(rows["heldout"], carries) if c]
    rows["heldout_nocarry"] = [r for r, c in zip(rows["heldout"], carries) if not c]
    paths.update({name: out / f"{name}.jsonl" for name in ("heldout_carry", "heldout_nocarry")})
    for name, path in paths.items():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
    return paths


def _rejected(a: int, b: int, kind: str, rng: random.Random) -> str:
    if kind == "forgot_carry":
        return worked_answer(a, b, added=0)
    if kind == "spurious_carry":
        return worked_answer(a, b, added=1)
    right = a + b
    digits = list(str(right))
    i = rng.randrange(len(digits))
    digits[i] = str((int(digits[i]) + rng.choice([1, 2, 8, 9])) % 10)
    wrong = int("".join(digits))
    return worked_answer(a, b, final=wrong if wrong != right and digits[0] != "0" else right + 10)


def preference_rows(problems: list[tuple[int, int]], seed: int = 0,
                    kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """One pair per problem, the slip drawn uniformly from `kinds`. A carry slip that does not
    fit the problem becomes the one that does (a forgotten carry needs a carry, a spurious one
    needs none), so with all three kinds each is about a third of the pairs; a problem that fits
    none of `kinds` is skipped."""
    swap = {"forgot_carry": "spurious_carry", "spurious_carry": "forgot_carry"}
    rng = random.Random(seed)
    rows = []
    for a, b in problems:
        has_carry = a % 10 + b % 10 >= 10
        kind = rng.choice(kinds)
        if (kind == "forgot_carry") != has_carry and kind in swap:
            kind = swap[kind]
        if kind not in kinds:
            continue
        rows.append({"prompt": question(a, b), "chosen": worked_answer(a, b),
                     "rejected": _rejected(a, b, kind, rng), "kind": kind})
    return rows


def split_problems(seed: int = 0, heldout: int = 200) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All two-digit problems, shuffled: (training problems, held-out problems)."""
    problems = all_problems(seed)
    return problems[heldout:], problems[:heldout]


def write_preference_data(out_dir: str | Path, train_rows: int = 2000, heldout: int = 200, seed: int = 0,
                          kinds: tuple[str, ...] = KINDS) -> dict[str, Path]:
    """Write `arith_pref_train.jsonl` and `arith_pref_heldout.jsonl` (disjoint problems)."""
    train_problems, heldout_problems = split_problems(seed, heldout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "arith_pref_train.jsonl", "heldout": out / "arith_pref_heldout.jsonl"}
    for name, problems, rows_seed in (("train", train_problems[:train_rows], seed + 1),
                                      ("heldout", heldout_problems, seed + 2)):
        rows = preference_rows(problems, rows_seed, kinds)
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
