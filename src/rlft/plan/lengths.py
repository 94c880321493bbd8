"""The sequence lengths a run will really have, read from its training data, for the memory planner.

The config's limits (`data.max_prompt_length`, `data.max_length`) are ceilings, often far above
the data: a 512-token prompt limit over ~30-token prompts made the planner count 17x the
activations and KV cache. Here the rows go through the same encoders training uses (the chat
template, then the tokenizer), and the longest one sets the plan's length: every padded batch is at
most that long. Online methods add `rollout.max_new_tokens` (the completions' worst case: the
sampler may run to the limit). A row the encoder rejects (too long, malformed) is skipped: loading
reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlft.config import Config
from rlft.data.pairs import make_preference_encoder
from rlft.data.prompts import make_prompt_encoder
from rlft.data.readers import read_rows
from rlft.data.sft_examples import make_sft_encoder
from rlft.data.tool_transcripts import tool_transcripts
from rlft.models.loading import load_tokenizer
from rlft.models.template import end_of_turn_ids

SCAN_ROWS = 20_000  # rows tokenized per source: ~1-2 s with a fast tokenizer; bigger files are sampled evenly


@dataclass(frozen=True)
class DataLengths:
    """The longest templated rows in the scanned data, each length on its own: the whole `sequence`
    (online: the prompt + max_new_tokens), its `targets` (answer tokens) and the `prompt`."""

    sequence: int
    targets: int
    prompt: int
    scanned: int  # rows tokenized
    total: int  # rows in the sources
    sources: tuple[str, ...]

    def describe(self, config: Config) -> str:
        sampled = f"{self.scanned} of {self.total} rows" if self.scanned < self.total else f"all {self.total} rows"
        where = ", ".join(Path(s).name for s in self.sources)
        if config.is_online:
            return (f"lengths from the data: longest templated prompt {self.prompt} tokens ({sampled} of {where}) "
                    f"+ rollout.max_new_tokens {config.rollout.max_new_tokens} = {self.sequence} tokens per "
                    f"sequence (worst case, --worst-case: data.max_prompt_length {config.data.max_prompt_length} "
                    f"+ {config.rollout.max_new_tokens})")
        return (f"lengths from the data: longest templated row {self.sequence} tokens, {self.targets} of them "
                f"answer tokens ({sampled} of {where}; worst case, --worst-case: data.max_length "
                f"{config.data.max_length})")


def worst_case_note(config: Config) -> str:
    if config.is_online:
        return (f"lengths: worst case, data.max_prompt_length {config.data.max_prompt_length} + "
                f"rollout.max_new_tokens {config.rollout.max_new_tokens} tokens per sequence")
    return f"lengths: worst case, data.max_length {config.data.max_length} tokens per row, all of them targets"


def _sources(config: Config) -> list[str]:
    train = config.data.train
    return [train] if isinstance(train, str) else [s.path for s in train]


def _encoder(config: Config, tokenizer: Any):
    """(encode(row) -> (sequence, targets, prompt)) with the encoder the run's loader uses."""
    d = config.data
    if config.is_online:
        encode_prompt = make_prompt_encoder(tokenizer, d.max_prompt_length)

        def online(row: Any) -> tuple[int, int, int]:
            n = len(encode_prompt(row).prompt_ids)
            return n + config.rollout.max_new_tokens, config.rollout.max_new_tokens, n
        return online
    end_ids = end_of_turn_ids(tokenizer)
    if config.method == "sft":
        transcripts = tool_transcripts(config.agent, tokenizer) if config.agent else None
        encode_sft = make_sft_encoder(tokenizer, end_ids, d.max_length, transcripts=transcripts)

        def sft(row: Any) -> tuple[int, int, int]:
            e = encode_sft(row)
            return len(e.input_ids), sum(e.target_mask), e.target_mask.index(1)
        return sft

    encode_pair = make_preference_encoder(tokenizer, end_ids, d.max_length)

    def pair(row: Any) -> tuple[int, int, int]:
        e = encode_pair(row)
        sides = (e.chosen, e.rejected)
        return (max(len(s.input_ids) for s in sides), max(s.answer_tokens for s in sides),
                e.chosen.target_mask.index(1))
    return pair


def data_lengths(config: Config, limit: int = SCAN_ROWS) -> DataLengths | None:
    """The longest row of `data.train` as training will encode it, or None when the data or the
    tokenizer cannot be read here (a hub dataset offline, a missing file): plan the worst case then."""

    try:
        tokenizer = load_tokenizer(config.model)
        encode = _encoder(config, tokenizer)
        longest, scanned, total = (0, 0, 0), 0, 0
        for source in _sources(config):
            rows = read_rows(source, config.data.split, config.data.max_row_bytes, config.agent)
            total += len(rows)
            step = max(1, -(-len(rows) // limit))  # every step-th row: at most `limit` per source
            for row in rows[::step]:
                scanned += 1
                try:
                    lengths = encode(row)
                except Exception:  # an invalid row: the loader reports it
                    continue
                longest = tuple(max(a, b) for a, b in zip(longest, lengths))
    except Exception:
        return None
    if longest[0] == 0:
        return None
    return DataLengths(*longest, scanned=scanned, total=total, sources=tuple(_sources(config)))
