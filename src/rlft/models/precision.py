"""Numeric precision of training: which dtype the weights are kept in, and which the matrix work
runs in.

- `fp32`: fp32 weights, fp32 compute.
- `bf16-mixed` / `fp16-mixed`: fp32 master weights and optimizer states; forward and backward run
  under `torch.autocast` in bf16 / fp16 (what TRL's `bf16=True` does); fp16 also scales the loss
  (GradScaler) so small gradients do not underflow. fp16 needs a CUDA GPU.
- `bf16`: bf16 weights and compute (and AdamW states in bf16): half the memory of mixed precision,
  at the cost of updates smaller than bf16 can represent being lost.
- `auto`: bf16-mixed where the hardware computes in bf16 (a CUDA GPU with bf16 support; a CPU with
  AMX or AVX512-BF16), fp32 elsewhere -- on a CPU without bf16 units bf16 matrix products are far
  slower than fp32 ones. The choice and its reason are printed when a run starts.
  `RLFT_CPU_BF16=1` (or `0`) in the environment makes `auto` treat the CPU as one with (or
  without) bf16 units: run the bf16 paths on an AVX2-only machine (slowly), or the fp32 paths on an
  AMX one, e.g. `RLFT_CPU_BF16=1 make test`.
Log-softmax and losses are taken in fp32 whatever the precision (see models/forward.py).

When to prefer fp32 where `auto` picks bf16-mixed: comparing runs seed for seed, e.g. small
models trained from random init at high learning rates. bf16-mixed gradients agree with fp32's to
~1% per tensor, but such runs are chaotic: a one-time bf16 rounding of the initial weights, then
fp32 training, moves final accuracy as much as bf16-mixed does, and so does changing the seed
(benchmarks/bf16_stability.py; docs/guides/precision-and-memory.md). Over seeds the two precisions are alike.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from rlft.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16-mixed | fp16-mixed | bf16
    reason: str

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype, None when the weights' own dtype is the compute dtype."""
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.name)

    @property
    def scales_loss(self) -> bool:
        return self.name == "fp16-mixed"

    def autocast(self, device: torch.device) -> ContextManager[Any]:
        """The context training forwards run in."""
        return autocast_to(device, self.compute_dtype)


def autocast_to(device: torch.device, dtype: torch.dtype | None) -> ContextManager[Any]:
    """torch.autocast to `dtype`; None: no casting."""
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


CPU_BF16_ENV = "RLFT_CPU_BF16"
# appended to auto's reason when it picks bf16-mixed (see the module docstring)
SEED_EXACT_HINT = "; training.precision=fp32 to compare runs seed for seed (bf16 rounding moves a run as a seed does)"


def cpu_has_bf16() -> bool:
    """AMX or AVX512-BF16: the CPU multiplies bf16 matrices natively (or RLFT_CPU_BF16 says so)."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ConfigError(f"{CPU_BF16_ENV}={forced!r}: use 1 (treat this CPU as having bf16 units) or 0 "
                              "(as having none), or unset it to detect")
        return forced == "1"
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(precision: str, model_dtype: str, device: torch.device) -> Precision:
    """training.precision (with model.dtype, which may only agree with it) for this device."""
    if model_dtype not in ("auto", "fp32") and precision in ("auto", model_dtype):
        if model_dtype == "fp16":
            raise ConfigError("model.dtype=fp16 (pure fp16 weights) trains unstably; use training.precision="
                              "fp16-mixed (fp32 master weights, fp16 compute, loss scaling)")
        return _checked(Precision("bf16", "model.dtype=bf16: bf16 weights and compute"), device)
    if model_dtype not in ("auto", "fp32") or (model_dtype == "fp32" and precision == "bf16"):
        raise ConfigError(f"model.dtype={model_dtype} and training.precision={precision} disagree: the weights' "
                          "dtype follows training.precision (fp32 for fp32 and the -mixed modes, bf16 for bf16). "
                          "Fix: drop model.dtype (or set it to auto)")
    if precision != "auto":
        return _checked(Precision(precision, f"training.precision={precision}"), device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            gpu = torch.cuda.get_device_name(device)
            return Precision("bf16-mixed", f"auto: {gpu} computes in bf16{SEED_EXACT_HINT}")
        return Precision("fp32", f"auto: {torch.cuda.get_device_name(device)} has no bf16 support")
    if device.type == "cpu" and cpu_has_bf16():
        why = (f"{CPU_BF16_ENV}=1" if os.environ.get(CPU_BF16_ENV, "").strip() == "1"
               else "this CPU has bf16 matrix units (AMX / AVX512-BF16)")
        return Precision("bf16-mixed", f"auto: {why}{SEED_EXACT_HINT}")
    if device.type == "cpu" and os.environ.get(CPU_BF16_ENV, "").strip() == "0":
        return Precision("fp32", f"auto: {CPU_BF16_ENV}=0")
    return Precision("fp32", f"auto: no bf16 units on this {device.type.upper()} (bf16 would be slower than fp32)")


def _checked(p: Precision, device: torch.device) -> Precision:
    if p.name == "fp16-mixed" and device.type != "cuda":
        raise ConfigError("training.precision=fp16-mixed needs a CUDA GPU; on CPU use bf16-mixed (with bf16 "
                          "hardware) or fp32")
    if "bf16" in p.name and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"training.precision={p.name}: {torch.cuda.get_device_name(device)} has no bf16 support; "
                          "use fp16-mixed or fp32")
    return p
