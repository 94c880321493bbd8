"""Preference pairs for DPO and reward-model training.

A row is `{"prompt": str | messages, "chosen": str | messages, "rejected": str | messages,
"margin": float (optional)}`. An answer given as messages is a continuation of the prompt
(e.g. `[{"role": "assistant", "content": ...}]`) and must end with an assistant turn. `margin`
is read by reward-model training (Bradley-Terry margin); DPO ignores it.

Each side is tokenized exactly like an SFT row (`encode_sft` on prompt + answer), so the prompt
tokens are the ones the model sees at generation time and the targets are the answer's assistant
text plus its end-of-turn token. Assistant turns inside the prompt (earlier dialogue) are context,
not targets.

Pair-level checks that do not invalidate a row -- length imbalance, "chosen is longer" bias,
duplicate and contradictory pairs -- are measured once per dataset, logged as one
warning when they look wrong, and returned as numbers for summary.json.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rlft.config import DataConfig
from rlft.data.mixing import read_train_rows
from rlft.data.readers import DEFAULT_MAX_ROW_BYTES, Row, read_rows
from rlft.data.sft_examples import collate_sft, encode_sft
from rlft.data.validate import RowError, check_messages, check_rows, require_field
from rlft.models.template import Messages, as_messages, end_of_turn_ids

log = logging.getLogger(__name__)

LENGTH_GAP = 0.3  # a pair is "length-imbalanced" when the answers differ by more than 30% 
# Warn when more than this share of pairs is imbalanced, or when "chosen longer" and "rejected
# longer" shares differ by more than this.
IMBALANCED_SHARE_WARN = 0.2
LENGTH_BIAS_WARN = 0.3


@dataclass
class TokenSequence:
    input_ids: list[int]
    target_mask: list[int]  # 1 on the answer's tokens (what a log-prob is summed over)

    @property
    def answer_tokens(self) -> int:
        return sum(self.target_mask)


@dataclass
class PreferenceExample:
    where: str
    chosen: TokenSequence
    rejected: TokenSequence
    margin: float | None  # the row's own Bradley-Terry margin, if it has one
    # Reference log-probs, filled once before training when dpo.precompute_ref is on.
    ref_chosen_logp: float | None = None
    ref_rejected_logp: float | None = None
    source: str = ""  # its data.train source's name, when sources are mixed


def _answer_messages(data: dict[str, Any], name: str) -> Messages:
    value = require_field(data, name, (str, list), "a preference row")
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    messages = check_messages(value, name)
    if messages[-1]["role"] != "assistant":
        raise RowError(f"'{name}' does not end with an assistant turn",
                       f"the last message has role {messages[-1]['role']!r}; the answer to score must come last")
    if not messages[-1]["content"].strip():
        raise RowError(f"empty '{name}'")
    return messages


def _keep_last_turns(mask: list[int], turns: int) -> list[int]:
    """Zero every target run of `mask` except the last `turns` (the answer's own assistant turns)."""
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    if len(starts) <= turns:
        return mask
    cut = starts[-turns]
    return [0] * cut + mask[cut:]


def make_preference_encoder(tokenizer: Any, end_ids: list[int], max_length: int,
                            max_prompt_length: int | None = None) -> Callable[[Row], PreferenceExample]:
    def encode_side(prompt: Messages, answer: Messages) -> TokenSequence:
        try:
            ids, mask = encode_sft(tokenizer, prompt + answer, end_ids)
        except RowError:
            raise
        except Exception as exc:  # jinja errors from user templates
            raise RowError("chat template failed", f"{type(exc).__name__}: {exc}") from None
        mask = _keep_last_turns(mask, sum(m["role"] == "assistant" for m in answer))
        return TokenSequence(ids, mask)

    def encode(row: Row) -> PreferenceExample:
        data = row.data
        raw_prompt = require_field(data, "prompt", (str, list), "a preference row")
        prompt = check_messages(raw_prompt, "prompt") if isinstance(raw_prompt, list) else as_messages(raw_prompt)
        chosen_msgs = _answer_messages(data, "chosen")
        rejected_msgs = _answer_messages(data, "rejected")
        margin = data.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
            raise RowError("wrong type for 'margin'", f"expected a number, got {type(margin).__name__}")
        if margin is not None and not math.isfinite(margin):
            raise RowError("'margin' is not finite", f"got {margin}")
        if chosen_msgs == rejected_msgs:
            raise RowError("chosen and rejected are identical", "a pair must differ to say anything")
        chosen, rejected = encode_side(prompt, chosen_msgs), encode_side(prompt, rejected_msgs)
        if chosen.input_ids == rejected.input_ids:
            raise RowError("chosen and rejected are identical after templating")
        longest = max(len(chosen.input_ids), len(rejected.input_ids))
        if longest > max_length:
            raise RowError(f"longer than data.max_length ({max_length} tokens)",
                           f"chosen {len(chosen.input_ids)}, rejected {len(rejected.input_ids)} tokens; "
                           "raise data.max_length or shorten the row")
        for name, side in (("chosen", chosen), ("rejected", rejected)):
            if side.answer_tokens == 0:
                raise RowError(f"no answer tokens in '{name}' after templating")
        prompt_len = chosen.target_mask.index(1)
        if max_prompt_length is not None and prompt_len > max_prompt_length:
            raise RowError(f"prompt longer than data.max_prompt_length ({max_prompt_length} tokens)",
                           f"{prompt_len} tokens before the answer; raise data.max_prompt_length")
        return PreferenceExample(row.where, chosen, rejected, None if margin is None else float(margin))

    return encode


def collate_pairs(examples: list[PreferenceExample], pad_id: int) -> dict[str, torch.Tensor]:
    """One right-padded batch: rows [0, B) are the chosen answers, rows [B, 2B) the rejected ones,
    so both sides go through a single forward. input_ids, attention_mask, target_mask  # [2B, T]"""
    return collate_sft([e.chosen for e in examples] + [e.rejected for e in examples], pad_id)


def pair_statistics(examples: list[PreferenceExample], source: str) -> dict[str, float]:
    """Dataset-level checks of the pairs ; one warning if any looks wrong.

    - `length_imbalanced`: share of pairs whose answers differ in length by more than 30%
    - `chosen_longer` / `rejected_longer`: share of pairs whose chosen (rejected) answer is the
      longer one; a large gap means a model can learn "longer (shorter) is better" from this data
      instead of the intended preference
    - `duplicate_pairs`: pairs that repeat an earlier (prompt, chosen, rejected)
    - `contradictory_pairs`: pairs that are an earlier pair with chosen and rejected swapped
    """
    n = len(examples)
    imbalanced = longer = shorter = duplicates = flipped = 0
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for e in examples:
        lc, lr = e.chosen.answer_tokens, e.rejected.answer_tokens
        imbalanced += abs(lc - lr) > LENGTH_GAP * max(lc, lr)
        longer += lc > lr
        shorter += lc < lr
        key = (tuple(e.chosen.input_ids), tuple(e.rejected.input_ids))
        duplicates += key in seen
        flipped += key[::-1] in seen
        seen.add(key)
    stats = {"pairs": float(n), "length_imbalanced": imbalanced / n, "chosen_longer": longer / n,
             "rejected_longer": shorter / n, "duplicate_pairs": float(duplicates),
             "contradictory_pairs": float(flipped)}
    problems = []
    if stats["length_imbalanced"] > IMBALANCED_SHARE_WARN:
        problems.append(f"{stats['length_imbalanced']:.0%} of pairs differ in answer length by more than "
                        f"{LENGTH_GAP:.0%}")
    if abs(longer - shorter) / n > LENGTH_BIAS_WARN:
        side, other = ("chosen", "rejected") if longer > shorter else ("rejected", "chosen")
        problems.append(f"the {side} answer is longer in {max(longer, shorter) / n:.0%} of pairs and the {other} "
                        f"in {min(longer, shorter) / n:.0%} (length bias: a model can learn to prefer "
                        f"{'longer' if longer > shorter else 'shorter'} answers from this data)")
    if duplicates:
        problems.append(f"{duplicates} duplicate pairs")
    if flipped:
        problems.append(f"{flipped} pairs contradict an earlier pair (chosen and rejected swapped)")
    if problems:
        log.warning("%s: %d preference pairs: %s. Consider rebalancing or deduplicating (see summary.json "
                    "data/...).", source, n, "; ".join(problems))
    return stats


def read_pairs(source: str, split: str, tokenizer: Any, end_ids: list[int], max_length: int,
               max_prompt_length: int | None, on_invalid: str, kind: str, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
               ) -> tuple[list[PreferenceExample], dict[str, float]]:
    """Read, validate (one report for every bad row) and encode a preference dataset; also its
    pair statistics."""
    encode = make_preference_encoder(tokenizer, end_ids, max_length, max_prompt_length)
    examples = check_rows(read_rows(source, split, max_row_bytes), encode, source, kind, on_invalid)
    return examples, pair_statistics(examples, source)


def load_preference_splits(tokenizer: Any, data: DataConfig, seed: int = 0,
                           ) -> tuple[Any, list[PreferenceExample], dict[str, float]]:
    """A run's train and eval pairs (`data.train`, `data.eval`), validated and encoded, and their
    pair statistics as `data/train/...` and `data/eval/...` (for the run's summary)."""
    args = (tokenizer, end_of_turn_ids(tokenizer), data.max_length, data.max_prompt_length, data.on_invalid)
    summary: dict[str, float] = {}

    def read(path: str) -> list[PreferenceExample]:
        rows, stats = read_pairs(path, data.split, *args, kind="preference", max_row_bytes=data.max_row_bytes)
        part = "train" if isinstance(data.train, str) else f"train/{Path(path).stem}"
        summary.update({f"data/{part}/{k}": v for k, v in stats.items()})
        return rows

    train = read_train_rows(data, seed, read)
    evals: list[PreferenceExample] = []
    if data.eval:
        evals, eval_stats = read_pairs(data.eval, data.eval_split or data.split, *args, kind="preference eval",
                                       max_row_bytes=data.max_row_bytes)
        summary.update({f"data/eval/{k}": v for k, v in eval_stats.items()})
    return train, evals, summary
