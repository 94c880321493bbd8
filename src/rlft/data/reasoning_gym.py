"""Tasks from reasoning-gym (procedural generators with their own verifiers; `pip install
'rlft[reasoning-gym]'`) as a data source: `reasoning_gym:TASK?size=N&eval_size=M&seed=S&KEY=VALUE`.

The same location serves both sides of a run. Split `train` is the first `size` entries of the
task seeded with `seed`; split `test` (the held-out rows, data.eval_split's default for such a
source) is `eval_size` entries of the task seeded differently, keeping only questions that are
not among the train entries, so the two never share a question. Other keys are the task's own
config (difficulty: `min_terms=2&max_terms=4`, ...), checked against its config class.

Each row is a chat prompt (a system prompt of reasoning-gym's, `system=default` unless set:
`simple`, `direct`, ..., or `none` for the question alone, then the question), the reference `answer`, and the generator's whole entry in `rg_entry`, which
the `reasoning_gym` reward hands back to the task's own `score_answer`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any
from urllib.parse import parse_qsl

from rlft.data.row import Row
from rlft.errors import DataError
from rlft.rewards.gym import import_reasoning_gym

PREFIX = "reasoning_gym:"
SPLITS = ("train", "test")
_HELD_OUT_SEED_OFFSET = 1_000_003  # the held-out generator's seed: seed + this


def is_reasoning_gym(source: str) -> bool:
    return source.startswith(PREFIX)


@dataclasses.dataclass(frozen=True)
class GymSource:
    task: str
    size: int = 1000
    eval_size: int = 200
    seed: int = 0
    system: str = "default"  # reasoning-gym's SYSTEM_PROMPTS key, or 'none'
    config: tuple[tuple[str, Any], ...] = ()


_LOCATION_KEYS = ("size", "eval_size", "seed", "system")  # the rest of a location's keys are the task's


def parse(source: str) -> GymSource:
    """`reasoning_gym:TASK?size=..` -> its parts; values are read as JSON where they parse
    (numbers, true/false, lists), else as text."""
    body = source[len(PREFIX):]
    task, _, query = body.partition("?")
    settings: dict[str, Any] = {}
    for key, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw
    known = {name: settings.pop(name) for name in _LOCATION_KEYS if name in settings}
    for name in ("size", "eval_size", "seed"):
        if name in known and (not isinstance(known[name], int) or known[name] < (0 if name == "seed" else 1)):
            raise DataError(f"{source}: {name}={known[name]!r} must be a whole number"
                            f"{' >= 0' if name == 'seed' else ' >= 1'}")
    return GymSource(task, config=tuple(sorted(settings.items())), **known)


def _dataset(src: GymSource, seed: int, size: int, where: str) -> Any:
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if src.task not in DATASETS:
        raise DataError(f"{where}: unknown reasoning-gym task {src.task!r}. Valid tasks: {', '.join(sorted(DATASETS))}")
    _, config_cls = DATASETS[src.task]
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = sorted(k for k, _ in src.config if k not in fields)
    if unknown:
        raise DataError(f"{where}: {src.task} has no setting {unknown[0]!r}; its settings: {', '.join(sorted(fields))}")
    try:
        return rg.create_dataset(src.task, seed=seed, size=size, **dict(src.config))
    except (AssertionError, ValueError, TypeError) as exc:  # the task's own config checks
        raise DataError(f"{where}: {src.task} refused its settings {dict(src.config)}: {exc}") from None


def read_reasoning_gym(source: str, split: str) -> list[Any]:
    """The rows of one split (see the module docstring), as `readers.Row`s."""

    if split not in SPLITS:
        raise DataError(f"{source}: split {split!r}; a reasoning-gym source has splits 'train' (data.split) and "
                        "'test' (the held-out rows, data.eval_split's default for it)")
    src = parse(source)
    train = _dataset(src, src.seed, src.size, source)
    if split == "train":
        entries = list(train)
    else:  # twice the rows asked for, less any question the train split holds
        seen = {e["question"] for e in train}
        pool = _dataset(src, src.seed + _HELD_OUT_SEED_OFFSET, 2 * src.eval_size, source)
        entries = [e for e in pool if e["question"] not in seen][: src.eval_size]
        if len(entries) < src.eval_size:
            raise DataError(f"{source}: only {len(entries)} held-out questions differ from the {src.size} train "
                            f"ones (eval_size={src.eval_size}); the task's space is small at these settings: lower "
                            "size or eval_size, or widen the difficulty")
    prompts = import_reasoning_gym().utils.SYSTEM_PROMPTS
    if src.system != "none" and src.system not in prompts:
        raise DataError(f"{source}: system={src.system!r} is not one of reasoning-gym's system prompts: "
                        f"{', '.join(prompts)}, or none")
    system = [] if src.system == "none" else [{"role": "system", "content": prompts[src.system]}]
    return [Row(f"{PREFIX}{src.task}[{split}]#{i}",
                {"messages": [*system, {"role": "user", "content": e["question"]}],
                 "answer": str(e["answer"]), "rg_entry": e})
            for i, e in enumerate(entries)]
