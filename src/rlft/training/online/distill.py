"""The teacher of on-policy distillation (method: distill): a frozen model that scores the
student's own samples token by token (the advantages are in algorithms/advantages.py,
`reverse_kl_advantages`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from rlft.config import Config, LoraConfig
from rlft.errors import ConfigError
from rlft.models.loading import LoadedModel, load_policy


class Teacher:
    """Frozen, in eval mode; `model()` is the context `reference_logprobs` takes, as a Reference's."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        loaded.model.eval().requires_grad_(False)

    @property
    def frozen_copy(self) -> Any:
        return self.loaded.model

    @contextmanager
    def model(self) -> Iterator[Any]:
        yield self.loaded.model


def load_teacher(config: Config, student_tokenizer: Any, dtype: torch.dtype | None) -> Teacher:
    """The teacher at teacher.path on the student's device, checked to read token ids as the
    student does: it scores the student's ids, never re-tokenised text."""
    assert config.teacher is not None
    cfg = config.model.model_copy(update={"path": config.teacher.path, "tokenizer_path": None,
                                          "chat_template": None, "gradient_checkpointing": False})
    loaded = load_policy(cfg, LoraConfig(), dtype, field="teacher.path")
    check_same_vocabulary(student_tokenizer, loaded.tokenizer, config.model.path, config.teacher.path)
    return Teacher(loaded)


def check_same_vocabulary(student: Any, teacher: Any, student_path: str, teacher_path: str) -> None:
    """Every token id must mean the same string to both tokenizers."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
    token, index = differ[0]
    owner = "student" if ours.get(token) == index else "teacher"
    raise ConfigError(
        f"teacher: {teacher_path} has another vocabulary than the student {student_path} ({len(ours)} vs "
        f"{len(theirs)} tokens; {len(differ)} (token, id) pairs differ, e.g. {token!r} -> {index} only in the "
        f"{owner}'s). The teacher scores the student's token ids, so both must share one tokenizer: pick a "
        "teacher of the same model family (e.g. a larger Qwen2.5 for a Qwen2.5 student)")
