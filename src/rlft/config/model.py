"""The policy and the models beside it: `model`, `lora`, `teacher`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rlft import paths
from rlft.config.section import Section, _local, check_device


class ModelConfig(Section):
    """The policy every method trains: where its weights come from (a local folder, a hub id, a previous run's
    `final/` or a .gguf file), its tokenizer and chat template, and how it is loaded (dtype, device, attention,
    4-bit quantization, gradient checkpointing). `model.path` is required; the rest matters when the model is
    not a plain local checkpoint or does not fit. See getting-started/your-model.md."""

    path: str = Field(description="Local folder or Hugging Face hub id of a causal LM (or a previous run's `final/`), "
                                  "or a .gguf file (llama.cpp format; needs `pip install 'rlft[gguf]'`).")
    gguf_file: str | None = Field(
        None, description="Name of a .gguf file inside the folder `path`. A GGUF loads dequantized (~30 s for 135M "
                          "parameters); `rlft import-model` turns it into a normal folder once.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) when `path` is a hub id.")
    tokenizer_path: str | None = Field(None, description="Tokenizer location when it differs from `path`.")
    chat_template: str | None = Field(
        None, description="Jinja chat template (inline, or a path to a .jinja file) replacing the tokenizer's own.")
    allow_template_change: bool = Field(
        False, description="Start from a checkpoint even if its chat template renders differently (not advised).")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Weight dtype; 'auto' follows training.precision (bf16 for 'bf16', else fp32). "
                            "bf16 here with training.precision auto means pure bf16 training.")
    device: str = Field("auto", description="'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint folder or hub repo.")
    attn_implementation: str | None = Field(None, description="e.g. 'sdpa', 'eager', 'flash_attention_2'.")
    quantization: Literal["none", "4bit"] = Field(
        "none", description="'4bit': load the base weights in NF4 with bitsandbytes and train LoRA adapters on "
                            "them (QLoRA; needs lora.enabled, a CUDA GPU and `pip install 'rlft[qlora]'`). "
                            "final/ then holds the adapter only (guides/precision-and-memory.md#qlora-lora-on-a-4-bit-base).")

    @field_validator("path", "tokenizer_path")
    @classmethod
    def _model_location(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else paths.existing(_local(value, f"model.{info.field_name}"))

    @field_validator("device", mode="before")
    @classmethod
    def _known_device(cls, value: Any) -> Any:
        return check_device(str(value), "model.device") if isinstance(value, (str, int)) else value

    @field_validator("chat_template")
    @classmethod
    def _template_location(cls, value: str | None) -> str | None:
        if value is None or "{" in value:
            return value
        return paths.existing(_local(value, "model.chat_template"))


class LoraConfig(Section):
    """LoRA adapters (peft): with `enabled: true` only the adapters train and the base weights stay frozen, for
    any method; the other fields set their rank, scale, dropout and the modules they adapt. Needed for
    `model.quantization: 4bit` (QLoRA). `final/` then holds the merged model and the adapter (`final/adapter/`),
    on a 4-bit base the adapter only. See getting-started/your-model.md#3-decide-full-fine-tune-or-lora."""

    enabled: bool = Field(False, description="Train LoRA adapters (peft) instead of all weights.")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'.")


class TeacherConfig(Section):
    """The teacher of on-policy distillation (method: distill): it scores each token the student samples, and
    the per-token gap between its log-probs and the student's is the student's advantage. Required by method
    distill and refused by every other; it is never trained, and its tokenizer must map tokens as the
    student's does. See guides/methods/distillation.md."""

    path: str = Field(description="The teacher's weights (local folder or hub id); its tokenizer must map every "
                                  "token as the student's does (checked at start-up).")

    @field_validator("path")
    @classmethod
    def _model_location(cls, value: str) -> str:
        return paths.existing(_local(value, "teacher.path"))
