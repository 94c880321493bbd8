"""Reading a config YAML file: PyYAML's safe loader, except that a key given twice in one mapping
is an error (plain YAML keeps the last one silently, so `seed: 0` ... `seed: 5` trained with 5)."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlft import paths
from rlft.config.run import Config
from rlft.errors import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(key)
        self.key, self.first_line, self.second_line = key, first_line, second_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated within one mapping (a `<<` merge may still be
    overridden: that is what merges are for)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader reports it itself
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise _DuplicateKey(key, first, line)
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(text: str, origin: str | Path) -> Any:
    """The YAML document in `text`; `origin` (a file name) is what errors name."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except _DuplicateKey as dup:
        raise ConfigError(f"{origin}: the key {dup.key!r} is given twice (lines {dup.first_line} and "
                          f"{dup.second_line}); YAML would silently keep the second. Remove one of them") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: not valid YAML: {exc}") from None



def load_config(source: str | Path | dict[str, Any], overrides: list[str] | None = None) -> Config:
    """Load a config from a YAML file (or a dict) and apply `a.b=value` overrides."""
    if isinstance(source, dict):
        raw, origin = copy.deepcopy(source), "config"  # overrides must not edit the caller's dict
    else:
        path = Path(source)
        problem = paths.config_file_problem(path, "config")  # a folder, a data file, a binary file ...
        if problem:
            raise ConfigError(problem)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        raw = load_yaml(path.read_text(), path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
        origin = str(path)
    given: dict[str, str] = {}  # dotted key -> the override as written, to say where an error came from
    for item in overrides or []:
        apply_override(raw, item)
        given[item.partition("=")[0].strip()] = item
    return validate_config(raw, origin, given)



def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p for p in parts):
        raise ConfigError(f"bad override {item!r}: write it as section.key=value, e.g. training.learning_rate=1e-5")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"bad override {item!r}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value



def validate_config(raw: dict[str, Any], origin: str = "config", overrides: dict[str, str] | None = None) -> Config:
    """`overrides` (dotted key -> 'key=value' as given) lets an error name the command-line override
    it came from instead of blaming the file."""
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        in_file, on_command_line = [], []
        for err in exc.errors():
            text = _describe_error(err)
            item = _override_behind(err, text, overrides or {})
            if item is None:
                in_file.append(text)
            else:
                on_command_line.append(f"command-line override {item!r}: {text}")
        parts = []
        if in_file:
            parts.append(f"{origin}: invalid configuration\n" + "\n".join(f"  - {ln}" for ln in in_file))
        parts += on_command_line
        raise ConfigError("\n".join(parts)) from None



def _override_behind(err: dict[str, Any], text: str, overrides: dict[str, str]) -> str | None:
    """The override that set the field an error is about (the field itself, a section it replaced,
    or a key under a misspelt section); for errors of the whole config (cross-field checks), one
    whose key the message names."""
    path = ".".join(str(p) for p in err["loc"])
    for key, item in overrides.items():
        if path and (path == key or path.startswith(key + ".") or key.startswith(path + ".")):
            return item
    if not path:
        return next((item for key, item in overrides.items() if key in text), None)
    return None



def _describe_error(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        guess = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f" Did you mean '{'.'.join(loc[:-1] + [guess[0]])}'?" if guess else ""
        return f"{path}: unknown key.{hint} Valid keys here: {', '.join(valid)}"
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    expected = _EXPECTED.get(kind)
    got = err.get("input")
    if expected:
        return f"{path}: expected {expected}, got {got!r} ({type(got).__name__})"
    if kind == "literal_error":
        return f"{path}: {err['msg'].lower()}, got {got!r}"
    return f"{path}: {err['msg']} (got {got!r})"



_EXPECTED = {
    "float_parsing": "a number", "float_type": "a number", "int_parsing": "an integer", "int_type": "an integer",
    "int_from_float": "an integer", "bool_parsing": "true or false", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}



def _valid_keys(loc: list[str]) -> list[str]:
    """Field names of the section at `loc` (list indices skipped)."""
    model: type[BaseModel] = Config
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _section_type(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)



def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _section_type(arg)
        if found is not None:
            return found
    return None



def dump_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))



def validate_flags(section: type[BaseModel], values: dict[str, Any], flags: dict[str, str], prefix: str) -> Any:
    """A config section built from command-line flags, with the same checks as the config file;
    each error names its flag (`flags`: field -> '--flag') and the field it stands for."""
    try:
        return section.model_validate(values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            if field in flags:
                lines.append(f"{flags[field]} {err.get('input')!r}: {err['msg'][0].lower()}{err['msg'][1:]} "
                             f"({prefix}{field})")
            else:
                lines.append(_describe_error({**err, "loc": (prefix.rstrip("."), *err["loc"])}))
        raise ConfigError("\n".join(lines)) from None
