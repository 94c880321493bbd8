"""Read dataset rows from JSONL, JSON, Parquet, a saved HF dataset or the hub, keeping each row's
location (`file:line`) so every report can point at it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlft.config import DataConfig
from rlft.data.reasoning_gym import is_reasoning_gym, read_reasoning_gym
from rlft.data.row import Row
from rlft.errors import DataError
from rlft.models.hub import hub_unreachable, offline
from rlft.paths import is_named_source

# data.max_row_bytes: callers that do not pass the setting still get the guard at its default
DEFAULT_MAX_ROW_BYTES: int = DataConfig.model_fields["max_row_bytes"].default


def read_rows(source: str, split: str = "train", max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
              agent: Any = None) -> list[Row]:
    """The rows of a dataset; a row over `max_row_bytes` is an invalid row (reported by validation,
    never parsed further: tokenizing a 50 MB line took minutes and gigabytes). `agent`: the run's
    agent section, whose verifiers environment `verifiers:train` / `verifiers:eval` read."""
    rows = _read(source, split, max_row_bytes, agent)
    if Path(source).suffix.lower() == ".jsonl":  # checked line by line, before parsing
        return rows
    return [_limit(row, max_row_bytes) for row in rows]


def check_source(source: str, setting: str = "data.train / data.eval") -> None:
    """A local data source exists (a hub dataset, 'hf:NAME', is found when it is read)."""
    if not is_named_source(source) and not Path(source).exists():
        raise DataError(f"data file not found: {source}\nFix: " + (
            f"{source!r} is written in Windows style (a drive letter or backslashes), which this system does "
            f"not read as a path; write it with '/', e.g. {windows_to_posix(source)!r}"
            if looks_like_windows(source) else f"check {setting}, or use 'hf:NAME' for a hub dataset"))


def _read(source: str, split: str, max_row_bytes: int, agent: Any) -> list[Row]:
    if source.startswith("hf:"):
        return _read_hub(source[3:], split)
    if is_reasoning_gym(source):
        return read_reasoning_gym(source, split)
    if source.startswith("verifiers:"):
        from rlft.rollout.agent.verifiers_env import dataset_records  # lazy: verifiers, an optional extra

        return [Row(where, data) for where, data in dataset_records(source, agent)]
    check_source(source)
    path = Path(source)
    if path.is_dir():
        return _read_saved_dataset(path, split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, max_row_bytes)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{source}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet, a saved HF "
                    "dataset folder, or 'hf:NAME'")


def _too_big(limit: int) -> str:
    return f"row larger than data.max_row_bytes ({limit:,} bytes; raise it if rows this large are intended)"


def _limit(row: Row, limit: int) -> Row:
    """A row read whole (JSON list, Parquet, HF dataset) checked by the size of its text."""
    if row.data is not None and _text_size(row.data) > limit:
        return Row(row.where, None, _too_big(limit))
    return row


def _text_size(value: Any) -> int:
    """Characters of text and bytes in a parsed row (nested lists and dicts included): what
    tokenizing and templating it would cost, without serializing it."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(k) + _text_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 8


def _read_jsonl(path: Path, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> list[Row]:
    rows = []
    try:
        # "\n" only: splitlines() also breaks at U+2028, U+2029 and U+0085, which JSON strings may
        # hold raw (json.dumps(ensure_ascii=False) writes them so).
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read the file: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        size = len(line) if line.isascii() else len(line.encode("utf-8"))
        if size > max_row_bytes:  # before parsing
            rows.append(Row(where, None, _too_big(max_row_bytes)))
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            rows.append(Row(where, None, f"bad JSON ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(value, dict):
            rows.append(Row(where, None, f"a line must hold a JSON object, got {type(value).__name__}"))
            continue
        rows.append(Row(where, value))
    return rows


def _read_json(path: Path) -> list[Row]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not readable as JSON: {exc}") from None
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        raise DataError(f"{path}: a .json dataset must be a list of objects (or {{'data': [...]}})")
    return [Row(f"{path}#{i}", v) if isinstance(v, dict) else
            Row(f"{path}#{i}", None, f"item must be an object, got {type(v).__name__}") for i, v in enumerate(value)]


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read Parquet: {exc}") from None
    return [Row(f"{path}:row {i}", r) for i, r in enumerate(table.to_pylist())]


def _read_saved_dataset(path: Path, split: str) -> list[Row]:
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except Exception as exc:
        files = sorted(p.name for p in path.iterdir())[:5]
        raise DataError(f"{path}: not a saved HF dataset folder ({exc}); it holds: "
                        f"{', '.join(files) or 'nothing'}.\nFix: point the data setting at a data file inside it "
                        "(.jsonl, .json, .parquet), or at a folder written by Dataset.save_to_disk") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r}; available: {', '.join(ds)}")
        ds = ds[split]
    return [Row(f"{path}[{split}]#{i}", dict(r)) for i, r in enumerate(ds)]


def _read_hub(name: str, split: str) -> list[Row]:
    from contextlib import nullcontext

    from datasets import load_dataset

    unreachable = None if os.path.exists(name) else hub_unreachable()  # a local folder needs no hub
    try:
        with offline() if unreachable else nullcontext():
            ds = load_dataset(name, split=split)
    except Exception as exc:
        if unreachable and (isinstance(exc, ConnectionError) or "offline" in str(exc).lower()):
            raise DataError(f"hf:{name} is not in the local datasets cache, and the hub cannot be used ({unreachable})."
                            f"\nFix: load it once on a machine with network access and copy the cache here, or save "
                            "it to a file (.jsonl/.parquet) or folder (Dataset.save_to_disk) and point the data "
                            "setting at that") from None
        raise DataError(f"hf:{name}: could not load split {split!r}: {exc}") from None
    return [Row(f"hf:{name}[{split}]#{i}", dict(r)) for i, r in enumerate(ds)]


def looks_like_windows(source: str) -> bool:
    """`C:\\data\\x.jsonl`, `data\\x.jsonl`: a path that only means something on Windows (checked
    where it was not found, on a system whose separator is '/')."""
    import os
    import re

    return os.sep == "/" and ("\\" in source or re.match(r"[A-Za-z]:[\\/]", source) is not None)


def windows_to_posix(source: str) -> str:
    import re

    return re.sub(r"^[A-Za-z]:", "", source).replace("\\", "/")
