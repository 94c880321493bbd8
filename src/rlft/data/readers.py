"""Read dataset rows from JSONL, JSON, Parquet, a saved HF dataset or the hub, keeping each row's
location (`file:line`) so every report can point at it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlft.errors import DataError


@dataclass
class Row:
    where: str  # "data/train.jsonl:17" -- 1-based line, or "name[split]#index"
    data: dict[str, Any] | None  # None when the row could not be parsed
    error: str | None = None  # parse error, reported by validation


def read_rows(source: str, split: str = "train") -> list[Row]:
    if source.startswith("hf:"):
        return _read_hub(source[3:], split)
    path = Path(source)
    if not path.exists():
        raise DataError(f"data file not found: {source}\nFix: check data.train / data.eval, or use 'hf:NAME' "
                        "for a hub dataset")
    if path.is_dir():
        return _read_saved_dataset(path, split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{source}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet, a saved HF "
                    "dataset folder, or 'hf:NAME'")


def _read_jsonl(path: Path) -> list[Row]:
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
        raise DataError(f"{path}: not a saved HF dataset folder ({exc})") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r}; available: {', '.join(ds)}")
        ds = ds[split]
    return [Row(f"{path}[{split}]#{i}", dict(r)) for i, r in enumerate(ds)]


def _read_hub(name: str, split: str) -> list[Row]:
    from datasets import load_dataset

    try:
        ds = load_dataset(name, split=split)
    except Exception as exc:
        raise DataError(f"hf:{name}: could not load split {split!r}: {exc}") from None
    return [Row(f"hf:{name}[{split}]#{i}", dict(r)) for i, r in enumerate(ds)]
