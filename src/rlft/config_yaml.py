"""Reading a config YAML file: PyYAML's safe loader, except that a key given twice in one mapping
is an error (plain YAML keeps the last one silently, so `seed: 0` ... `seed: 5` trained with 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
