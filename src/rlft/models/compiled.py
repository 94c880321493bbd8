"""`training.compile`: the training forwards' decoder layers run through `torch.compile`
(TorchInductor), and with them their backward (AOTAutograd compiles both from one trace).

What is compiled: each decoder layer's call (`torch.compile(nn.Module._call_impl, dynamic=True)`, the layer its first argument), not
the whole model. The layers of a model share one code object, so one compile serves all of them
("regional" compilation: on the tiny model 16 s instead of 80 s for the whole decoder), and the
parts with Python logic -- `pack_rows`, transformers' mask construction, the chunked LM head --
stay eager, so no graph breaks and no guards on token ids. `dynamic=True` traces lengths and row
counts as symbols from the first call: packed rows change length every step, and without it the
second length compiles again (measured: 35 s, then 37 s) before torch marks the dimension dynamic.
What remains a new compile: a new grad mode (the reference's and pi_old's no-grad passes), a new
mask kind (padded, packed, `shared_prefix`'s 4D mask), LoRA adapters on or off.

Scope: only where `rlft.models.forward` runs the decoder for per-token outputs (policy, reference,
critic, SFT, DPO, the reward model's scores), and only inside `compiled_forwards()`, which the
training session enters with its autocast. Generation never runs compiled layers: the HF engine
calls the same modules with a KV cache, a different program, and the swap is undone on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from rlft.errors import ConfigError

log = logging.getLogger(__name__)

FIX = "set training.compile: false (the eager forwards compute the same numbers)"

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("rlft_compiled_forwards", default=False)
BACKEND = "inductor"  # tests of the wiring swap in "aot_eager" (no kernels to build: seconds, not a minute)
_CALLS: dict[str, Any] = {}  # backend -> torch.compile(nn.Module._call_impl), made on first use
_SKIPPED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # decoders told about once
# every variant (grad mode, mask kind, adapters on/off, policy/reference/critic) is one cache entry
# on the shared `Module._call_impl` code object; torch's default of 8 would send later ones back to eager
RECOMPILE_LIMIT = 64


def check_compile_available(device: torch.device) -> None:
    """Stop before loading weights where TorchInductor cannot build kernels: on CPU it compiles C++
    (g++, or $CXX), on CUDA it needs Triton."""
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as exc:  # torch raises InvalidCxxCompiler, or an ImportError on an odd build
            raise ConfigError(
                "training.compile: true needs a C++ compiler on CPU (TorchInductor builds its kernels with g++ "
                f"or $CXX), and none was found ({type(exc).__name__}).\nFix: install one (apt-get install g++) "
                f"or {FIX}") from None
    elif device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ConfigError("training.compile: true on CUDA needs Triton (pip install triton).\n"
                              f"Fix: install it or {FIX}") from None
    else:
        raise ConfigError(f"training.compile: true is supported on CPU and CUDA, not on {device.type}.\nFix: {FIX}")


@contextlib.contextmanager
def compiled_forwards(enabled: bool = True) -> Iterator[None]:
    """Inside: `rlft.models.forward` runs decoder layers compiled (the session's training context)."""
    if enabled and torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def compiling() -> bool:
    return _ENABLED.get()


@contextlib.contextmanager
def compiled_layers(decoder: Any) -> Iterator[None]:
    """While inside `compiled_forwards()`: `decoder`'s layers run their compiled call (set up on first
    use); a no-op outside it. The layers are found as `decoder.layers` (every transformers decoder
    rlft's head split accepts has them); a decoder without them runs eagerly, said once."""
    if not _ENABLED.get():
        yield
        return
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        if decoder not in _SKIPPED:
            _SKIPPED.add(decoder)
            log.warning("training.compile: %s has no `layers` list; its forwards run eagerly", type(decoder).__name__)
        yield
        return
    if BACKEND not in _CALLS:  # the unbound call, the layer an argument: no compiled object holds a model alive
        _CALLS[BACKEND] = torch.compile(nn.Module._call_impl, dynamic=True, backend=BACKEND)
    saved = [layer._compiled_call_impl for layer in layers]
    for layer in layers:
        layer._compiled_call_impl = functools.partial(_CALLS[BACKEND], layer)
    try:
        yield
    except _compile_errors() as exc:
        raise ConfigError(f"training.compile: TorchInductor could not compile {type(layers[0]).__name__}: "
                          f"{_first_line(exc)}\nFix: {FIX}") from None
    finally:
        for layer, impl in zip(layers, saved):
            layer._compiled_call_impl = impl


def _compile_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        from torch._inductor.exc import InductorError
    except ImportError:  # older torch: BackendCompilerFailed only
        return (BackendCompilerFailed,)
    return (BackendCompilerFailed, InductorError)


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def note_not_compiled(model: Any, why: str) -> None:
    """Say once per model that a compiled forward was asked for and why it runs eagerly."""
    if _ENABLED.get() and model not in _SKIPPED:
        _SKIPPED.add(model)
        log.warning("training.compile: %s runs eagerly: %s", type(model).__name__, why)
