"""Data mixing: exact proportions every epoch, seeded and interleaved, rows tagged by source."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from rlft.config import MixSource
from rlft.data.mixing import (epoch_counts, largest_remainder, mix_epoch, mix_sources, source_names,
                              source_rows)
from rlft.errors import ConfigError


def src(path, **kw) -> MixSource:
    return MixSource(path=path, **kw)


def test_largest_remainder_by_hand():
    # quotas 0.5*7 = 3.5, 0.3*7 = 2.1, 0.2*7 = 1.4 -> floors 3, 2, 1 (6); the spare row goes to the
    # largest remainder (0.5, source 0)
    assert largest_remainder([5, 3, 2], 7) == [4, 2, 1]
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]
    assert largest_remainder([2, 1], 0) == [0, 0]


def test_epoch_counts_fixed_rows_and_weights():
    sources = [src("a.jsonl", weight=3), src("b.jsonl", rows=10), src("c.jsonl", weight=1)]
    # 50 rows: 10 fixed for b, 40 split 3:1 -> 30 and 10
    assert epoch_counts(sources, 50) == [30, 10, 10]
    # default size: fixed rows + the weighted sources' rows (100 + 20)
    assert epoch_counts(sources, available=[100, 5, 20]) == [90, 10, 30]
    with pytest.raises(ConfigError, match="leaves nothing"):
        epoch_counts(sources, 10)


def test_proportions_are_exact_and_sources_interleaved():
    names, counts, sizes = ["math", "code", "chat"], [50, 30, 20], [1000, 1000, 1000]
    order = mix_epoch(names, counts, sizes, seed=0, epoch=0)
    assert Counter(item.source for item in order) == {"math": 50, "code": 30, "chat": 20}
    # every window of 10 rows holds each source within 2 of its share (5, 3, 2): no source blocks
    for start in range(0, 100, 10):
        window = Counter(item.source for item in order[start:start + 10])
        assert all(abs(window[n] - c // 10) <= 2 for n, c in zip(names, counts)), (start, window)
    longest_run = max(sum(1 for _ in group) for _, group in __import__("itertools").groupby(i.source for i in order))
    assert longest_run <= 4
    # without replacement: distinct rows within a source
    for name in names:
        rows = [i.index for i in order if i.source == name]
        assert len(set(rows)) == len(rows)


def test_determinism_and_seeds():
    args = (["a", "b"], [30, 30], [40, 100])
    assert mix_epoch(*args, seed=3, epoch=1) == mix_epoch(*args, seed=3, epoch=1)
    assert mix_epoch(*args, seed=3, epoch=1) != mix_epoch(*args, seed=4, epoch=1)
    assert mix_epoch(*args, seed=3, epoch=1) != mix_epoch(*args, seed=3, epoch=2)


def test_a_source_is_used_up_before_any_row_repeats():
    # 10 rows, 4 per epoch: epochs 0 and 1 are 8 distinct rows; epoch 2 uses the last 2, then a new pass
    seen = source_rows(10, 4, seed=0, epoch=0, salt=0) + source_rows(10, 4, seed=0, epoch=1, salt=0)
    assert len(set(seen)) == 8
    third = source_rows(10, 4, seed=0, epoch=2, salt=0)
    assert set(seen[:8]) | set(third[:2]) == set(range(10))


def test_upsampling_a_small_source_repeats_rows_evenly():
    rows = source_rows(3, 8, seed=0, epoch=0, salt=0)  # 8 = 2 full passes + 2 more distinct rows
    counts = Counter(rows)
    assert sorted(counts.values()) == [2, 3, 3] and set(counts) == {0, 1, 2}


def test_mix_sources_tags_rows():
    sources = [src("data/math.jsonl", weight=1), src("data/chat.jsonl", weight=1, name="dialogue")]
    rows = [[{"q": f"m{i}"} for i in range(4)], [{"q": f"c{i}"} for i in range(2)]]
    epoch = mix_sources(sources, rows, seed=0, epoch=0, epoch_size=6)
    assert Counter(name for name, _ in epoch) == {"math": 3, "dialogue": 3}
    # each tag names the source its row came from; the small source is upsampled (2 rows, 3 asked)
    assert all(row["q"][0] == ("m" if name == "math" else "c") for name, row in epoch)
    assert Counter(row["q"] for name, row in epoch if name == "dialogue").most_common(1)[0][1] == 2


def test_source_settings_are_checked():
    with pytest.raises(ValidationError, match="exactly one of 'weight' or 'rows'"):
        MixSource(path="a.jsonl", weight=1, rows=3)
    with pytest.raises(ValidationError, match="exactly one"):
        MixSource(path="a.jsonl")
    with pytest.raises(ConfigError, match="distinct 'name'"):
        source_names([src("x/a.jsonl", weight=1), src("y/a.jsonl", weight=1)])
    assert source_names([src("hf:org/data", weight=1)]) == ["data"]
