"""Whether a plan fits a device, and the single changes that would make it fit (`rlft plan`, the
memory fit)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlft.plan.memory import CUDA_CONTEXT, FRAGMENTATION, PlanInput, model_positions, plan_memory, size_text


@dataclass(frozen=True)
class Verdict:
    device: str
    capacity: int
    total: int
    context: int = CUDA_CONTEXT  # 0 for host RAM: no CUDA context to hold

    @property
    def usable(self) -> int:
        """What a training process can count on: the CUDA context and the allocator's slack excluded."""
        return int(max(self.capacity - self.context, 0) * (1 - FRAGMENTATION))

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def text(self) -> str:
        gap = self.usable - self.total
        head = f"{self.device}: {size_text(self.capacity)}, about {size_text(self.usable)} usable"
        if self.fits:
            return f"fits on {head}; {size_text(gap)} headroom"
        return f"does NOT fit on {head}; {size_text(-gap)} short"


@dataclass(frozen=True)
class Advice:
    change: str
    total: int  # the plan's peak with this change
    fits: bool


def advise(model_config: Any, setting: PlanInput, capacity: int, context: int = CUDA_CONTEXT) -> list[Advice]:
    """Each single change that lowers the peak, with the peak it gives, largest effect first
    (`context`: what the device holds besides the run, as in `Verdict`)."""
    s = setting
    options: list[tuple[str, PlanInput]] = []
    if not s.lora:
        options.append((f"LoRA (r={s.lora_r}, all linear layers)", replace(s, lora=True)))
    if s.quantization == "none" and s.method != "reward_model" and s.world_size == 1 and s.engine == "hf":
        options.append(((f"QLoRA: LoRA (r={s.lora_r}) on a " if not s.lora else "a ") + "4-bit base "
                        "(model.quantization=4bit)", replace(s, lora=True, quantization="4bit",
                                                             param_dtype="fp32", precision="fp32")))
    if not s.gradient_checkpointing:
        options.append(("gradient checkpointing", replace(s, gradient_checkpointing=True)))
    if s.precision == "fp32":
        options.append(("bf16 compute, fp32 master weights (training.precision=bf16-mixed)",
                        replace(s, precision="bf16-mixed")))
    if s.precision in ("fp32", "bf16-mixed"):
        options.append(("pure bf16 weights and states (training.precision=bf16)",
                        replace(s, precision="bf16", param_dtype="bf16")))
    if s.micro_batch_size > 1:
        micro = s.micro_batch_size // 2
        options.append((f"micro-batch {s.micro_batch_size} -> {micro} (same batch, accumulated)",
                        replace(s, micro_batch_size=micro, batch_size=s.batch_size or s.micro_batch_size)))
    if s.online and s.group_size > 2:
        g = max(2, s.group_size // 2)
        options.append((f"group size G {s.group_size} -> {g}", replace(
            s, group_size=g, batch_size=None if s.batch_size is None else max(1, s.batch_size * g // s.group_size),
            micro_batch_size=max(1, min(s.micro_batch_size, s.micro_batch_size * g // s.group_size)))))
    rows = s.group_size * s.prompts_per_step
    if s.online and s.engine == "hf" and (s.rollout_batch_size or rows) > 1:
        half = max(1, (s.rollout_batch_size or rows) // 2)
        options.append((f"generate {half} sequences at a time (rollout.batch_size)",
                        replace(s, rollout_batch_size=half)))
    if s.quantization == "none":
        options.append((f"{s.world_size * 2} ranks (FSDP sharding)", replace(s, world_size=s.world_size * 2)))
    if s.servers and s.world_size > 1:  # each rank's whole copy for the servers can cost more than sharding saves
        options.append(("one trainer rank (no whole copy of the policy per rank)", replace(s, world_size=1)))
    if s.seq_len > 2:
        positions = model_positions(model_config)
        # never a length the model has no positions for (a halved 100,010 is still 50,005)
        seq = s.seq_len // 2 if positions is None else min(s.seq_len // 2, positions)
        options.append((f"max length {s.seq_len} -> {seq} tokens",
                        replace(s, seq_len=seq, completion_len=max(1, s.completion_len * seq // s.seq_len))))
    base = plan_memory(model_config, s).total
    out = []
    for change, new in options:
        total = plan_memory(model_config, new).total
        if total < base:
            out.append(Advice(change, total, Verdict("", capacity, total, context).fits))
    return sorted(out, key=lambda a: a.total)
