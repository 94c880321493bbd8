"""Chat templates: rendering, tokenizing without double specials, and the template fingerprint.

The template used in RL must be exactly the one used in SFT: one extra newline before the
assistant turn is a different prompt to the model, and its KL to the SFT reference explodes. Every checkpoint and export carries a rendering of a
fixed probe conversation; a run that starts from it renders the probe again and stops on any
difference, showing the first differing characters.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from rlft.errors import RlftError, TemplateMismatchError

TEMPLATE_RECORD = "rlft_template.json"

PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 4 * 6?\nShow the steps."},
]

Messages = list[dict[str, Any]]


def set_chat_template(tokenizer: Any, template: str | None) -> None:
    """Install a template override: inline Jinja, or a path to a file holding it."""
    if template is None:
        if not getattr(tokenizer, "chat_template", None):
            raise RlftError(
                "the tokenizer has no chat template; set model.chat_template to a Jinja template "
                "(inline or a .jinja file), e.g. the ChatML one written by `rlft tiny-model`")
        return
    candidate = Path(template)
    # Jinja without any "{" renders one constant text for every conversation, so such a value is
    # a file path whatever its suffix; installing it as the template would train on that constant.
    if "{" not in template:
        if candidate.is_dir():
            raise RlftError(f"model.chat_template: {candidate} is a folder; give the template file (e.g. "
                            f"{str(candidate / 'chat_template.jinja')!r}) or inline Jinja")
        if not candidate.is_file():
            raise RlftError(f"model.chat_template: file not found: {candidate}")
        template = candidate.read_text()
    tokenizer.chat_template = template


def render(tokenizer: Any, messages: Messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenize already-rendered text. The template already placed BOS and friends, so the
    tokenizer must not add them again (a Llama post-processor would prepend a second BOS)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer: Any, messages: Messages) -> list[int]:
    return encode_text(tokenizer, render(tokenizer, messages, add_generation_prompt=True))


def as_messages(prompt: str | Messages) -> Messages:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Token ids that end an assistant turn: EOS plus the special token the template puts right
    after the assistant's text (e.g. `<|im_end|>`). A random model emits special tokens anywhere,
    so generation must stop on these, not on any special token."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    marker = "\x00END\x00"
    msgs = PROBE_CONVERSATION[:2] + [{"role": "assistant", "content": marker}]
    try:
        text = render(tokenizer, msgs)
    except Exception:  # templates that refuse a trailing assistant turn: EOS alone
        return ids
    tail = text.split(marker, 1)[-1]
    tail_ids = encode_text(tokenizer, tail)
    special = set(tokenizer.all_special_ids)
    if tail_ids and tail_ids[0] in special and tail_ids[0] not in ids:
        ids.append(tail_ids[0])
    return ids


# Text that is meant as a special token: `<|eot_id|>`, `<|im_end|>`, `</s>`, `<end_of_turn>`, `[/INST]`.
_MARKER = re.compile(r"<\|[^|<>\s]+\|>|</?[A-Za-z_][\w.-]*>|\[/?[A-Z_]+\]")


def check_end_of_turn(tokenizer: Any) -> None:
    """The marker the template puts after an assistant's text must be one special token of this
    tokenizer. A template from another family (Llama-3's `<|eot_id|>` on a ChatML tokenizer)
    renders it as ordinary text: SFT then teaches the model to spell out `<`, `|`, `eot`... and
    generation never stops on it, with no error anywhere. A template whose turns end without a
    marker (EOS ends them) is not judged here."""
    marker = "\x00END\x00"
    msgs = PROBE_CONVERSATION[:2] + [{"role": "assistant", "content": marker}]
    try:
        text = render(tokenizer, msgs)
    except Exception:  # templates that refuse a trailing assistant turn: nothing to check
        return
    found = _MARKER.match(text.split(marker, 1)[-1].lstrip())
    if found is None:
        return
    ids = encode_text(tokenizer, found.group())
    known = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    if len(ids) == 1 and ids[0] in known:
        return
    own = tokenizer.eos_token or "its EOS token"
    raise RlftError(
        f"the chat template ends an assistant turn with {found.group()!r}, which is not a token of this tokenizer "
        f"(it becomes {len(ids)} ordinary tokens): SFT would teach the model to spell it out and generation would "
        f"never stop on it. The template is from another model family.\nFix: set model.chat_template to a template "
        f"made for this tokenizer (its turns end with {own!r}), or drop model.chat_template to use the tokenizer's own")


def template_record(tokenizer: Any) -> dict[str, str]:
    probe = render(tokenizer, PROBE_CONVERSATION, add_generation_prompt=True)
    return {"sha256": hashlib.sha256(probe.encode()).hexdigest(), "probe": probe}


def write_template_record(directory: str | Path, tokenizer: Any) -> None:
    path = Path(directory) / TEMPLATE_RECORD
    path.write_text(json.dumps(template_record(tokenizer), indent=2))


def check_template(directory: str | Path, tokenizer: Any, allow_change: bool = False) -> bool:
    """Compare the tokenizer's rendering with the record in `directory` (if any).

    Returns True when a record was found and matches; raises TemplateMismatchError on a difference.
    """
    path = Path(directory) / TEMPLATE_RECORD
    if not path.is_file():
        return False
    saved = json.loads(path.read_text())
    now = template_record(tokenizer)
    if saved["sha256"] == now["sha256"] or allow_change:
        return saved["sha256"] == now["sha256"]
    raise TemplateMismatchError(
        f"chat template mismatch: {directory} was trained with a chat template that renders "
        f"differently from the one this run uses.\n{first_difference(saved['probe'], now['probe'])}\n"
        "Fix: use the checkpoint's own template (drop model.chat_template / model.tokenizer_path), "
        "or set model.allow_template_change=true if the change is intended.")


def first_difference(expected: str, actual: str, context: int = 24) -> str:
    i = 0
    while i < min(len(expected), len(actual)) and expected[i] == actual[i]:
        i += 1
    lo = max(0, i - context)
    return (f"  first difference at character {i}:\n"
            f"    checkpoint: {expected[lo:i + context]!r}\n"
            f"    this run:   {actual[lo:i + context]!r}")
