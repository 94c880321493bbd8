"""SFT examples: chat (`messages`) or `prompt`/`completion` rows, rendered with the chat template,
with the loss on assistant tokens only. Rows with tool calls and tool results (and every row, when
the run has an `agent` section) are encoded as rollouts build episodes: data/tool_transcripts.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlft.data.readers import Row
from rlft.data.tool_transcripts import NO_AGENT_FIX, TranscriptEncoder, check_tool_messages, has_tool_parts
from rlft.data.validate import RowError, check_messages, require_field, require_fields
from rlft.models.template import Messages, as_messages, encode_text, render


@dataclass
class SftExample:
    where: str
    input_ids: list[int]
    target_mask: list[int]  # 1 where the token is a training target (assistant text + end of turn)
    prompt_messages: Messages  # conversation up to the last assistant turn (for generation evals)
    reference: str  # the last assistant message (for format / accuracy evals)
    fields: dict[str, Any]  # the row's other fields (e.g. `answer`), for reward-based evals
    source: str = ""  # its data.train source's name, when sources are mixed
    # the last turn's context as trained, when it is not `prompt_messages` through the template
    # (tool transcripts: tools presented, calls written in, observations encoded as in rollouts)
    prompt_ids: list[int] | None = None


def row_messages(data: dict[str, Any]) -> Messages:
    """The conversation of an SFT row, from `messages` or from `prompt` + `completion`."""
    if "messages" in data:
        messages = check_messages(check_tool_messages(require_field(data, "messages", list, "a chat row")))
        if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
            raise RowError("no assistant message", "the loss is on assistant turns; add one")
        return messages
    if "prompt" not in data and "completion" not in data:
        raise RowError("missing field 'messages' or 'prompt'/'completion'",
                       f"row has keys {sorted(data)[:6]}")
    prompt = require_field(data, "prompt", (str, list), "a prompt/completion row")
    completion = require_field(data, "completion", str, "a prompt/completion row")
    prompt_messages = (check_messages(check_tool_messages(prompt), "prompt") if isinstance(prompt, list)
                       else as_messages(prompt))
    return prompt_messages + [{"role": "assistant", "content": completion}]


def encode_sft(tokenizer: Any, messages: Messages, end_ids: list[int]) -> tuple[list[int], list[int]]:
    """Token ids and target mask for a conversation.

    Each assistant turn is the text the template adds between "prompt with generation header" and
    "prompt + this turn". Pieces are tokenized separately so the prompt tokens are exactly the
    ones the model sees at generation time; inside an assistant piece, tokens after the first
    end-of-turn token (e.g. the newline after `<|im_end|>`) are template scaffolding, not targets.
    """
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        full = render(tokenizer, messages[: i + 1])
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise RowError("chat template is not prefix-stable",
                           "rendering a longer conversation changed earlier text; check the template")
        context = encode_text(tokenizer, prefix[len(done):])
        answer = encode_text(tokenizer, full[len(prefix):])
        target = [1] * len(answer)
        for j, tok in enumerate(answer):
            if tok in end_ids:
                target = [1] * (j + 1) + [0] * (len(answer) - j - 1)
                break
        ids += context + answer
        mask += [0] * len(context) + target
        done = full
    return ids, mask


def make_sft_encoder(tokenizer: Any, end_ids: list[int], max_length: int, max_prompt_length: int | None = None,
                     required: tuple[str, ...] = (), transcripts: TranscriptEncoder | None = None):
    """Rows -> SftExample; `required` fields must be present too (what eval rewards read).
    `transcripts`: the run's tools and call syntax (an `agent` section); every row is then encoded
    as a rollout episode of it, tools presented in the prompt."""

    def encode(row: Row) -> SftExample:
        messages = row_messages(row.data)
        require_fields(row.data, required, "the reward functions")
        ids, mask, context, reference = _encode(tokenizer, messages, end_ids, transcripts)
        if len(ids) > max_length:
            raise RowError(f"longer than data.max_length ({max_length} tokens)",
                           f"{len(ids)} tokens; raise data.max_length or shorten the row")
        if sum(mask) == 0:
            raise RowError("no assistant tokens after templating")
        prompt_len = mask.index(1)
        if max_prompt_length is not None and prompt_len > max_prompt_length:
            raise RowError(f"prompt longer than data.max_prompt_length ({max_prompt_length} tokens)",
                           f"{prompt_len} tokens before the first answer; raise data.max_prompt_length")
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        fields = {k: v for k, v in row.data.items() if k not in ("messages", "prompt", "completion")}
        return SftExample(row.where, ids, mask, messages[:last], reference, fields, prompt_ids=context)

    return encode


def _encode(tokenizer: Any, messages: Messages, end_ids: list[int],
            transcripts: TranscriptEncoder | None) -> tuple[list[int], list[int], list[int] | None, str]:
    """Ids, target mask, the last turn's context ids (None: the template's rendering) and text."""
    try:
        if transcripts is not None:
            t = transcripts.encode(messages)
            return t.input_ids, t.target_mask, t.input_ids[:t.last_turn_start], t.last_text
        if has_tool_parts(messages):  # most templates would drop the calls or misrender the results
            raise RowError("tool calls or tool messages, but no agent section", NO_AGENT_FIX)
        ids, mask = encode_sft(tokenizer, messages, end_ids)
    except RowError:
        raise
    except Exception as exc:  # jinja errors from user templates
        raise RowError("chat template failed", f"{type(exc).__name__}: {exc}") from None
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return ids, mask, None, messages[last]["content"]


def collate_sft(examples: list[SftExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids, attention_mask, target_mask  # [B, T]"""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    target_mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        attention_mask[i, :n] = 1
        target_mask[i, :n] = torch.tensor(e.target_mask, dtype=torch.bool)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "target_mask": target_mask}
