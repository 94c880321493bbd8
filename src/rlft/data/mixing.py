"""Data mixing: several training sources in stated proportions, exactly, every epoch.

Sources are `{path, weight}` (a share of the epoch) or `{path, rows}` (a fixed number of rows per
epoch), optionally with a `name` (default: the file's stem). Per epoch:

1. counts: fixed-row sources take their rows; weighted sources split the rest of the epoch by
   largest-remainder (Hamilton) rounding of weight x size, so the counts sum to the epoch size
   exactly and each is within one row of its exact share;
2. rows: a source with at least as many rows as its count gives distinct rows (a seeded
   permutation, continued across epochs so every row is used before any repeats); a smaller source
   is upsampled: each row appears floor(count / n) times and count mod n distinct rows once more
   (sampling with replacement, but with the repeats spread as evenly as possible);
3. order: sources are interleaved by jittered systematic positions -- item j of a source with
   count c sits at (j + u) / c, u uniform in [0, 1) -- so every stretch of the epoch holds each
   source in about its proportion (no source blocks), and seeded.

Every item keeps its source name, for per-source metrics. Pure functions over row counts; the
loader reads the files and maps the (source, row) pairs to rows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from rlft.config import MixSource
from rlft.data.order import epoch_order
from rlft.errors import ConfigError


@dataclass(frozen=True)
class MixItem:
    source: str  # the source's name
    index: int  # row index within that source


def source_names(sources: Sequence[MixSource]) -> list[str]:
    names = [s.name or Path(s.path.removeprefix("hf:")).stem for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"data.train: source names {dupes} repeat; give each source a distinct 'name'")
    return names


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Integer counts proportional to `weights` that sum to `total` (Hamilton's method); ties in the
    remainders go to the earlier source.

    >>> largest_remainder([1, 1, 1], 10)  # 3.33 each: the first source gets the spare row
    [4, 3, 3]
    """
    if total < 0 or not weights or any(w <= 0 for w in weights):
        raise ValueError(f"largest_remainder needs positive weights and total >= 0, got {list(weights)}, {total}")
    scale = sum(weights)
    quotas = [w * total / scale for w in weights]
    counts = [math.floor(q) for q in quotas]
    spare = total - sum(counts)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:spare]:
        counts[i] += 1
    return counts


def epoch_counts(sources: Sequence[MixSource], epoch_size: int | None = None,
                 available: Sequence[int] | None = None) -> list[int]:
    """Rows of each source in one epoch. `epoch_size` defaults to the fixed rows plus every weighted
    source's available rows (then one epoch reads each weighted row about once)."""
    fixed = sum(s.rows for s in sources if s.rows is not None)
    weighted = [i for i, s in enumerate(sources) if s.weight is not None]
    if epoch_size is None:
        if weighted and available is None:
            raise ValueError("epoch_counts: weighted sources need epoch_size or the sources' row counts")
        epoch_size = fixed + sum(available[i] for i in weighted) if weighted else fixed
    if epoch_size < fixed or (weighted and epoch_size == fixed):
        raise ConfigError(f"data: an epoch of {epoch_size} rows leaves nothing for the weighted sources after "
                          f"{fixed} fixed rows; raise the epoch size or lower the sources' 'rows'")
    counts = [s.rows or 0 for s in sources]
    if weighted:
        shares = largest_remainder([sources[i].weight for i in weighted], epoch_size - fixed)
        for i, c in zip(weighted, shares):
            counts[i] = c
    return counts


def source_rows(n: int, count: int, seed: int, epoch: int, salt: int) -> list[int]:
    """Row indices of one source for one epoch (see the module docstring, step 2)."""
    if n <= 0:
        raise ValueError("a data source has no rows")

    def permutation(k: int) -> list[int]:
        order = list(range(n))
        random.Random(f"{seed}/{salt}/{k}").shuffle(order)
        return order

    if count <= n:
        # one long stream of permutations, cut into epochs: no row repeats before all were used
        start = epoch * count
        out: list[int] = []
        while len(out) < count:
            k, offset = divmod(start + len(out), n)
            out += permutation(k)[offset: offset + count - len(out)]
        return out
    full, rest = divmod(count, n)
    return list(range(n)) * full + permutation(epoch)[:rest]


def mix_epoch(names: Sequence[str], counts: Sequence[int], sizes: Sequence[int], seed: int,
              epoch: int) -> list[MixItem]:
    """The interleaved order of one epoch: `counts[i]` rows of source i (with `sizes[i]` rows)."""
    if not len(names) == len(counts) == len(sizes):
        raise ValueError("mix_epoch: names, counts and sizes must have one entry per source")
    rng = random.Random(f"{seed}/mix/{epoch}")
    keyed: list[tuple[float, int, MixItem]] = []
    for i, (name, count, n) in enumerate(zip(names, counts, sizes)):
        rows = source_rows(n, count, seed, epoch, i)
        rng_rows = random.Random(f"{seed}/{i}/{epoch}/order")
        rng_rows.shuffle(rows)  # upsampled repeats must not sit next to each other
        for j, row in enumerate(rows):
            keyed.append(((j + rng.random()) / count, i, MixItem(name, row)))
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [item for _, _, item in keyed]


def mix_sources(sources: Sequence[MixSource], rows_by_source: Sequence[Sequence[Any]], seed: int, epoch: int,
                epoch_size: int | None = None) -> list[tuple[str, Any]]:
    """One epoch of (source name, row) pairs from rows already read per source."""
    names = source_names(sources)
    sizes = [len(r) for r in rows_by_source]
    for name, n in zip(names, sizes):
        if n == 0:
            raise ConfigError(f"data.train: source '{name}' has no rows")
    counts = epoch_counts(sources, epoch_size, sizes)
    lookup = dict(zip(names, rows_by_source))
    return [(item.source, lookup[item.source][item.index]) for item in mix_epoch(names, counts, sizes, seed, epoch)]


@dataclass
class TrainRows:
    """A run's training rows: `data.train` as one source, or several mixed. `examples` holds every
    source's rows one source after another; `order(epoch)` indexes into it."""

    examples: list[Any]
    names: list[str]  # one per source
    starts: list[int]  # index of each source's first row in `examples`
    counts: list[int]  # rows of each source per epoch
    seed: int
    shuffle: bool = True

    @property
    def mixed(self) -> bool:
        return len(self.names) > 1

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.starts, self.starts[1:] + [len(self.examples)])]

    def __len__(self) -> int:
        """Rows per epoch."""
        return sum(self.counts)

    def order(self, epoch: int) -> list[int]:
        """The epoch's rows, as indices into `examples`; a pure function of (seed, epoch)."""
        if not self.mixed:
            return epoch_order(len(self.examples), self.seed, epoch, self.shuffle)
        start = dict(zip(self.names, self.starts))
        return [start[item.source] + item.index
                for item in mix_epoch(self.names, self.counts, self.sizes, self.seed, epoch)]


def read_train_rows(data: Any, seed: int, read: Callable[[str], list[Any]]) -> TrainRows:
    """`data.train` (a DataConfig's) read source by source with `read(path)` (which validates as the
    method does and names the file in its errors); each example of a mixed run is tagged with its
    source's name (its `source` attribute) for per-source metrics."""
    if isinstance(data.train, str):
        examples = read(data.train)
        return TrainRows(examples, [Path(data.train).stem], [0], [len(examples)], seed, data.shuffle)
    names = source_names(data.train)
    parts = []
    for name, source in zip(names, data.train):
        rows = read(source.path)
        if not rows:
            raise ConfigError(f"data.train: source '{name}' ({source.path}) has no usable rows")
        parts.append([replace(e, source=name) if hasattr(e, "source") else e for e in rows])
    sizes = [len(p) for p in parts]
    counts = epoch_counts(data.train, data.mix_epoch_size, sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return TrainRows([e for p in parts for e in p], names, starts, counts, seed, data.shuffle)
