"""Run configuration: one pydantic model per section, YAML plus `a.b=value` overrides.

Every field's default and meaning is declared once, here. The online presets (`grpo`, `dapo`,
...) are resolved when the config is loaded, so the `config.yaml` saved in a run directory states
every value the run used; nothing is changed at run time.
"""

from __future__ import annotations

import copy
import re
import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from rlft.config_yaml import load_yaml
from rlft import paths
from rlft.errors import ConfigError
from rlft.monitor.settings import LoggerSettings, MonitorConfig
from rlft.section import Section

OFFLINE_METHODS = ("sft", "dpo", "reward_model")
ONLINE_METHODS = ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo", "gspo", "cispo", "distill")
Method = Literal["sft", "dpo", "reward_model", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo", "gspo",
                 "cispo", "distill"]


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


class MixSource(Section):
    """One entry of `data.train` when it is a list of sources."""

    path: str = Field(description="Data file or dataset (as data.train).")
    name: str | None = Field(None, description="Name in per-source metrics (default: the file's stem).")
    weight: float | None = Field(None, gt=0, description="Share of each epoch, relative to the other weights.")
    rows: int | None = Field(None, ge=1, description="Exact rows of this source per epoch.")

    @field_validator("path")
    @classmethod
    def _data_location(cls, value: str) -> str:
        return paths.data_location(_local(value, "data.train[].path"))

    @model_validator(mode="after")
    def _one_of(self) -> "MixSource":
        if (self.weight is None) == (self.rows is None):
            raise ValueError(f"data source {self.path!r}: give exactly one of 'weight' or 'rows'")
        return self


class DataConfig(Section):
    train: str | list[MixSource] = Field(
        description="Training data: a .jsonl/.json/.parquet file, a saved HF dataset folder, 'hf:NAME', or "
                    "'reasoning_gym:TASK?size=N&eval_size=M&seed=S&SETTING=VALUE' (generated tasks); or a list of "
                    "sources mixed in set proportions: [{path, weight}] or [{path, rows}] (optional name).")
    mix_epoch_size: int | None = Field(
        None, ge=1, description="Mixed sources: rows per epoch (default: the fixed 'rows' plus every weighted "
                                "source's own size).")
    eval: str | None = Field(None, description="Held-out data in the same format; used for eval loss / accuracy.")
    split: str = Field("train", description="Split to read from an HF dataset given as 'hf:NAME'.")
    eval_split: str | None = Field(None, description="Split for `eval` when it is 'hf:NAME' (a 'reasoning_gym:' eval: "
                                                     "'test', its held-out rows, unless set).")
    max_prompt_length: int = Field(512, ge=1, description="Longest prompt in tokens; longer rows are reported.")
    max_length: int = Field(1024, ge=2, description="Longest prompt+answer in tokens for offline methods.")
    shuffle: bool = Field(True, description="Shuffle training rows each epoch (seeded).")
    on_invalid: Literal["error", "drop"] = Field(
        "error", description="Invalid rows: stop with a report (error) or drop them with the same report (drop).")
    max_row_bytes: int = Field(
        8 << 20, ge=1, description="Rows larger than this (bytes of the JSON line, or of a row's text) are invalid "
                                   "rows, rejected before they are parsed or tokenized (a 50 MB line would take "
                                   "minutes and gigabytes). 8 MiB leaves room for large test suites of code tasks.")

    @field_validator("train", "eval")
    @classmethod
    def _data_location(cls, value: Any, info: Any) -> Any:
        if not isinstance(value, str):
            return value  # a list of sources: each MixSource resolves its own path
        return paths.data_location(_local(value, f"data.{info.field_name}"))

    @model_validator(mode="after")
    def _held_out_generated_rows(self) -> "DataConfig":
        # the same generator location on both sides must not evaluate on the training questions
        if self.eval and self.eval.startswith("reasoning_gym:") and self.eval_split is None:
            self.eval_split = "test"
        return self


class TrainingConfig(Section):
    precision: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16"] = Field(
        "auto", description="fp32; bf16-mixed / fp16-mixed: fp32 master weights and optimizer states, autocast "
                            "compute (fp16 with loss scaling, CUDA only); bf16: bf16 weights and compute. auto: "
                            "bf16-mixed where the hardware computes in bf16 (CUDA with bf16, CPU with AMX / "
                            "AVX512-BF16), else fp32; the run prints which and why.")
    packing: bool = Field(
        True, description="Padding-free training forwards: a micro-batch's rows packed end to end with position ids "
                          "restarting at 0 (same losses and gradients as padded, to float32 rounding). Used where a "
                          "first-use probe confirms the model keeps packed rows apart; else the padded forward.")
    shared_prefix: Literal["auto", "on", "off"] = Field(
        "auto", description="Online methods: the G completions of a prompt computed behind one copy of it in every "
                            "training forward (policy, reference, critic): one packed row [prompt | c1 | ... | cG] "
                            "with a 4D attention mask (each completion sees the prompt and itself), same log-probs, "
                            "values and gradients. auto: where a cost model says it saves work (long completions "
                            "behind short prompts can cost more dense attention than they save), split into smaller "
                            "segments when that is cheaper; on: always one segment per group; off: each row alone. "
                            "Used where a first-use probe confirms the model honours the mask (eager, sdpa), else "
                            "the plain forward.")
    compile: bool = Field(
        False, description="Run the training forwards' decoder layers (policy, reference, critic, SFT/DPO losses, "
                           "and so their backward) through torch.compile (TorchInductor; on CPU it needs a C++ "
                           "compiler). Lengths are traced as symbols, so packed rows of new lengths do not "
                           "recompile; each new variant (no-grad scoring, the shared-prefix mask, LoRA adapters "
                           "off) compiles once. Off by default: on the ~28M model on CPU it made the reference + "
                           "update 1.02-1.27x faster but compiled for 100-130 s on a cold cache, paying off after "
                           "24 steps at best (README, Speed). Not with model.gradient_checkpointing.")
    learning_rate: float | None = Field(
        None, gt=0, description="Peak learning rate (AdamW); unset: the method's default.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="Fraction of steps spent in linear warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(1.0, description="Clip the global gradient norm (None: no clipping).")
    epochs: int = Field(1, ge=1, description="Passes over the data (offline methods).")
    max_steps: int | None = Field(
        None, ge=1, description="Optimizer steps (online: rollout steps; offline: cap on epochs x steps).")
    batch_size: int = Field(16, ge=1, description="Examples per optimizer step (offline methods).")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Examples per forward pass; batch_size / micro_batch_size = gradient accumulation.")
    eval_every: int | None = Field(None, ge=1, description="Evaluate every N steps (and always at the end).")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads. Unset: torch's default, but at most the cores the 1-minute load "
                                "average leaves free (at least 1; printed at start): OpenMP threads spinning on a "
                                "busy core made steps 10-40x slower. Set above the free cores: a warning. Set it "
                                "for bitwise-reproducible runs (the count can change float summation order).")
    memory_limit_gb: float | None = Field(
        None, gt=0, description="Memory (GiB) the run may use. Before loading weights rlft plans the run's memory "
                                "against it (unset: the GPU's memory, or on CPU the available RAM, a memory cgroup's "
                                "limit (containers) and any RLIMIT_AS limit) and, if the plan does not fit, turns "
                                "on the cheapest of micro-batching, gradient checkpointing and smaller rollout "
                                "batches that fits; settings written in the config are kept. Nothing fits: an error "
                                "before loading.")
    max_consecutive_nonfinite: int = Field(
        3, ge=1, description="Stop after this many consecutive steps skipped for a non-finite loss/grad norm.")
    dist_timeout_s: float = Field(
        1800.0, gt=0, description="Distributed runs (torchrun): how long a rank waits for the others in a collective "
                                  "before the job stops with an error (a dead or hung rank); long enough for the "
                                  "slowest step, evaluation or checkpoint.")


class VllmSettings(Section):
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Engine weight dtype; 'auto': the run's rollout dtype (bf16 under bf16-mixed, "
                            "else the trainer's weights').")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="KV-cache size in bytes; None: gpu_memory_utilization decides on GPU, 1 GiB on CPU.")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="GPU memory fraction vLLM may take (weights + KV cache); the trainer shares the GPU.")
    enforce_eager: bool | None = Field(
        None, description="Run without CUDA graphs / compilation; None: eager on CPU, graphs on GPU.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine shards the model over (needs in_process=false).")
    in_process: bool = Field(
        True, description="Run vLLM's engine core in the trainer's process (fast weight push); false: worker processes.")
    sleep: bool = Field(
        False, description="GPU only: free the engine's KV cache and offload its weights while the trainer updates.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + completion the engine accepts; None: the checkpoint's limit.")
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged", description="LoRA: push the merged weights (plain model, faster rollouts on CPU) or the adapter "
                              "as a new LoRA request (vLLM's LoRA kernels; a cheaper push for large models).")


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine for rollouts.")
    group_size: int = Field(8, description="Completions sampled per prompt (G); at least 2.")
    prompts_per_step: int = Field(4, ge=1, description="Prompts per rollout step.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0: off).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: off).")
    max_new_tokens: int = Field(256, ge=1, description="Longest completion; reaching it is finish reason 'length'.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (end-of-turn and EOS always stop).")
    batch_size: int | None = Field(None, ge=1, description="Sequences generated per forward (default: all at once).")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="hf engine: the dtype rollouts compute in; auto: training's compute dtype (bf16 under "
                            "bf16-mixed). The engine/trainer log-prob gap this causes is logged "
                            "(rollout/logprob_diff_*). The vLLM engine: rollout.vllm.dtype.")
    fast_decode: bool = Field(
        True, description="hf engine: lean decode step for Llama/Qwen2/Mistral (falls back to the model's forward).")
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="rollout.engine=vllm settings.")
    async_steps: int = Field(
        0, ge=0, description="k: a sampler thread generates the next batches while the trainer trains, at most k "
                             "optimizer steps behind (batch j samples from the weights after exactly max(0, j-k) "
                             "steps, so a run does not depend on timing); 0: generate, then train, in turn. k > 0 "
                             "needs algorithm.rollout_correction (tis or bypass). Under torchrun each rank's "
                             "sampler samples its share of the prompts.")
    sampler: Literal["auto", "process", "thread"] = Field(
        "auto", description="With async_steps > 0 and the hf engine, where tokens are generated: 'process', an "
                            "HFEngine in a child process sampling from a shared-memory copy of the policy (its own "
                            "interpreter: no GIL shared with the trainer); 'thread', in the sampler thread of the "
                            "trainer's process. The sampler thread runs tools, rewards and the queue either way; "
                            "both give the same completions. auto: process on CPU in one process (faster there: "
                            "benchmarks/async_rollouts.py), thread on GPUs and under torchrun (process not tested "
                            "there yet). The vLLM engine runs its own workers (rollout.vllm).")
    sampler_device: str = Field(
        "auto", description="With async_steps > 0 and the hf engine, the device the sampler's copy of the policy "
                            "samples on: e.g. 'cuda:1' keeps generation (weights, KV cache) off the trainer's GPU "
                            "on a machine with several; each published version is copied to it. auto: the "
                            "trainer's device (model.device). One process only (under torchrun each rank samples "
                            "on its own GPU).")

    @field_validator("sampler_device", mode="before")
    @classmethod
    def _known_sampler_device(cls, value: Any) -> Any:
        return check_device(str(value), "rollout.sampler_device") if isinstance(value, (str, int)) else value

    @model_validator(mode="after")
    def _vllm_sampling(self) -> "RolloutConfig":
        if self.engine == "vllm":
            check_vllm_sampling(self.temperature, self.top_p, self.top_k, "rollout")
            if self.sampler == "process":
                raise ValueError("rollout.sampler=process runs the hf engine in a child process; the vLLM engine "
                                 "has its own worker processes (rollout.vllm): drop rollout.sampler or set it to auto")
        return self


# vLLM's largest accepted temperature
VLLM_MAX_TEMPERATURE = 2.0


def check_vllm_sampling(temperature: float, top_p: float, top_k: int, where: str) -> None:
    """What the vLLM engine cannot do the way the trainer needs it (see rlft.rollout.vllm_engine)."""
    if temperature > 0 and (top_p < 1.0 or top_k):
        raise ValueError(f"{where}: the vLLM engine reports log-probs renormalised over the top-p / top-k tokens, "
                         "which differ from the trainer's log_softmax(logits / temperature); set top_p=1.0 and "
                         "top_k=0, or use rollout.engine=hf")
    if temperature > VLLM_MAX_TEMPERATURE:
        raise ValueError(f"{where}.temperature={temperature}: the vLLM engine accepts at most "
                         f"{VLLM_MAX_TEMPERATURE} (vLLM's limit); lower it or use rollout.engine=hf")


AdvantageName = Literal["group_norm", "group_mean", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae",
                        "reverse_kl"]


class AlgorithmConfig(Section):
    """Online RL parts. Fields left unset are filled from the preset named by `method`."""

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
    """The value model of PPO (method: ppo); unused by the critic-free methods."""

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


class AgentConfig(Section):
    """Multi-turn rollouts with tools and/or an environment (online methods; either engine, any number
    of ranks): each assistant turn is sampled, its tool calls run, their results inserted (never
    trained on); a turn without calls is the environment's action, its observation inserted alike.
    Held-out evals, eval suites, `rlft eval` of the run and `rlft data screen` run episodes too.
    With method sft (the cold start on tool-use transcripts): `tools` and `parser` say how the
    rows are shown (the tools in the prompt, each call in the parser's syntax) and
    `max_tool_output_tokens` cuts results as rollouts do; the environment and the episode limits apply to
    rollouts only."""

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call: built-in 'calculator', or 'module:function' / 'file.py:function' "
                    "(type hints and a docstring with Args: give the schema the template shows).")
    environment: str | None = Field(
        None, description="What answers a turn without tool calls: 'module:Class' / 'file.py:Class' (reset(**row), "
                          "step(text) -> (observation, reward, done); see rlft/rollout/environments.py) or "
                          "'gem:<env id>' (gem-llm's games, e.g. gem:game:GuessTheNumber-v0-easy; pip install "
                          "'rlft[gem]'). One instance per episode, made as Class(seed=..., **environment_args).")
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the environment's class (for gem: gem.make).")
    max_turns: int = Field(4, ge=1, description="Assistant turns per episode (each at most rollout.max_new_tokens); "
                                                "a call on the last one is not run.")
    max_total_tokens: int = Field(
        1024, ge=1, description="One budget for everything after the prompt (sampled and tool tokens); an "
                                "observation that would fill it ends the episode as truncated.")
    max_tool_output_tokens: int = Field(256, ge=1, description="A tool result longer than this is cut, with a marker.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Time limit per tool call; a late call is an error result.")
    max_calls_per_turn: int = Field(4, ge=1, description="Calls run per turn; further ones get an error result.")
    check_drift: bool = Field(
        True, description="Re-render each finished episode through the template and log how many trained tokens "
                          "differ from it (agent/retokenize_drift): what re-tokenising would have trained on.")
    parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto", description="Tool-call syntax: hermes = <tool_call>{json}</tool_call> (Qwen, Hermes); llama3_json = "
                            "the whole turn is {\"name\": ..., \"parameters\": {...}} (Llama 3.1-3.3); auto picks "
                            "from the chat template (hermes when it names neither).")
    tools_prompt: str | None = Field(
        None, description="For a chat template without tool support: the system-prompt block that presents the "
                          "tools, with {schemas} (their JSON schemas, one a line), {signatures} (one "
                          "'name(arg: type): description' line a tool) and {syntax} (how the parser reads a call) "
                          "filled in; other braces stay as written. Default: the JSON schemas and the call syntax "
                          "(rollout/turns.py TOOLS_BLOCK). Templates with tool support present tools their own way.")
    on_tool_error: Literal["observe", "end"] = Field(
        "observe", description="A turn whose calls include a failed one: observe = the model reads the error results "
                               "and goes on; end = the episode ends there (finish 'stop', nothing inserted).")
    schedule: Literal["rounds", "continuous"] = Field(
        "rounds", description="How episodes share the engine: rounds = every live episode's next turn in one batch, "
                              "after the slowest tool call of the round (bitwise reproducible); continuous = each "
                              "turn joins the decode batch as soon as its episode's calls return, so a slow call "
                              "holds up only its own episode (faster with slow tools; the same sampling streams, but "
                              "which rows share a batch follows tool timing, so float rounding is not reproducible "
                              "bit for bit). The hf engine (LLaMA-family models; others keep rounds) or vLLM (each "
                              "turn a request added to the running engine).")

    @field_validator("environment")
    @classmethod
    def _environment_ref(cls, value: str | None) -> str | None:
        if value is None or value.startswith("gem:"):
            if value == "gem:":
                raise ValueError("agent.environment 'gem:' names no environment; write e.g. "
                                 "gem:game:GuessTheNumber-v0-easy")
            return value
        target, sep, attr = value.rpartition(":")
        if not sep or not target or not attr:
            raise ValueError(f"agent.environment {value!r}: write it as 'module:Class', 'path/file.py:Class' or "
                             "'gem:<env id>'")
        if target.endswith(".py"):
            _local(target, f"agent.environment {value!r}")
        return paths.function_ref(value)

    @model_validator(mode="after")
    def _tools_or_environment(self) -> "AgentConfig":
        if not self.tools and self.environment is None:
            raise ValueError("agent: give tools (agent.tools) or an environment (agent.environment), or both; "
                             "without either an episode is one turn (drop the agent section)")
        return self


class TeacherConfig(Section):
    """The teacher of on-policy distillation (method: distill): scores the student's own samples."""

    path: str = Field(description="The teacher's weights (local folder or hub id); its tokenizer must map every "
                                  "token as the student's does (checked at start-up).")

    @field_validator("path")
    @classmethod
    def _model_location(cls, value: str) -> str:
        return paths.existing(_local(value, "teacher.path"))


class RewardSpec(Section):
    fn: str = Field(description="Built-in name (math, exact_match, regex, json_fields, ...) or 'module:function' / 'file.py:function'.")
    name: str | None = Field(None, description="Component name in logs (default: derived from fn).")
    weight: float = Field(1.0, description="Weight in the weighted sum of components.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for a built-in reward's factory.")

    @field_validator("fn")
    @classmethod
    def _file_ref(cls, value: str) -> str:
        target, sep, _ = value.rpartition(":")
        if sep and target.endswith(".py"):
            _local(target, f"reward {value!r}")
        return paths.function_ref(value)

    @field_validator("args")
    @classmethod
    def _reward_model_args(cls, args: dict[str, Any], info: Any) -> dict[str, Any]:
        fn = info.data.get("fn")
        if fn not in ("reward_model", "reward_model_ensemble"):
            return args
        if isinstance(args.get("device"), str):
            check_device(args["device"], f"{fn} args.device")
        if fn == "reward_model" and isinstance(args.get("path"), str):  # weights: a folder or a hub id
            return {**args, "path": paths.existing(_local(args["path"], "reward_model args.path"))}
        members = args.get("paths")
        if fn == "reward_model_ensemble" and isinstance(members, list) and all(isinstance(p, str) for p in members):
            return {**args, "paths": [paths.existing(_local(p, f"reward_model_ensemble args.paths[{i}]"))
                                      for i, p in enumerate(members)]}
        return args

    @property
    def component(self) -> str:
        """The component's name in logs: `name`, else the function's name."""
        return self.name or self.fn.rpartition(":")[2]


class ScoringConfig(Section):
    max_workers: int = Field(8, ge=1, description="Reward calls run concurrently (threads; sandboxes are processes).")
    max_infra_error_rate: float = Field(
        0.5, ge=0, le=1, description="Stop when a step's share of unverifiable (None) rewards exceeds this.")
    timeout_s: float = Field(
        60.0, gt=0, description="Time limit of one reward call, from its start (a batch reward gets this per "
                                "sample); a call past it is unverifiable (None), counted as reward/timeouts and "
                                "warned about. 60 s is far above a rule reward's milliseconds and covers the code "
                                "reward's own bound (its program timeout, 10 s by default, + 5 s sandbox start-up, "
                                "twice when calls wait for a free sandbox); a shorter limit than a code reward "
                                "needs is refused at start-up.")
    max_consecutive_timeouts: int | None = Field(
        8, ge=1, description="Stop the run (with a checkpoint of the last completed step) when one reward's calls "
                             "time out this many times in a row: counted in the order the calls end, across steps, "
                             "and reset by any call of that reward that ends in time. null: never stop for this.")
    max_abs_reward: float | None = Field(
        1e4, gt=0, description="Largest |value| a reward call may return (each component and each part of a dict "
                               "reward). Verifiable rewards live in a small fixed range (0..1, -1..1); a value "
                               "like 1e9 is a bug in the reward (a raw count, a missing scale), and under Dr. GRPO "
                               "(no std division) it would make every update sign-only. A value beyond it is a "
                               "reward error, handled as on_reward_error says. null: no bound (non-finite values "
                               "are refused regardless).")
    on_reward_error: Literal["stop", "unverifiable"] = Field(
        "stop", description="A reward call that raises or returns something other than a float, None or a dict of "
                            "floats (NaN, inf, a string, a list): stop the run with one message naming the reward "
                            "and the row, or count the row as unverifiable (None; reward/errors, a warning).")


class LoggingConfig(LoggerSettings):
    log_every: int = Field(1, ge=1, description="Write metrics every N steps.")
    sample_every: int = Field(10, ge=1, description="Save sample completions every N steps (online).")
    num_samples: int = Field(4, ge=0, description="Completions saved per sampling step.")
    progress: bool = Field(True, description="Show a console progress bar.")


class CheckpointConfig(Section):
    every: int | None = Field(None, ge=1, description="Save a checkpoint every N steps (always at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept (older ones removed after a new one is complete).")
    keep_best: str | None = Field(
        None, description="Also keep the checkpoint with the best value of this metric (e.g. 'eval/accuracy').")
    best_mode: Literal["max", "min"] = Field("max", description="Whether a larger or smaller keep_best metric is better.")
    final: Literal["last", "best"] = Field(
        "last", description="Export the last weights as final/, or the best checkpoint by keep_best.")

    @model_validator(mode="after")
    def _best_needs_a_metric(self) -> "CheckpointConfig":
        if self.final == "best" and not self.keep_best:
            raise ValueError("checkpoint.final is 'best' but checkpoint.keep_best names no metric to choose it by "
                             "(e.g. checkpoint.keep_best=eval/accuracy)")
        return self


class SuiteSampling(Section):
    num_samples: int = Field(1, ge=1, description="Completions per prompt (k of pass@k and maj@k).")
    temperature: float = Field(0.0, ge=0, description="0: greedy; > 0: sampled.")
    max_new_tokens: int = Field(128, ge=1, description="Longest completion.")
    batch_size: int = Field(64, ge=1, description="Sequences generated per forward.")


class EvalSuite(Section):
    """One held-out set (`eval.suites: [...]` in a config)."""

    name: str = Field(description="Metric prefix: eval/<name>/...; letters, digits, '_', '-' and '.'.")
    data: str = Field(description="Prompt rows (.jsonl/.json/.parquet, a saved dataset or 'hf:NAME').")
    split: str = Field("train", description="Split of an 'hf:NAME' dataset.")
    rewards: list[RewardSpec] = Field(default_factory=list, description="Reward components (default: none).")
    correct_component: str | None = Field(
        None, description="Reward component that means 'correct' (default: the first).")
    correct_threshold: float = Field(1.0, description="A sample is correct when that component is >= this.")
    sampling: SuiteSampling = Field(default_factory=SuiteSampling)
    format_regex: str | None = Field(None, description="A completion is compliant when it stops and fully matches.")
    max_examples: int | None = Field(256, ge=1, description="Rows used (None: all).")
    every: int | None = Field(
        None, ge=1, description="Run every N steps (default: training.eval_every); always after the last step.")
    answer: str | None = Field(
        "math", description="maj@k answer extractor: 'math' (boxed / 'answer is' / last number), "
                            "'module:function' (completion -> answer or None), or null (no maj@k).")

    @field_validator("data")
    @classmethod
    def _data_location(cls, value: str) -> str:
        return paths.data_location(_local(value, "eval.suites[].data"))

    @field_validator("answer")
    @classmethod
    def _file_ref(cls, value: str | None) -> str | None:
        return None if value is None else paths.function_ref(value)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
            raise ValueError(f"eval suite name {value!r} must use letters, digits, '_', '-' or '.' only")
        return value

    def eval_config(self) -> EvalConfig:
        s = self.sampling
        return EvalConfig(max_examples=self.max_examples, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                          num_samples=s.num_samples, format_regex=self.format_regex,
                          correct_component=self.correct_component, correct_threshold=self.correct_threshold,
                          batch_size=s.batch_size)

    def due(self, step: int, total_steps: int, default_every: int | None = None) -> bool:
        every = self.every or default_every
        return step == total_steps or bool(every) and step % every == 0


class EvalConfig(Section):
    max_examples: int | None = Field(256, ge=1, description="Held-out rows used for generation metrics (None: all).")
    max_new_tokens: int = Field(128, ge=1, description="Longest completion when evaluating.")
    temperature: float = Field(0.0, ge=0, description="0: greedy; > 0: sampled.")
    num_samples: int = Field(1, ge=1, description="Completions per prompt (k for pass@k).")
    format_regex: str | None = Field(
        None, description="A completion is format-compliant when it stops cleanly and fully matches this regex.")
    correct_component: str | None = Field(
        None, description="Reward component that means 'correct' for accuracy (default: the first).")
    correct_threshold: float = Field(1.0, description="A sample is correct when that component is >= this.")
    batch_size: int = Field(64, ge=1, description="Sequences generated per forward when evaluating.")
    suites: list[EvalSuite] = Field(
        default_factory=list, description="Named held-out sets (target, retention, adversarial...), each with its "
                                          "own data, rewards and sampling; metrics eval/<name>/...")


class DpoConfig(Section):
    """Direct preference optimisation (method: dpo) on chosen/rejected pairs."""

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
    """Reward-model training (method: reward_model): a scalar head on a causal-LM checkpoint."""

    margin: float = Field(
        0.5, description="Bradley-Terry margin for rows without their own 'margin' field: chosen must win by it "
                         "(0.5-1.0 is the usual range; 0 is the plain Bradley-Terry loss).")
    center_coef: float = Field(
        0.0, ge=0, description="Reward centering: adds coef * (r_chosen + r_rejected)^2 per pair so scores stay "
                               "near zero (arXiv:2312.09244 uses 0.01); 0: off.")


class Config(Section):
    method: Method = Field("sft", description="Training method; online presets choose algorithm parts.")
    output_dir: str = Field(description="Run directory (created; resumable).")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    model: ModelConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rewards: list[RewardSpec] = Field(default_factory=list, description="Reward components (online methods).")
    agent: AgentConfig | None = Field(
        None, description="Multi-turn rollouts with tools and/or an environment (None: single-turn).")
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    teacher: TeacherConfig | None = Field(None, description="method: distill only: the model whose per-token "
                                                            "log-probs the student learns from.")
    dpo: DpoConfig = Field(default_factory=DpoConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    adopt_output_dir: bool = Field(
        False, description="Use an output_dir that holds other files and is not an rlft run directory "
                           "(its config.yaml, metrics.jsonl, summary.json and final/ would be overwritten).")

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, value: str) -> str:
        value = paths.absolute(_local(value, "output_dir"))
        problem = paths.name_length_problem(value, "output_dir")
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, values: Any) -> Any:
        """Resolve what depends on the method: the online preset's algorithm parts and the
        learning rate, so config.yaml states every value the run used."""
        if not isinstance(values, dict):
            return values
        method = values.get("method", "sft")
        algo = values.get("algorithm") or {}
        if method in PRESETS and isinstance(algo, dict):
            resolved = {**_BASE_PRESET, **PRESETS[method]}
            resolved.update({k: v for k, v in algo.items() if v is not None})
            values = {**values, "algorithm": resolved}
        training = values.get("training") or {}
        if method in METHOD_LEARNING_RATES and isinstance(training, dict) and training.get("learning_rate") is None:
            values = {**values, "training": {**training, "learning_rate": METHOD_LEARNING_RATES[method]}}
        return values

    @model_validator(mode="after")
    def _check_consistency(self) -> "Config":
        if self.model.quantization == "4bit":
            if not self.lora.enabled:
                raise ValueError("model.quantization=4bit: 4-bit weights cannot be trained directly; set "
                                 "lora.enabled: true")
            if self.method == "reward_model":
                raise ValueError("model.quantization=4bit is for causal-LM policies; reward-model training is not "
                                 "quantised; set model.quantization=none")
            if self.is_online and self.rollout.engine == "vllm":
                raise ValueError("model.quantization=4bit with rollout.engine=vllm: the trainer's 4-bit weights "
                                 "cannot be synced into vLLM; use rollout.engine=hf")
        if self.training.compile and self.model.gradient_checkpointing:
            # the recompute in backward runs the eager layer, which saves other tensors than the
            # compiled forward did: torch.utils.checkpoint stops with a metadata mismatch
            raise ValueError("training.compile with model.gradient_checkpointing: the compiled layers cannot be "
                             "recomputed in backward; set one of them to false (gradient checkpointing saves "
                             "memory, compile saves time)")
        if self.algorithm.sft_mix and not self.is_online:
            raise ValueError(f"algorithm.sft_mix adds an SFT loss to online RL; method {self.method} does not use it")
        if self.agent is not None:
            if not self.is_online and self.method != "sft":
                raise ValueError(f"agent: tools are used in online rollouts and in SFT on tool-use transcripts; "
                                 f"method {self.method} does neither (drop the agent section, or use sft or an "
                                 "online method such as grpo)")
        env_rewards = [r.component for r in self.rewards if r.fn == "environment"]
        if env_rewards and (self.agent is None or self.agent.environment is None):
            raise ValueError(f"rewards: {env_rewards[0]!r} (fn: environment) scores by an environment's rewards, "
                             "and agent.environment is not set; set it, or drop that reward")
        if self.eval.suites and self.method == "reward_model":
            raise ValueError("eval.suites evaluate a policy's generations; a reward model does not generate "
                             "(its held-out metrics come from data.eval)")
        self._check_distillation()
        if self.is_online:
            if self.rollout.group_size < 2 and self.method != "distill":  # distillation needs no group baseline
                raise ValueError(
                    f"rollout.group_size is {self.rollout.group_size}; group-relative methods need at least 2 "
                    "completions per prompt (8 or 16 is typical)")
            if not self.rewards:
                raise ValueError("rewards: an online method needs at least one reward component, e.g. "
                                 "rewards: [{fn: math}]")
            a = self.algorithm
            if a.dual_clip is not None and a.dual_clip <= 1:
                raise ValueError(f"algorithm.dual_clip must be > 1 (got {a.dual_clip}); null turns it off")
            if a.dual_clip is not None and a.policy_loss != "clipped":
                raise ValueError(f"algorithm.dual_clip bounds the token-level clipped surrogate; policy_loss "
                                 f"{a.policy_loss} has no such term (drop dual_clip)")
            if a.clip_low is not None and a.clip_low >= 1 and a.policy_loss != "cispo":
                raise ValueError(f"algorithm.clip_low={a.clip_low:g}: the ratio's lower bound is 1 - clip_low, which "
                                 "must lie in (0, 1), so clip_low must be in (0, 1) (PPO uses 0.2; only "
                                 "policy_loss=cispo may set 1, no lower bound on its weight)")
            if a.kl_target is not None and not a.kl_coef:
                raise ValueError(
                    f"algorithm.kl_target={a.kl_target} adapts beta multiplicatively, but beta starts at "
                    f"algorithm.kl_coef={a.kl_coef} (the {self.method} preset) and would stay 0. Set a starting "
                    "value, e.g. algorithm.kl_coef=0.01, or drop kl_target")
            if a.kl_controller == "proportional" and a.kl_target is None:
                raise ValueError(
                    "algorithm.kl_controller=proportional steers beta toward algorithm.kl_target, which is not set "
                    "(beta stays fixed at kl_coef without one). Set a target KL per token, e.g. "
                    "algorithm.kl_target=0.05, or drop kl_controller")
            if self.rollout.engine == "vllm":  # evaluations during training sample on the same engine
                check_vllm_sampling(self.eval.temperature, 1.0, 0, "eval")
                for suite in self.eval.suites:
                    check_vllm_sampling(suite.sampling.temperature, 1.0, 0, f"eval.suites[{suite.name}].sampling")
            _check_async(self)
            if a.loss_agg == "constant" and a.loss_constant is None:  # Dr. GRPO: the longest possible completion
                longest = self.agent.max_total_tokens if self.agent else self.rollout.max_new_tokens
                self.algorithm.loss_constant = longest
        return self

    def _check_distillation(self) -> None:
        if self.method == "distill":
            if self.teacher is None:
                raise ValueError("method: distill learns from a teacher's log-probs; set teacher.path to the "
                                 "teacher model (same tokenizer as model.path)")
            if self.algorithm.advantage != "reverse_kl":
                raise ValueError(f"method: distill takes its advantages from the teacher (advantage: reverse_kl); "
                                 f"algorithm.advantage={self.algorithm.advantage} would ignore it")
        elif self.teacher is not None:
            raise ValueError(f"teacher: is used by method distill only; method {self.method} would ignore it "
                             "(drop the teacher section, or set method: distill)")
        elif self.is_online and self.algorithm.advantage == "reverse_kl":
            raise ValueError("algorithm.advantage=reverse_kl needs a teacher: use method: distill with teacher.path")

    @property
    def is_online(self) -> bool:
        return self.method in ONLINE_METHODS

    @property
    def needs_reference(self) -> bool:
        """A reference model is built only when a KL term will use it."""
        if self.method == "dpo":
            return True
        return self.is_online and bool(self.algorithm.kl_coef)


def _check_async(config: Config) -> None:
    """What rollout.async_steps > 0 cannot be combined with, each with its reason."""
    k, a, r = config.rollout.async_steps, config.algorithm, config.rollout
    if r.sampler_device != "auto" and not k:
        raise ValueError(f"rollout.sampler_device={r.sampler_device}: a synchronous run (rollout.async_steps=0) "
                         "samples from the trainer's own module, on model.device; set rollout.async_steps=1 or "
                         "drop rollout.sampler_device")
    if r.sampler_device != "auto" and r.engine == "vllm":
        raise ValueError(f"rollout.sampler_device={r.sampler_device} places the hf engine's copy of the policy; "
                         "the vLLM engine places itself (its GPUs are those its process sees): drop "
                         "rollout.sampler_device")
    if not k:
        return
    if a.rollout_correction not in ("tis", "bypass"):
        raise ValueError(f"rollout.async_steps={k}: batches are sampled by weights up to {k} optimizer steps old, so "
                         "the loss must correct for it: set algorithm.rollout_correction to tis (truncated importance "
                         "weights) or bypass (the sampler's log-probs as pi_old)")
    if a.dynamic_sampling:
        raise ValueError(f"rollout.async_steps={k} with algorithm.dynamic_sampling (the {config.method} preset "
                         "turns it on): refilling dropped groups is not paced by policy version yet; set "
                         "algorithm.dynamic_sampling=false or rollout.async_steps=0")
    if config.model.quantization != "none":
        raise ValueError(f"rollout.async_steps={k} with model.quantization={config.model.quantization}: the sampler "
                         "samples from its own copy of the policy, which 4-bit weights cannot be copied into; set "
                         "rollout.async_steps=0")


DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")
# names other tools use for the same thing
_DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "cuda0": "cuda:0", "rocm": "cuda", "hip": "cuda"}


def check_device(value: str, field: str) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N'; anything else (a typo, 'gpu', 'mps', which rlft does not
    run on) is refused here, not as a traceback from torch when the model moves."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    lowered = value.strip().lower()
    guess = _DEVICE_ALIASES.get(lowered)
    if guess is None and (lowered in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", lowered)):
        guess = lowered
    if guess is None and re.fullmatch(r"(gpu|cuda)?:?\d+", lowered):  # gpu1, gpu:1, cuda1, 1
        guess = "cuda:" + re.sub(r"\D", "", lowered)
    if guess is None:
        found = difflib.get_close_matches(lowered, ["auto", "cpu", "cuda"], n=1, cutoff=0.5)
        guess = found[0] if found else None
    hint = f" Did you mean {guess!r}?" if guess else ""
    extra = " (Apple's mps is not supported: rlft trains on CPU or CUDA GPUs)" if lowered == "mps" else ""
    raise ValueError(f"{field}: unknown device {value!r}{extra}.{hint} Use one of: {', '.join(DEVICE_NAMES)}")


def _local(value: str, field: str) -> str:
    """`value` as a local path of this system; an empty one or a Windows-style path is refused."""
    if not value.strip():
        raise ValueError(f"{field} is empty; give a path")
    problem = paths.foreign_path_problem(value, field)
    if problem:
        raise ValueError(problem)
    return value


def config_warnings(config: Config) -> list[str]:
    """Settings that are valid but unusual enough to say so when a run starts."""
    out = []
    lr = config.training.learning_rate
    low, high = ONLINE_LR_RANGE
    if config.is_online and not low / 10 <= lr <= high * 10:
        out.append(f"training.learning_rate={lr:g} is far outside the {low:g}..{high:g} typical for online RL on "
                   "pretrained models (fine for a tiny model trained from scratch)")
    if config.is_online:
        for name in ("clip_low", "clip_high"):
            value = getattr(config.algorithm, name)
            # cispo clips a weight, not the update: its wide range is the point
            if value is not None and value > CLIP_WARN and config.algorithm.policy_loss != "cispo":
                out.append(f"algorithm.{name}={value:g} is above {CLIP_WARN}: one update can move token "
                           "probabilities far from the sampling policy (PPO uses 0.2, DAPO's clip-higher 0.28)")
        a = config.algorithm
        # a changed setting of a controller the run does not use (the preset fills both in)
        for name, controller in (("kl_horizon", "proportional"), ("kl_adapt_factor", "deadband")):
            value = getattr(a, name)
            if value == _BASE_PRESET[name] or (a.kl_target is not None and a.kl_controller == controller):
                continue
            why = ("beta is fixed without algorithm.kl_target" if a.kl_target is None else
                   f"algorithm.kl_controller is {a.kl_controller}")
            out.append(f"algorithm.{name}={value:g} has no effect: only adaptive KL with kl_controller={controller} "
                       f"uses it, and {why}")
    return out


# ---------------------------------------------------------------------------------------------
# Loading, overrides and readable errors


def load_config(source: str | Path | dict[str, Any], overrides: list[str] | None = None) -> Config:
    """Load a config from a YAML file (or a dict) and apply `a.b=value` overrides."""
    if isinstance(source, dict):
        raw, origin = copy.deepcopy(source), "config"  # overrides must not edit the caller's dict
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        raw = load_yaml(path.read_text(), path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
        origin = str(path)
    given: dict[str, str] = {}  # dotted key -> the override as written, to say where an error came from
    for item in overrides or []:
        apply_override(raw, item)
        given[item.partition("=")[0].strip()] = item
    return validate_config(raw, origin, given)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p for p in parts):
        raise ConfigError(f"bad override {item!r}: write it as section.key=value, e.g. training.learning_rate=1e-5")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"bad override {item!r}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate_config(raw: dict[str, Any], origin: str = "config", overrides: dict[str, str] | None = None) -> Config:
    """`overrides` (dotted key -> 'key=value' as given) lets an error name the command-line override
    it came from instead of blaming the file."""
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        in_file, on_command_line = [], []
        for err in exc.errors():
            text = _describe_error(err)
            item = _override_behind(err, text, overrides or {})
            if item is None:
                in_file.append(text)
            else:
                on_command_line.append(f"command-line override {item!r}: {text}")
        parts = []
        if in_file:
            parts.append(f"{origin}: invalid configuration\n" + "\n".join(f"  - {ln}" for ln in in_file))
        parts += on_command_line
        raise ConfigError("\n".join(parts)) from None


def _override_behind(err: dict[str, Any], text: str, overrides: dict[str, str]) -> str | None:
    """The override that set the field an error is about (the field itself, a section it replaced,
    or a key under a misspelt section); for errors of the whole config (cross-field checks), one
    whose key the message names."""
    path = ".".join(str(p) for p in err["loc"])
    for key, item in overrides.items():
        if path and (path == key or path.startswith(key + ".") or key.startswith(path + ".")):
            return item
    if not path:
        return next((item for key, item in overrides.items() if key in text), None)
    return None


def _describe_error(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        guess = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f" Did you mean '{'.'.join(loc[:-1] + [guess[0]])}'?" if guess else ""
        return f"{path}: unknown key.{hint} Valid keys here: {', '.join(valid)}"
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    expected = _EXPECTED.get(kind)
    got = err.get("input")
    if expected:
        return f"{path}: expected {expected}, got {got!r} ({type(got).__name__})"
    if kind == "literal_error":
        return f"{path}: {err['msg'].lower()}, got {got!r}"
    return f"{path}: {err['msg']} (got {got!r})"


_EXPECTED = {
    "float_parsing": "a number", "float_type": "a number", "int_parsing": "an integer", "int_type": "an integer",
    "int_from_float": "an integer", "bool_parsing": "true or false", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _valid_keys(loc: list[str]) -> list[str]:
    """Field names of the section at `loc` (list indices skipped)."""
    model: type[BaseModel] = Config
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _section_type(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def dump_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def validate_flags(section: type[BaseModel], values: dict[str, Any], flags: dict[str, str], prefix: str) -> Any:
    """A config section built from command-line flags, with the same checks as the config file;
    each error names its flag (`flags`: field -> '--flag') and the field it stands for."""
    try:
        return section.model_validate(values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            if field in flags:
                lines.append(f"{flags[field]} {err.get('input')!r}: {err['msg'][0].lower()}{err['msg'][1:]} "
                             f"({prefix}{field})")
            else:
                lines.append(_describe_error({**err, "loc": (prefix.rstrip("."), *err["loc"])}))
        raise ConfigError("\n".join(lines)) from None
