"""`rlft config-help`: every config field with its default, allowed values and meaning, and the
built-in rewards with their arguments."""

from __future__ import annotations

import inspect
from typing import Any, Literal

from pydantic import BaseModel

from rlft.config import _BASE_PRESET, METHOD_LEARNING_RATES, PRESETS, Config, RewardSpec, _section_type


def config_reference() -> str:
    """Every field with its default, its allowed values and meaning, for `rlft config-help`.
    Fields whose default depends on the method list the value each method uses."""
    out: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = _section_type(field.annotation)
            key = f"{prefix}{name}"
            if sub is not None and sub is not RewardSpec:
                out.append(f"\n[{key}]" + (f"  {field.description}" if field.description else ""))
                walk(sub, key + ".")
                continue
            default = _default_text(key, field)
            choices = _choices(field.annotation)
            allowed = f"  (one of: {', '.join(map(repr, choices))})" if choices else ""
            out.append(f"  {key} = {default}{allowed}  # {field.description or ''}")
            if sub is RewardSpec:
                walk(sub, key + "[].")

    walk(Config, "")
    return "\n".join(out).strip()


def _default_text(key: str, field: Any) -> str:
    if key == "training.learning_rate":
        return "by method: " + ", ".join(f"{m} {v:g}" for m, v in METHOD_LEARNING_RATES.items())
    section, _, name = key.partition(".")
    if section == "algorithm" and name in _BASE_PRESET:
        values = {m: {**_BASE_PRESET, **PRESETS[m]}[name] for m in PRESETS}
        if len(set(map(repr, values.values()))) == 1:
            return repr(next(iter(values.values())))
        return "by method: " + ", ".join(f"{m} {v!r}" for m, v in values.items())
    return "required" if field.is_required() else repr(field.get_default(call_default_factory=True))


def _choices(annotation: Any) -> list[Any]:
    """The allowed values of a Literal field, or of an optional one (`Literal[...] | None`)."""
    if getattr(annotation, "__origin__", None) is Literal:
        return list(annotation.__args__)
    args = [a for a in getattr(annotation, "__args__", ()) or () if a is not type(None)]
    return _choices(args[0]) if len(args) == 1 else []


def reward_reference() -> str:
    """Each built-in reward (a `rewards[].fn` name) with its `args`: name = default (or required),
    and the first paragraph of its docstring."""
    from rlft.rewards import BUILTIN_REWARDS

    out = ["[built-in rewards]  rewards: [{fn: NAME, args: {...}}]; or 'module:function' / 'file.py:function' "
           "for your own fn(prompt, completion, **row)"]
    for name in sorted(BUILTIN_REWARDS):
        factory = BUILTIN_REWARDS[name]
        args = [f"{p.name}={'(required)' if p.default is p.empty else repr(p.default)}"
                for p in inspect.signature(factory).parameters.values() if p.kind not in (p.VAR_POSITIONAL,
                                                                                             p.VAR_KEYWORD)]
        summary = " ".join((inspect.getdoc(factory) or "").strip().split("\n\n")[0].split())  # first paragraph
        out.append(f"  {name}: {summary}")
        out.append(f"      args: {', '.join(args) if args else '(none)'}")
    return "\n".join(out)
