"""The methods, their presets, and the sections that choose the math: `algorithm`, `critic`, `dpo`,
`reward_model`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlft import paths
from rlft.config.section import Section, _local

OFFLINE_METHODS = ("sft", "dpo", "reward_model")


ONLINE_METHODS = ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo", "gspo", "cispo", "distill")


Method = Literal["sft", "dpo", "reward_model", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo", "gspo",
                 "cispo", "distill"]


AdvantageName = Literal["group_norm", "group_mean", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae",
                        "reverse_kl"]


class AlgorithmConfig(Section):
    """The objective of the online methods: advantage estimator, policy loss and ratio clipping, the KL term
    to the reference (fixed or adaptive), entropy bonus, loss aggregation, update epochs, and corrections for
    stale or mismatched samples. Fields left unset are filled from the preset named by `method` when the
    config is loaded; offline methods do not use it. See guides/methods/index.md."""

    advantage: AdvantageName | None = Field(None, description="Advantage estimator.")
    std_floor: float | None = Field(None, ge=0, description="Group std is clamped to at least this before dividing.")
    policy_loss: Literal["clipped", "gspo", "gspo_token", "cispo"] | None = Field(
        None, description="Policy loss: 'clipped' (PPO's token-level clipped surrogate), 'gspo' (sequence-level ratio "
                          "and clip, arXiv:2507.18071), 'gspo_token' (its per-token-advantage variant), 'cispo' "
                          "(clipped stop-gradient weight on log pi, every token keeps a gradient; arXiv:2506.13585).")
    clip_low: float | None = Field(
        None, description="Lower clip of the importance ratio: 1 - clip_low; in (0, 1), so the bound stays positive "
                          "(cispo: up to 1, no lower bound on its weight).")
    clip_high: float | None = Field(
        None, description="Upper clip: 1 + clip_high, clip_high > 0 (DAPO clip-higher: 0.28).")
    dual_clip: float | None = Field(None, description="Dual-clip bound c > 1 for negative advantages (None: off).")
    kl_coef: float | None = Field(None, ge=0, description="KL coefficient beta (initial value if adaptive).")
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(None, description="KL estimator (Schulman's k1/k2/k3).")
    kl_in: Literal["loss", "reward"] | None = Field(None, description="KL as a loss term or as a per-token reward penalty.")
    kl_target: float | None = Field(None, gt=0, description="Adaptive KL: target KL per token (None: fixed beta).")
    kl_adapt_factor: float | None = Field(
        None, gt=1, description="Adaptive KL, kl_controller=deadband: multiply/divide beta by this.")
    kl_controller: Literal["deadband", "proportional"] | None = Field(
        None, description="Adaptive KL (only with kl_target): 'deadband' multiplies/divides beta by kl_adapt_factor "
                          "when the KL leaves [0.5, 1.5] x kl_target (PPO paper, arXiv:1707.06347); 'proportional' "
                          "steps beta by 1 + clip(KL/kl_target - 1, -0.2, 0.2) x sequences/kl_horizon each step "
                          "(Ziegler et al., arXiv:1909.08593; as in veRL and OpenRLHF).")
    kl_horizon: int | None = Field(
        None, gt=0, description="Adaptive KL, kl_controller=proportional: sequences over which beta changes by at "
                                "most a factor of about e^0.2 = 1.22 (K_beta = sequences per step / kl_horizon; "
                                "Ziegler et al.'s code uses 10000).")
    entropy_coef: float | None = Field(None, ge=0, description="Entropy bonus coefficient.")
    loss_agg: Literal["token_mean", "sequence_mean", "constant"] | None = Field(
        None, description="Loss aggregation over the global batch.")
    loss_constant: int | None = Field(
        None, ge=1, description="Normaliser for loss_agg='constant' (default rollout.max_new_tokens).")
    epochs: int | None = Field(None, ge=1, description="Update epochs over each rollout batch (mu).")
    minibatches: int | None = Field(None, ge=1, description="Optimizer steps per epoch per rollout batch.")
    micro_batch_size: int | None = Field(None, ge=1, description="Sequences per forward/backward (accumulated).")
    dynamic_sampling: bool | None = Field(None, description="DAPO: drop groups with all-equal rewards and refill.")
    dynamic_sampling_max_rounds: int | None = Field(None, ge=1, description="Extra rollout rounds to refill groups.")
    mask_truncated: bool | None = Field(None, description="Exclude completions that hit max_new_tokens from the loss.")
    gamma: float | None = Field(None, ge=0, le=1, description="Discount for token-level returns (GAE / REINFORCE++).")
    lam: float | None = Field(None, ge=0, le=1, description="GAE lambda.")
    rollout_correction: Literal["none", "tis", "bypass"] | None = Field(
        None, description="Correct for engine/trainer log-prob mismatch (and, with rollout.async_steps, staleness): "
                          "'tis' weights each token's loss by min(pi_trainer / pi_engine, tis_cap) (truncated "
                          "importance sampling); 'bypass' clips the ratio against the engine's log-probs (pi_old = "
                          "the sampler's policy).")
    tis_cap: float | None = Field(None, ge=1, description="Upper bound of the truncated importance weight.")
    sft_mix: str | None = Field(
        None, description="SFT rows (as data.train of an sft run) whose NLL joins the policy loss: the 'ptx' "
                          "regulariser, keeping what SFT taught while RL trains (None: off).")
    sft_mix_coef: float = Field(0.1, ge=0, description="Weight of the sft_mix NLL (mean per token) in the loss.")
    sft_mix_batch_size: int = Field(8, ge=1, description="sft_mix rows per optimizer step.")

    @field_validator("clip_low", "clip_high", "dual_clip")
    @classmethod
    def _clip_range(cls, value: float | None, info: Any) -> float | None:
        """The ratio is clipped to [1 - clip_low, 1 + clip_high]: clip_low >= 1 makes the lower
        bound 0 or negative (no clipping at all for negative advantages), 0 makes it 1 (no update
        below the old policy); dual clip c bounds the loss of a negative advantage at c * |A|,
        which is only a bound above the clipped ratio (>= 1)."""
        if value is None:
            return value
        name = info.field_name
        if name == "clip_low" and not 0 < value <= 1:  # 1 only for cispo: checked with the method
            raise ValueError(f"algorithm.clip_low={value:g}: the ratio's lower bound is 1 - clip_low, which must "
                             "lie in (0, 1), so clip_low must be in (0, 1) (PPO uses 0.2)")
        if name == "clip_high" and not value > 0:
            raise ValueError(f"algorithm.clip_high={value:g}: the ratio's upper bound is 1 + clip_high, which must "
                             "exceed 1, so clip_high must be > 0 (PPO uses 0.2, DAPO's clip-higher 0.28)")
        if name == "dual_clip" and not value > 1:
            raise ValueError(f"algorithm.dual_clip must be > 1 (got {value:g}): it caps the ratio of negative "
                             "advantages above the 1 + clip range; null turns it off")
        return value

    @field_validator("sft_mix")
    @classmethod
    def _data_location(cls, value: str | None) -> str | None:
        return None if value is None else paths.data_location(_local(value, "algorithm.sft_mix"))


_BASE_PRESET: dict[str, Any] = dict(
    advantage="group_norm", policy_loss="clipped", std_floor=1e-4, clip_low=0.2, clip_high=0.2, dual_clip=None,
    kl_coef=0.04, kl_estimator="k3", kl_in="loss", kl_target=None, kl_adapt_factor=1.5,
    kl_controller="deadband", kl_horizon=10_000,
    entropy_coef=0.0, loss_agg="token_mean", loss_constant=None, epochs=1, minibatches=1,
    micro_batch_size=None, dynamic_sampling=False, dynamic_sampling_max_rounds=3, mask_truncated=False,
    gamma=1.0, lam=0.95, rollout_correction="none", tis_cap=2.0,
)


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    # Dr. GRPO (arXiv:2503.20783): no std division, constant normaliser, no KL.
    "dr_grpo": dict(advantage="group_mean", loss_agg="constant", kl_coef=0.0),
    # DAPO (arXiv:2503.14476): clip-higher, dynamic sampling, token-mean, no KL.
    "dapo": dict(clip_high=0.28, dynamic_sampling=True, kl_coef=0.0),
    # RLOO (arXiv:2402.14740): leave-one-out baseline, KL as a reward penalty.
    "rloo": dict(advantage="rloo", kl_in="reward", kl_estimator="k1", kl_coef=0.05),
    # REINFORCE++ (arXiv:2501.03262): per-token KL in the reward, batch-normalised returns.
    "reinforce_pp": dict(advantage="reinforce_pp", kl_in="reward", kl_estimator="k1", kl_coef=0.01),
    # PPO with a critic and GAE; the sequence reward sits on the last valid token.
    "ppo": dict(advantage="gae", kl_in="reward", kl_estimator="k1", kl_coef=0.05, epochs=2),
    # GSPO (arXiv:2507.18071): the sequence's length-normalised ratio, clipped at sequence level with
    # the paper's ranges (3e-4, 4e-4), averaged per sequence.
    "gspo": dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="sequence_mean"),
    # CISPO (MiniMax-M1, arXiv:2506.13585): clipped stop-gradient weights, no lower bound as in the
    # paper; the upper bound is a choice (the paper tunes it): weights at most 4.
    "cispo": dict(policy_loss="cispo", clip_low=1.0, clip_high=3.0),
    # On-policy distillation (Agarwal et al., arXiv:2306.13649; Thinking Machines' recipe): each sampled
    # token's advantage is the teacher's log-prob minus the student's (minus the per-token reverse KL);
    # rewards are only measured. No reference KL: the teacher is the anchor.
    "distill": dict(advantage="reverse_kl", kl_coef=0.0),
}


# Learning rates by method when training.learning_rate is unset. Online RL and DPO on pretrained
# models use 5e-7..5e-6 (DeepSeekMath GRPO 1e-6, arXiv:2402.03300; DPO 5e-7..1e-6,
# arXiv:2305.18290); SFT and reward models 1e-5 (InstructGPT, arXiv:2203.02155).
METHOD_LEARNING_RATES: dict[str, float] = {"sft": 1e-5, "reward_model": 1e-5, "dpo": 1e-6,
                                           **{m: 1e-6 for m in ONLINE_METHODS}}


ONLINE_LR_RANGE = (5e-7, 5e-6)  # typical for online RL on pretrained models; warn far outside it


CLIP_WARN = 0.3  # PPO-style clip ranges above this let a single update move the policy too far


class CriticConfig(Section):
    """The value model of PPO (method: ppo), whose values give the GAE advantages; the critic-free methods
    ignore it. It is a separate model (by default started from `model.path`) or a value head on the policy;
    the other fields set how it trains. See guides/methods/ppo.md#the-critic."""

    kind: Literal["separate", "shared"] = Field(
        "separate", description="'separate': its own model; 'shared': a value head on the policy's backbone.")
    path: str | None = Field(None, description="Separate critic's initial weights (default: model.path; a reward "
                                               "model export also works).")
    lora: bool = Field(False, description="Separate critic: train LoRA adapters (and the value head) only.")
    learning_rate: float | None = Field(None, gt=0, description="Separate critic's learning rate (default: training's).")
    value_coef: float = Field(0.5, ge=0, description="Shared head: weight of the value loss in the combined loss.")
    value_clip: float | None = Field(0.2, gt=0, description="Clip of the value update around the old values, > 0 "
                                                            "(0 would freeze the critic; None: off).")
    warmup_steps: int = Field(0, ge=0, description="First rollout steps that train the critic only (policy frozen).")
    whiten_advantages: bool = Field(True, description="Normalise GAE advantages over the batch's valid tokens.")

    @field_validator("path")
    @classmethod
    def _model_location(cls, value: str | None) -> str | None:
        return None if value is None else paths.existing(_local(value, "critic.path"))


class DpoConfig(Section):
    """Direct preference optimisation (method: dpo) on chosen/rejected pairs against a frozen reference: the
    loss (sigmoid DPO, IPO or hinge), its beta, label smoothing, an optional NLL term on the chosen answers,
    and whether the reference scores every pair once before training. Other methods ignore it. See
    guides/methods/dpo.md."""

    loss: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="Preference loss: sigmoid (DPO), ipo (squared, finite target) or hinge (SLiC).")
    beta: float = Field(
        0.1, gt=0, description="Strength of the pull towards the reference (DPO's beta; IPO's tau). Sweep 0.05/0.1/0.3.")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Conservative DPO: assumed share of flipped labels (sigmoid loss only).")
    nll_coef: float = Field(
        0.0, ge=0, description="Weight of an extra NLL term on chosen answers (mean per token, per pair); 0: off.")
    precompute_ref: bool = Field(
        False, description="Score every pair with the reference once before training (no reference forward "
                           "per step; a full fine-tune then frees the reference copy).")

    @model_validator(mode="after")
    def _smoothing_needs_sigmoid(self) -> "DpoConfig":
        if self.label_smoothing and self.loss != "sigmoid":
            raise ValueError(f"dpo.label_smoothing applies to the sigmoid loss only; dpo.loss is {self.loss!r} "
                             "(set dpo.label_smoothing=0)")
        return self


class RewardModelConfig(Section):
    """Reward-model training (method: reward_model): a scalar head on a causal-LM checkpoint, trained on
    chosen/rejected pairs with a Bradley-Terry loss; this section sets its margin and an optional centering
    term. Other methods ignore it. See guides/methods/reward-model.md."""

    margin: float = Field(
        0.5, description="Bradley-Terry margin for rows without their own 'margin' field: chosen must win by it "
                         "(0.5-1.0 is the usual range; 0 is the plain Bradley-Terry loss).")
    center_coef: float = Field(
        0.0, ge=0, description="Reward centering: adds coef * (r_chosen + r_rejected)^2 per pair so scores stay "
                               "near zero (arXiv:2312.09244 uses 0.01); 0: off.")
