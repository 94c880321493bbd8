"""The optimizer, schedule, precision and threads (`training`), and `checkpoint`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlft.config.section import Section


class TrainingConfig(Section):
    """The optimization every method shares: AdamW and its learning-rate schedule, gradient clipping, how long
    to train (epochs for offline methods, `max_steps`), batch sizes and micro-batching, evaluation cadence,
    numeric precision, forward-pass speed-ups (packing, shared prefix, compile), CPU threads and the memory
    budget. An online step's size is set by `rollout` instead of `batch_size`. See
    guides/precision-and-memory.md."""

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
                           "24 steps at best (performance.md). Not with model.gradient_checkpointing.")
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


class CheckpointConfig(Section):
    """When checkpoints are written (every N steps and always at the end), how many are kept, whether the best
    one by a logged metric is kept too, and whether `final/` is exported from the last weights or from that
    best checkpoint. `rlft train --resume RUN` continues from the newest intact checkpoint. See
    guides/resume.md#when-checkpoints-are-written."""

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
