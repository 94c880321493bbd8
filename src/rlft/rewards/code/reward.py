"""The `code` reward: extract the program from a completion, run it in the sandbox, graded credit.

Extraction takes the last *closed* fenced block tagged with the task's language (```python), else
the last closed fence of any kind. Unfenced text is not run by default (`allow_unfenced=False`):
prose is almost never valid Python, and rewarding a bare program would teach the model to drop
the format the prompt asked for. A fence left open by the length limit is not code either: the
program was cut off.
"""

from __future__ import annotations

import re
from typing import Any

from rlft.rewards.code.cases import BadTests, Credit, Verdict, parse_tests, unverifiable, zero
from rlft.rewards.code.sandbox import Limits, run_program
from rlft.rewards.scoring import RewardFn, RewardValue, register_reward

LANGUAGE_TAGS = {"python": {"python", "py", "python3", "py3"}}
# A fence opens at the start of a line with ``` and an optional tag, and closes at a line that is
# only ``` (trailing spaces allowed). Lazy body: each fence ends at its own closing line.
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)


def extract_code(completion: str, language: str = "python", allow_unfenced: bool = False) -> str | None:
    """The program in a completion, or None when there is none.

    >>> extract_code("Try:\\n```python\\nprint(1)\\n```\\nor\\n```\\nprint(2)\\n```")
    'print(1)\\n'
    """
    tags = LANGUAGE_TAGS.get(language, {language})
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    tagged = [body for tag, body in blocks if tag in tags]
    if tagged:
        return tagged[-1]
    if blocks:
        return blocks[-1][1]
    if allow_unfenced and completion.strip():
        return completion
    return None


def judge_completion(completion: str, tests: Any, language: str = "python", allow_unfenced: bool = False,
                     credit: Credit = Credit(), **run_args: Any) -> Verdict:
    """Extract the program and run it: status `no_code` (score 0) when there is no program."""
    program = extract_code(completion, language, allow_unfenced)
    if program is None:
        try:
            total = len(parse_tests(tests).cases)
        except BadTests as exc:
            return unverifiable("bad_tests", str(exc))
        return zero("no_code", "no closed fenced code block in the completion", credit, total)
    return run_program(program, tests, credit=credit, **run_args)


@register_reward("code")
def code(
    language: str = "python",
    field: str = "tests",
    parse: float = 0.2,
    run: float = 0.4,
    tests: float = 0.4,
    timeout: float = 10.0,
    case_timeout: float | None = None,
    memory_mb: int = 1024,
    max_processes: int = 64,
    file_size_mb: int = 64,
    allow_unfenced: bool = False,
) -> RewardFn:
    """Graded credit for a program run against row[field] in the sandbox:
    parse (compiles) + run (× fraction of cases that ran cleanly; only once a test passes) + tests
    (× pass ratio).

    Returns {"parse", "run", "tests"} (each logged as code/<part>); 0 for no code; None when the
    tests are malformed or the sandbox failed (unverifiable, left out of the group baseline).
    """
    if language not in LANGUAGE_TAGS:
        raise ValueError(f"code reward: language {language!r} is not supported; the sandbox runs: "
                         f"{', '.join(LANGUAGE_TAGS)}")
    if timeout <= 0 or (case_timeout is not None and case_timeout <= 0):
        raise ValueError(f"code reward: timeouts must be positive, got timeout={timeout}, case_timeout={case_timeout}")
    credit = Credit(parse, run, tests)
    limits = Limits(memory_mb=memory_mb, processes=max_processes, file_size_mb=file_size_mb)

    def reward(prompt: str, completion: str, **row: Any) -> RewardValue:
        if row.get(field) is None:
            return None  # a row without tests cannot be verified; not the model's fault
        verdict = judge_completion(completion, row[field], language, allow_unfenced, credit,
                                   timeout=timeout, case_timeout=case_timeout, limits=limits)
        return None if verdict.score is None else dict(verdict.parts)

    reward.required_fields = (field,)
    return reward
