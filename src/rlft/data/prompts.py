"""Prompt datasets for online RL and evaluation: a `prompt` (text or messages) plus any fields the
reward functions read (e.g. `answer`, `tests`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlft.data.readers import Row
from rlft.data.validate import RowError, check_messages, require_field, require_fields
from rlft.models.template import Messages, as_messages, encode_text, render


@dataclass
class PromptExample:
    where: str
    messages: Messages  # the conversation the model answers (system prompt and earlier turns included)
    prompt_ids: list[int]
    fields: dict[str, Any] = field(default_factory=dict)  # everything but the prompt, for rewards
    rendered: str = ""  # the prompt as the model saw it: `messages` through the chat template
    source: str = ""  # its data.train source's name, when sources are mixed

    @property
    def prompt_text(self) -> str:
        """The last message: what a reward's positional `prompt` argument receives."""
        return self.messages[-1]["content"]


def prompt_example(tokenizer: Any, where: str, messages: Messages, fields: dict[str, Any]) -> PromptExample:
    """Render the conversation with a generation header and tokenize it as the engine will see it."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return PromptExample(where, messages, encode_text(tokenizer, text), fields, text)


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
        require_fields(data, required, "a reward function")
        # Rewards are called as fn(prompt, completion, **fields): a reference answer stored as
        # `completion` (SFT-style rows) is passed on as `reference_completion`.
        fields = {k: v for k, v in data.items() if k not in ("prompt", "messages", "completion")}
        if "completion" in data:
            fields["reference_completion"] = data["completion"]
        try:
            example = prompt_example(tokenizer, row.where, messages, fields)
        except Exception as exc:
            raise RowError("chat template failed", f"{type(exc).__name__}: {exc}") from None
        if len(example.prompt_ids) > max_prompt_length:
            raise RowError(f"prompt longer than data.max_prompt_length ({max_prompt_length} tokens)",
                           f"{len(example.prompt_ids)} tokens; raise data.max_prompt_length or shorten the prompt")
        return example

    return encode
