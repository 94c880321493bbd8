"""Per-token KL estimators and the KL coefficient controllers.

Estimators follow Schulman's note (http://joschu.net/blog/kl-approx.html) for KL(pi || ref) with
tokens sampled from pi: `fn(logprobs [N, T], ref_logprobs [N, T]) -> Tensor [N, T]`. Unlike the
other algorithm functions they return only the tensor (no metrics dict): they are elementwise
building blocks, and the caller masks, aggregates and logs the result.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor


def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """log pi - log ref: unbiased, high variance, can be negative per token."""
    return logprobs - ref_logprobs


def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """0.5 * (log pi - log ref)^2: biased, low variance, >= 0; its gradient is that of the KL."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


# k3 grows like e^x in the log gap x: a token the policy has made much less likely than the
# reference did would give inf (and a skipped step, or a jump of an adaptive beta). The gap is
# clamped to +-K3_MAX_LOG_RATIO and the estimate to <= K3_MAX, the bounds veRL uses for its
# "low_var_kl"; inside them (|gap| < ~2.4) the estimate is exact.
K3_MAX_LOG_RATIO = 20.0
K3_MAX = 10.0


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """exp(log ref - log pi) - (log ref - log pi) - 1: unbiased and >= 0 (e^x >= 1 + x).

    Bounded: the log gap is clamped to [-20, 20] and the result to at most 10 (see K3_MAX), so
    one far-off token cannot make the loss or the measured KL infinite."""
    log_ratio = (ref_logprobs - logprobs).clamp(-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO)
    return (log_ratio.exp() - log_ratio - 1).clamp(max=K3_MAX)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, beta: float):
        self.value = float(beta)

    def update(self, measured_kl: float) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Steer the measured KL toward `target` by a multiplicative step on beta (the adaptive KL
    penalty of Ziegler et al., arXiv:1909.08593, with a dead band instead of a proportional step).

    KL above 1.5x target: beta *= factor; below 0.5x target: beta /= factor; else unchanged.
    The dead band keeps beta from oscillating on per-step noise.
    """

    def __init__(self, beta: float, target: float, factor: float = 1.5):
        if target <= 0:
            raise ValueError(f"adaptive KL target must be > 0 (got {target})")
        if factor <= 1:
            raise ValueError(f"adaptive KL factor must be > 1 (got {factor})")
        self.value = float(beta)
        self.target = float(target)
        self.factor = float(factor)

    def update(self, measured_kl: float) -> float:
        if measured_kl > 1.5 * self.target:
            self.value *= self.factor
        elif measured_kl < 0.5 * self.target:
            self.value /= self.factor
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "factor": self.factor}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # Only beta is run state; target and factor come from the (resolved) config.
        self.value = float(state["value"])


def make_kl_controller(beta: float, target: float | None = None, factor: float = 1.5,
                       ) -> FixedKLController | AdaptiveKLController:
    """Fixed beta when target is None, else adaptive."""
    if target is None:
        return FixedKLController(beta)
    return AdaptiveKLController(beta, target, factor)
