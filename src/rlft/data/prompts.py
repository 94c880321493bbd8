"""Prompt datasets for online RL and evaluation: a `prompt` (text or messages) plus any fields the
reward functions read (e.g. `answer`, `tests`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlft.data.loading import Row
from rlft.data.validate import RowError, check_messages, require_field, require_fields
from rlft.models.template import Messages, as_messages, encode_prompt


@dataclass
class PromptExample:
    where: str
    messages: Messages
    prompt_ids: list[int]
    fields: dict[str, Any] = field(default_factory=dict)  # everything but the prompt, for rewards

    @property
    def prompt_text(self) -> str:
        return self.messages[-1]["content"]


def make_prompt_encoder(tokenizer: Any, max_prompt_length: int, required: tuple[str, ...] = ()):
    def encode(row: Row) -> PromptExample:
        data = row.data
        if "prompt" not in data and "messages" in data:
            messages = check_messages(require_field(data, "messages", list, "a prompt row"))
            if messages[-1]["role"] == "assistant":  # a chat row: prompt = everything before the answer
                messages = messages[:-1]
        else:
            prompt = require_field(data, "prompt", (str, list), "a prompt row")
            messages = check_messages(prompt, "prompt") if isinstance(prompt, list) else as_messages(prompt)
        require_fields(data, required, "the reward functions")
        try:
            ids = encode_prompt(tokenizer, messages)
        except Exception as exc:
            raise RowError("chat template failed", f"{type(exc).__name__}: {exc}") from None
        if len(ids) > max_prompt_length:
            raise RowError(f"prompt longer than data.max_prompt_length ({max_prompt_length} tokens)",
                           f"{len(ids)} tokens; raise data.max_prompt_length or shorten the prompt")
        # Rewards are called as fn(prompt, completion, **fields): a reference answer stored as
        # `completion` (SFT-style rows) is passed on as `reference_completion`.
        fields = {k: v for k, v in data.items() if k not in ("prompt", "messages", "completion")}
        if "completion" in data:
            fields["reference_completion"] = data["completion"]
        return PromptExample(row.where, messages, ids, fields)

    return encode
