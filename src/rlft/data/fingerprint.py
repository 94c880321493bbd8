"""What a run trains on, recorded when it starts and compared when it resumes: a training file
replaced between two attempts would otherwise be trained on silently from a checkpoint whose data
order, epochs and step count were made for the old rows.

Only local sources are fingerprinted (files, and saved dataset folders file by file). An 'hf:NAME'
dataset is named by the config itself and lives in the datasets cache, and a 'reasoning_gym:' task
is generated from the seed and settings the config holds; a changed config is refused already.

The fingerprint must cost little on files of many GB, since every start computes it: the size, the
line count of a JSONL file (a count of newlines: the reader reads the whole file anyway, and this
is many times cheaper than parsing it) or a Parquet file's row count (from its footer), and a
SHA-256 of the whole file up to 64 MiB, of its first and last MiB beyond that. A replacement file
differs in at least one of these; an edit inside a big file that keeps its size, its line count
and both ends is the one change it misses. The modification time is left out on purpose: a copy
or a `touch` changes it without changing a row.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from rlft.config import Config
from rlft.paths import is_named_source

WHOLE_HASH_MAX = 64 << 20  # files up to this size are hashed whole
ENDS = 1 << 20  # beyond it: the first and the last MiB
_CHUNK = 1 << 20


def training_sources(config: Config) -> list[tuple[str, str]]:
    """(setting, location) of every source the run trains on: data.train (each source of a mix)
    and algorithm.sft_mix."""
    train = config.data.train
    sources = [("data.train", train)] if isinstance(train, str) else [
        (f"data.train[{i}]", source.path) for i, source in enumerate(train)]
    if config.algorithm.sft_mix:
        sources.append(("algorithm.sft_mix", config.algorithm.sft_mix))
    return sources


def data_fingerprints(config: Config) -> dict[str, dict[str, Any]]:
    """{location: fingerprint} of the run's local training sources (those that exist now)."""
    prints = {location: fingerprint(location) for _, location in training_sources(config)}
    return {location: fp for location, fp in prints.items() if fp is not None}


def fingerprint(location: str) -> dict[str, Any] | None:
    """The fingerprint of a local source (see the module docstring); None for a hub dataset or a
    generated task, or a path that does not exist now (its reader says so)."""
    if is_named_source(location):
        return None
    path = Path(location)
    if path.is_file():
        return _file_fingerprint(path)
    if path.is_dir():  # a saved HF dataset: its files, by name
        files = sorted(p for p in path.rglob("*") if p.is_file())
        digest = hashlib.sha256()
        for file in files:
            digest.update(f"{file.relative_to(path)}\0{_file_fingerprint(file)['sha256']}\0".encode())
        return {"bytes": sum(f.stat().st_size for f in files), "sha256": digest.hexdigest()}
    return None


def _file_fingerprint(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= WHOLE_HASH_MAX:
            for block in iter(lambda: f.read(_CHUNK), b""):
                digest.update(block)
        else:
            digest.update(f.read(ENDS))
            f.seek(size - ENDS)
            digest.update(f.read(ENDS))
    out: dict[str, Any] = {"bytes": size, "sha256": digest.hexdigest()}
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        out["lines"] = _jsonl_lines(path)
    elif suffix == ".parquet":
        out["rows"] = _parquet_rows(path)
    return out


def _jsonl_lines(path: Path) -> int:
    """Lines as the reader splits them (a last one without its newline counts too)."""
    lines, last = 0, b"\n"
    with path.open("rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _parquet_rows(path: Path) -> int | None:
    try:
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    except Exception:  # not readable as Parquet: its reader reports that, with the file's name
        return None


def describe(print_of: dict[str, Any]) -> str:
    """'2,000 lines, 96,113 bytes' (a JSONL file), '500 rows, ...' (Parquet), '96,113 bytes'."""
    counts = [f"{print_of[unit]:,} {unit}" for unit in ("lines", "rows") if print_of.get(unit) is not None]
    return ", ".join([*counts, f"{print_of['bytes']:,} bytes"])
