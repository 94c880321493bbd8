"""Every data source the readers accept gives the same rows, each with a location a report can
point at: JSONL, JSON (a list or {"data": [...]}), Parquet, a saved HF dataset (plain or with
splits) and `hf:NAME` (here a local folder, the code path of a hub id)."""

from __future__ import annotations

import json

import pytest

from rlft.data.readers import read_rows
from rlft.errors import DataError

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]


def _data(rows):
    return [r.data for r in rows]


def test_jsonl_and_json_list_and_data_mapping(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    (tmp_path / "c.json").write_text(json.dumps({"data": ROWS}))
    jsonl, listed, mapped = (read_rows(str(tmp_path / n)) for n in ("a.jsonl", "b.json", "c.json"))
    assert _data(jsonl) == _data(listed) == _data(mapped) == ROWS
    assert jsonl[2].where == f"{tmp_path / 'a.jsonl'}:3" and listed[2].where == f"{tmp_path / 'b.json'}#2"
    (tmp_path / "d.json").write_text(json.dumps([ROWS[0], 7]))
    bad = read_rows(str(tmp_path / "d.json"))
    assert bad[1].data is None and "item must be an object, got int" in bad[1].error
    (tmp_path / "e.json").write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(DataError, match="must be a list of objects"):
        read_rows(str(tmp_path / "e.json"))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    rows = read_rows(str(path))
    assert _data(rows) == ROWS and rows[4].where == f"{path}:row 4"
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cannot read Parquet"):
        read_rows(str(tmp_path / "broken.parquet"))


def test_saved_dataset_with_and_without_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    DatasetDict({"train": Dataset.from_list(ROWS[:3]), "test": Dataset.from_list(ROWS[3:])}).save_to_disk(
        str(tmp_path / "split"))
    plain = read_rows(str(tmp_path / "plain"))
    assert _data(plain) == ROWS and plain[1].where == f"{tmp_path / 'plain'}[train]#1"
    assert _data(read_rows(str(tmp_path / "split"), "test")) == ROWS[3:]
    with pytest.raises(DataError, match="no split 'validation'; available: train, test"):
        read_rows(str(tmp_path / "split"), "validation")
    (tmp_path / "not-a-dataset").mkdir()
    with pytest.raises(DataError, match="not a saved HF dataset folder"):
        read_rows(str(tmp_path / "not-a-dataset"))


def test_hf_source(tmp_path):
    folder = tmp_path / "hub_like"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rows = read_rows(f"hf:{folder}")
    assert _data(rows) == ROWS and rows[0].where == f"hf:{folder}[train]#0"
    with pytest.raises(DataError, match="could not load split 'test'"):
        read_rows(f"hf:{folder}", "test")


def test_unsupported_file_type_names_the_accepted_ones(tmp_path):
    (tmp_path / "rows.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'; use .jsonl, .json, .parquet"):
        read_rows(str(tmp_path / "rows.csv"))
