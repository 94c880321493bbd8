"""The policy and the models beside it: `model`, `lora`, `teacher`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rlft import paths
from rlft.config.section import Section, _local, check_device


class ModelConfig(Section):
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
                            "final/ then holds the adapter only (see the README).")

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
    enabled: bool = Field(False, description="Train LoRA adapters (peft) instead of all weights.")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'.")


class TeacherConfig(Section):
    """The teacher of on-policy distillation (method: distill): scores the student's own samples."""

    path: str = Field(description="The teacher's weights (local folder or hub id); its tokenizer must map every "
                                  "token as the student's does (checked at start-up).")

    @field_validator("path")
    @classmethod
    def _model_location(cls, value: str) -> str:
        return paths.existing(_local(value, "teacher.path"))
