"""What the run reads: `data` and its mixture sources."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlft import paths
from rlft.config.section import Section, _local


class MixSource(Section):
    """One source of a mixed `data.train`: its path and exactly one of `weight` (its share of every epoch,
    relative to the other weights) or `rows` (an exact count per epoch); `name` labels its per-source metrics.
    See guides/config-and-data.md#mixing-sources."""

    path: str = Field(description="Data file or dataset (as data.train).")
    name: str | None = Field(None, description="Name in per-source metrics (default: the file's stem).")
    weight: float | None = Field(None, gt=0, description="Share of each epoch, relative to the other weights.")
    rows: int | None = Field(None, ge=1, description="Exact rows of this source per epoch.")

    @field_validator("path")
    @classmethod
    def _data_location(cls, value: str) -> str:
        return paths.data_location(_local(value, "data.train[].path"))

    @model_validator(mode="after")
    def _one_of(self) -> "MixSource":
        if (self.weight is None) == (self.rows is None):
            raise ValueError(f"data source {self.path!r}: give exactly one of 'weight' or 'rows'")
        return self


class DataConfig(Section):
    """What a run trains and evaluates on: the training data (one source, or several mixed in set
    proportions), optional held-out data, token-length limits, shuffling, and what happens to invalid rows.
    Every method needs `data.train`; the row format it expects depends on the method. See
    guides/config-and-data.md#data-formats."""

    train: str | list[MixSource] = Field(
        description="Training data: a .jsonl/.json/.parquet file, a saved HF dataset folder, 'hf:NAME', or "
                    "'reasoning_gym:TASK?size=N&eval_size=M&seed=S&SETTING=VALUE' (generated tasks); or a list of "
                    "sources mixed in set proportions: [{path, weight}] or [{path, rows}] (optional name).")
    mix_epoch_size: int | None = Field(
        None, ge=1, description="Mixed sources: rows per epoch (default: the fixed 'rows' plus every weighted "
                                "source's own size).")
    eval: str | None = Field(None, description="Held-out data in the same format; used for eval loss / accuracy.")
    split: str = Field("train", description="Split to read from an HF dataset given as 'hf:NAME'.")
    eval_split: str | None = Field(None, description="Split for `eval` when it is 'hf:NAME' (a 'reasoning_gym:' eval: "
                                                     "'test', its held-out rows, unless set).")
    max_prompt_length: int = Field(512, ge=1, description="Longest prompt in tokens; longer rows are reported.")
    max_length: int = Field(1024, ge=2, description="Longest prompt+answer in tokens for offline methods.")
    shuffle: bool = Field(True, description="Shuffle training rows each epoch (seeded).")
    on_invalid: Literal["error", "drop"] = Field(
        "error", description="Invalid rows: stop with a report (error) or drop them with the same report (drop).")
    max_row_bytes: int = Field(
        8 << 20, ge=1, description="Rows larger than this (bytes of the JSON line, or of a row's text) are invalid "
                                   "rows, rejected before they are parsed or tokenized (a 50 MB line would take "
                                   "minutes and gigabytes). 8 MiB leaves room for large test suites of code tasks.")

    @field_validator("train", "eval")
    @classmethod
    def _data_location(cls, value: Any, info: Any) -> Any:
        if not isinstance(value, str):
            return value  # a list of sources: each MixSource resolves its own path
        return paths.data_location(_local(value, f"data.{info.field_name}"))

    @model_validator(mode="after")
    def _held_out_generated_rows(self) -> "DataConfig":
        # the same generator location on both sides must not evaluate on the training questions
        if self.eval and self.eval.startswith("reasoning_gym:") and self.eval_split is None:
            self.eval_split = "test"
        return self
