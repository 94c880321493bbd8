"""Per-token KL estimators and the KL coefficient controllers.

Estimators follow Schulman's note (http://joschu.net/blog/kl-approx.html) for KL(pi || ref) with
tokens sampled from pi: `fn(logprobs [N, T], ref_logprobs [N, T]) -> Tensor [N, T]`. Unlike the
other algorithm functions they return only the tensor (no metrics dict): they are elementwise
building blocks, and the caller masks, aggregates and logs the result.
"""

from __future__ import annotations

from typing import Callable, Protocol

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


class KLController(Protocol):
    """beta for the next step. `update` gets the mean per-token KL measured on this step's batch and
    the number of sequences it was measured on (only the proportional controller uses that)."""

    value: float

    def update(self, measured_kl: float, n_samples: int) -> float: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, beta: float):
        self.value = float(beta)

    def update(self, measured_kl: float, n_samples: int = 0) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Steer the measured KL toward `target` by a multiplicative step on beta: the adaptive KL
    penalty of the PPO paper (Schulman et al., arXiv:1707.06347, section 4).

    KL above 1.5x target: beta *= factor; below 0.5x target: beta /= factor; else unchanged.
    The dead band keeps beta from oscillating on per-step noise. (The paper divides and
    multiplies by 2 at KL_target / 1.5 and x 1.5; rlft's band and factor are settings.)
    """

    def __init__(self, beta: float, target: float, factor: float = 1.5):
        if target <= 0:
            raise ValueError(f"adaptive KL target must be > 0 (got {target})")
        if factor <= 1:
            raise ValueError(f"adaptive KL factor must be > 1 (got {factor})")
        self.value = float(beta)
        self.target = float(target)
        self.factor = float(factor)

    def update(self, measured_kl: float, n_samples: int = 0) -> float:
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


# Ziegler et al. clip the proportional error to +-20%: one step moves beta by at most
# 0.2 * n_samples / horizon of itself.
PROPORTIONAL_ERROR_CLIP = 0.2


class ProportionalKLController:
    """The proportional controller of Ziegler et al. (arXiv:1909.08593, section 2.2):

        e_t = clip(KL_t / target - 1, -0.2, 0.2);  beta_{t+1} = beta_t * (1 + K_beta * e_t)

    The paper uses K_beta = 0.1; its code (lm-human-preferences, as veRL and OpenRLHF) sets
    K_beta = n_samples / horizon, with n_samples the sequences in the step's batch, so the rate
    of adaptation is per sample seen, not per step: beta changes by at most a factor of about
    e^0.2 = 1.22 (up or down) per `horizon` samples.
    """

    def __init__(self, beta: float, target: float, horizon: float = 10_000):
        if target <= 0:
            raise ValueError(f"adaptive KL target must be > 0 (got {target})")
        if horizon <= 0:
            raise ValueError(f"proportional KL horizon must be > 0 (got {horizon})")
        self.value = float(beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, measured_kl: float, n_samples: int) -> float:
        if n_samples < 0:
            raise ValueError(f"n_samples must be >= 0 (got {n_samples})")
        error = min(max(measured_kl / self.target - 1.0, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
        self.value *= 1.0 + error * n_samples / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # Only beta is run state; target and horizon come from the (resolved) config.
        self.value = float(state["value"])


KL_CONTROLLERS = ("deadband", "proportional")


def make_kl_controller(beta: float, target: float | None = None, factor: float = 1.5,
                       kind: str = "deadband", horizon: float = 10_000) -> KLController:
    """Fixed beta when target is None; else adaptive: `kind` 'deadband' (PPO paper, uses
    `factor`) or 'proportional' (Ziegler et al., uses `horizon`)."""
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {kind!r}; choose one of {', '.join(KL_CONTROLLERS)}")
    if target is None:
        return FixedKLController(beta)
    if kind == "proportional":
        return ProportionalKLController(beta, target, horizon)
    return AdaptiveKLController(beta, target, factor)
