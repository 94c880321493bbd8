"""Runs inside vLLM's worker processes (`worker_extension_cls`): receive the trainer's weights.

Across processes vLLM serialises tensors in RPC arguments as nested lists, so the engine sends
one safetensors blob instead, and the worker loads it through vLLM's own in-place reload (which
re-packs weights into the kernels' layout, as at start-up).
"""

from __future__ import annotations


class WeightReceiver:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def rlft_load_weights(self, payload: bytes) -> None:
        from safetensors.torch import load

        self.reload_weights(weights_iterator=list(load(payload).items()))
