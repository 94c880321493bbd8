"""What the vLLM engine needs from the trainer's model: the weights to push, and when they changed.

Kept apart from the engine so the maths of a merged LoRA weight and the staleness rule can be
read (and tested) without vLLM installed.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def base_model_of(model: Any) -> Any:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def full_state(model: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in checkpoint naming, a tied `lm_head.weight` included.

    `state_dict()` rather than `named_parameters()`: the latter lists a tied head once (as the
    embedding), and vLLM keeps its own copy of the head on CPU, so a push without the key leaves
    the engine sampling from the old head.
    """
    return list(base_model_of(model).state_dict().items())


def merged_lora_state(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The peft model's weights with each active adapter folded in, W + (alpha/r) B A, in the
    base checkpoint's naming. New tensors: the trainer's base weights are never touched (merging
    in place and unmerging after would drift them by rounding at every sync)."""
    from peft.tuners.lora import LoraLayer

    base = base_model_of(model)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" not in name:
                out[name.replace(".base_layer.", ".")] = tensor
        for name, module in base.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            weight = module.get_base_layer().weight
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            out[f"{name}.weight"] = weight
    return list(out.items())


def lora_rank(model: Any) -> int:
    """The adapter rank of a peft model's active adapter."""
    config = model.peft_config[model.active_adapter]
    return int(config.r)


class StalenessTracker:
    """Says whether the trainer's weights may have changed since the last push, cheaply.

    Two signals, either one marks the engine stale:
    - a global optimizer step hook: any optimizer whose parameters include one of the watched
      tensors has stepped (this catches fused optimizers, whose kernels update weights without
      bumping autograd's version counters);
    - the version counters of the watched tensors moved (in-place edits outside an optimizer:
      `load_state_dict` on resume, adding noise in a test).
    A call after neither costs one pass over the tensors' version counters.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self._ids = {id(t) for t in tensors}
        self._touches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> bool
        self._stepped = False
        self._versions: tuple[int, ...] | None = None  # None: never pushed, so stale
        self._handle = register_optimizer_step_post_hook(self._on_step)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        touches = self._touches.get(optimizer)
        if touches is None:
            touches = any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])
            self._touches[optimizer] = touches
        self._stepped |= touches

    def _current(self) -> tuple[int, ...]:
        return tuple(t._version for t in self.tensors)

    @property
    def stale(self) -> bool:
        return self._stepped or self._versions != self._current()

    def mark_stale(self) -> None:
        self._versions = None

    def mark_synced(self) -> None:
        self._stepped = False
        self._versions = self._current()

    def close(self) -> None:
        self._handle.remove()


def watched_tensors(model: Any, is_lora: bool) -> Iterator[torch.Tensor]:
    """The tensors whose change requires a push: the adapter under LoRA, everything otherwise."""
    if is_lora:
        return (p for p in model.parameters() if p.requires_grad)
    return iter(base_model_of(model).state_dict(keep_vars=True).values())
