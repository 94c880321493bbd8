"""The `reward_model` reward: a sequence-classification model's score of prompt + completion.

- Rendering: with the tokenizer's chat template, the conversation that was answered (`messages`:
  system prompt and earlier turns included, as the trainer passes them; else [user: prompt])
  plus [assistant: completion], rendered as the RM saw its training pairs; without a template,
  the text of the conversation + completion (and the tokenizer adds its own special tokens).
- Batched: `fn.batch` scores `batch_size` samples per forward pass (the scorer calls it once per
  step instead of once per sample). Truncation keeps the *end* of long inputs: the score is read
  at the last token, so the completion must survive.
- Length normalisation (optional, `length_coef` > 0): reward models favour longer answers
  (Singhal et al., arXiv:2310.03716), so the score becomes `score - length_coef * ln(1 + completion tokens)`. A log keeps
  doubling the length equally costly at any length, and a subtraction, unlike a division, cannot
  make a long bad answer (negative score) look better than a short one.
- `clip` bounds the result to [-clip, clip] (rewards in a fixed range).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

from rlft.errors import RlftError
from rlft.models.folder_checks import (check_model_folder, check_reward_model_architecture, check_reward_model_weights,
                                       saved_architectures)
from rlft.models.hub import hub_source
from rlft.models.template import as_messages
from rlft.rewards.scoring import RewardFn, arg_field, register_reward

_ROUND_TRIP_PROBE = "a  b\n\tc 12 + 3 = 15"


def _load(path: str, device: str, dtype: str, field: str):
    """`field`: the config field `path` came from (`rewards[0].args.path`), named in errors."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerFast

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise RlftError(f"reward_model: dtype must be one of {sorted(dtypes)}, got {dtype!r}")

    check_model_folder(path, field)  # a local path that is not there: "no such folder", never a hub-id error
    source = hub_source(path, None, field)
    check_reward_model_architecture(saved_architectures(source), path, field)  # before its weights load
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model, info = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtypes[dtype],
                                                                         output_loading_info=True)
    except (OSError, ValueError) as exc:
        raise RlftError(f"{field} {path!r}: cannot load a sequence-classification model: {exc}") from None
    check_reward_model_weights(model, info, path, field)
    ids = tokenizer(_ROUND_TRIP_PROBE, add_special_tokens=False)["input_ids"]
    if tokenizer.decode(ids) != _ROUND_TRIP_PROBE:  # see rlft.models.loading.load_tokenizer
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
        except (OSError, ValueError):
            pass
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # the head finds the last real token through it
        model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.truncation_side = "left"
    return model.to(device).eval(), tokenizer


def render(tokenizer: Any, prompt: Any, completion: str) -> tuple[str, bool]:
    """(text, uses_template). A prompt may be a string or a list of chat messages."""
    if getattr(tokenizer, "chat_template", None):
        messages = as_messages(prompt) + [{"role": "assistant", "content": completion}]
        return tokenizer.apply_chat_template(messages, tokenize=False), True
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return text + completion, False


def raw_scorer(path: str, batch_size: int = 8, max_length: int = 2048, device: str = "cpu", dtype: str = "fp32",
               label: int = 0, field: str = "args.path",
               ) -> tuple[Callable[[list[Any], list[str], list[dict[str, Any]]], list[float]], Any]:
    """(batch(prompts, completions, rows) -> the model's logit `label` per sample, its tokenizer).
    `field`: the config field `path` came from, named in errors (`rewards[0].args.paths[1]`)."""
    import torch

    if batch_size < 1:
        raise RlftError(f"reward_model: batch_size must be >= 1, got {batch_size}")
    model, tokenizer = _load(path, device, dtype, field)
    if not 0 <= label < model.config.num_labels:
        raise RlftError(f"reward_model: label {label} out of range; {path} has {model.config.num_labels} labels")
    lock = threading.Lock()  # one forward at a time if called per sample from the scorer's threads

    def batch(prompts: list[Any], completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(completions), batch_size):
            # the whole conversation when the trainer passes it (system prompt and earlier turns are
            # what a reward model trained on conversations scores), else the prompt alone
            chunk = [render(tokenizer, r.get("messages") or p, c) for p, c, r in
                     zip(prompts[start:start + batch_size], completions[start:start + batch_size],
                         rows[start:start + batch_size])]
            # Every rendered text in a chunk has the same template state, so one flag suffices.
            enc = tokenizer([t for t, _ in chunk], add_special_tokens=not chunk[0][1], padding=True,
                            truncation=True, max_length=max_length, return_tensors="pt").to(device)
            with lock, torch.no_grad():
                logits = model(**enc).logits  # (B, num_labels)
            scores += logits[:, label].float().tolist()
        return scores

    return batch, tokenizer


def shape_score(score: float, completion_tokens: int, length_coef: float, clip: float | None) -> float:
    """Length normalisation and clipping (see the module docstring).

    >>> round(shape_score(1.0, 6, 0.5, None), 4)  # 1 - 0.5 * ln(7)
    0.027
    >>> shape_score(5.0, 0, 0.0, 2.0)
    2.0
    """
    if length_coef:
        score -= length_coef * math.log1p(completion_tokens)
    if clip is not None:
        score = max(-clip, min(clip, score))
    return score


@register_reward("reward_model")
def reward_model(path: str, batch_size: int = 8, max_length: int = 2048, device: str = "cpu",
                 dtype: str = "fp32", label: int = 0, length_coef: float = 0.0,
                 clip: float | None = None) -> RewardFn:
    """Score with a sequence-classification reward model at `path` (logit `label`)."""
    raw, tokenizer = raw_scorer(path, batch_size, max_length, device, dtype, label, field=arg_field("path"))

    def batch(prompts: list[Any], completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        scores = raw(prompts, completions, rows)
        # counted in the reward model's own tokens (an ensemble counts the policy's: one count for all members)
        lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) if length_coef else 0 for c in completions]
        return [shape_score(s, n, length_coef, clip) for s, n in zip(scores, lengths)]

    def reward(prompt: Any, completion: str, **row: Any) -> float:
        return batch([prompt], [completion], [row])[0]

    reward.batch = batch
    return reward
