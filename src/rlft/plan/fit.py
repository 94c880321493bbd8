"""Defaults that fit: before any weight loads, `rlft train` plans the run's memory for its device and,
when the plan does not fit, turns on the cheapest set of memory savers that makes it fit.

The budget (`run_budget`): `training.memory_limit_gb` when set; else a CUDA GPU's memory (less the
CUDA context); else on CPU the least of: the host's available RAM and what the process's memory
cgroup still allows (a container's `--memory`, a Kubernetes limit, a systemd slice), each less
`RSS_RESERVE`, and what is left of an address-space limit (RLIMIT_AS, `ulimit -v`) less
`VIRTUAL_RESERVE`. The plan must fit in 90% of it (the allocator's fragmentation, as
`plan.Verdict`); against RAM or a cgroup, with `SLACK_LAYERS` layers' activations of one
micro-batch beside it (what the allocator keeps resident grows with what a micro-batch allocates).

The savers, each used only where the config leaves it at its default (a value written in the
config, even the default one, is never changed), with a rough cost in extra step time:
- micro-batching the update (`algorithm.micro_batch_size` online, `training.micro_batch_size`
  offline), halved down to 1: the same loss and gradient (global normalisers); one more pass over
  the weights per micro-batch, which costs little while a micro-batch still holds enough tokens to
  keep the matmuls busy. On CPU: +1% per extra micro-batch of at least `BUSY_TOKENS` tokens,
  measured (benchmarks/README.md, the memory fit): the ~28M model's GRPO step of 32 rows x 146
  tokens, 10.9 s in one micro-batch under bf16-mixed, took +0.3 s in micro-batches of 8, +0.5 s in
  4 and +1.4 s in 2 (292 tokens each); thinner ones, not measured, and every extra micro-batch on
  a GPU (which needs far more tokens to be busy; not measured yet): +5%;
- activation checkpointing (`model.gradient_checkpointing`): each layer's forward runs twice: +33%;
- sampling in smaller batches (`rollout.batch_size`, hf engine), halved: decoding is bound by
  reading the weights, so each extra batch costs about another decode pass: +50% each.
The fitting combination with the least cost is chosen (ties: the smaller peak). The output head
needs no switch: it always works on blocks of logits (`rlft.models.head_logprobs`).
"""

from __future__ import annotations

import itertools
import resource
from dataclasses import dataclass, field, replace
from typing import Any

from rlft.config import Config
from rlft.errors import RlftError
from rlft.models.precision import resolve_precision
from rlft.plan.inputs import check_positions, plan_input_from_config, read_model_config
from rlft.plan.lengths import data_lengths
from rlft.plan.advice import Verdict, advise
from rlft.plan.memory import CUDA_CONTEXT, micro_batch_layer_bytes, plan_memory, size_text

GiB = 2**30
# Under RLIMIT_AS every mapping counts, not only live tensors: libraries mapped after this check,
# thread stacks, glibc's malloc arenas, the heap it does not give back, oneDNN's bf16 scratch. Measured
# on CPU: ~28M-model GRPO in fp32 (benchmarks/memory_fit_demo.py) peaked 0.82-1.06 GiB above the
# address space at this check plus the plan; the bench's large-full-defaults in bf16-mixed under a
# 4 GiB limit died with 1.5 GiB reserved (plan 1.60 GiB, 0.62 GiB mapped at the check: > 1.78 GiB
# above) and completed with checkpointing chosen at 2.5 GiB. So: 1.5 GiB in fp32, 2.5 GiB when the
# CPU computes in bf16.
VIRTUAL_RESERVE = 3 * GiB // 2
VIRTUAL_RESERVE_BF16 = 5 * GiB // 2
# Resident memory the plan's live tensors do not count: the runtime's growth after the check (the
# weights' loaders, oneDNN's primitive cache) and the allocator's free-but-resident pages, which grow
# with what one micro-batch allocates. Measured on the ~28M GRPO run (benchmarks/README.md, the memory
# fit), peak RSS less the RSS at the check less the plan, against one layer's saved activations for
# one micro-batch (A: 0.124 GiB for 32 rows x 146 tokens in bf16-mixed, 0.189 in fp32), with the RSS
# at the check taken as 300 MiB: bf16-mixed 1.27 GiB at 32 rows (1.33 with checkpointing), 0.87-1.09
# GiB at 4-8 rows; fp32 0.60 / 0.45 / 0.29 GiB at 32 / 8 / 4 rows; in a 2 GiB cgroup (its usage at
# the check instead of the RSS) 0.83 GiB at 4 rows. Kept: RSS_RESERVE(_BF16) + SLACK_LAYERS x A.
RSS_RESERVE = 2 * GiB // 5
RSS_RESERVE_BF16 = 9 * GiB // 10
SLACK_LAYERS = 4
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63
COST_MICRO, COST_THIN_MICRO, COST_CHECKPOINT, COST_ROLLOUT_SPLIT = 0.01, 0.05, 0.33, 0.5
BUSY_TOKENS = 256  # tokens per micro-batch from which one more pass over the weights is cheap (CPU)
# Keeping the heap's freed pages (no trim between an online step's phases) added up to ~0.2 GiB to the
# peak RSS of the ~28M GRPO run (bf16-mixed; fp32 none) and saved 15-25% of its step time: done when
# the plan takes at most this share of the usable memory, so even a much larger allocator slack fits.
ROOMY_SHARE = 0.5


@dataclass(frozen=True)
class Budget:
    label: str
    capacity: int  # bytes the run may use
    context: int = 0  # of which held by something else (the CUDA context)
    resident: bool = False  # host RAM or a cgroup: the allocator's slack (SLACK_LAYERS) counts too


@dataclass
class Fit:
    """The outcome: `config` to run with (the given one when nothing changed), what changed and why."""

    config: Config
    changes: dict[str, Any] = field(default_factory=dict)  # dotted field -> the value chosen
    message: str = ""
    record: dict[str, Any] = field(default_factory=dict)  # for summary.json
    # the plan uses at most ROOMY_SHARE of the usable memory: the C heap may keep freed pages
    # (training.host_memory) instead of handing them back between phases
    roomy: bool = False


def _proc_bytes(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file, in bytes (None where there is no such file or line)."""
    try:
        for line in open(path):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _meminfo_available() -> int | None:
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def _virtual_size() -> int:
    """This process's mapped address space now (VmSize), bytes."""
    return _proc_bytes("/proc/self/status", "VmSize") or 0


def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat(path: str) -> dict[str, int]:
    """A cgroup `memory.stat` file as {name: value} (empty where unreadable)."""
    out = {}
    try:
        for line in open(path):
            name, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[name] = int(value)
    except OSError:
        pass
    return out


def cgroup_memory_left(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup (and its ancestors) still allow it to take: the limit
    less the usage, the inactive page cache counted as free (the kernel reclaims it first); None
    where no cgroup limits memory. cgroup v2 (`memory.max`, `memory.current`) and v1
    (`memory.limit_in_bytes`, `memory.usage_in_bytes`)."""
    try:
        lines = open(proc_cgroup).read().splitlines()
    except OSError:
        return None
    lefts = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: every ancestor's memory.max binds
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                d = "/".join([root, *parts[:depth]])
                limit, usage = _read_int(f"{d}/memory.max"), _read_int(f"{d}/memory.current")
                if limit is not None and usage is not None:
                    lefts.append(limit - usage + _stat(f"{d}/memory.stat").get("inactive_file", 0))
        elif "memory" in controllers.split(","):  # v1: the stat file has the limit over the hierarchy
            d = f"{root}/memory{path.rstrip('/')}"
            stat = _stat(f"{d}/memory.stat")
            limit = stat.get("hierarchical_memory_limit") or _read_int(f"{d}/memory.limit_in_bytes")
            usage = _read_int(f"{d}/memory.usage_in_bytes")
            if limit is not None and usage is not None and limit < _UNLIMITED:
                lefts.append(limit - usage + stat.get("total_inactive_file", 0))
    return max(min(lefts), 0) if lefts else None


def address_space_left(reserve: int = VIRTUAL_RESERVE) -> int | None:
    """What an RLIMIT_AS soft limit leaves for the run, `reserve` kept for mappings (None: no limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(soft - _virtual_size() - reserve, 0)


def _reserves(config: Config, device: Any) -> tuple[int, int]:
    """(address space, resident memory) to keep beside the plan on this CPU."""
    try:
        bf16 = resolve_precision(config.training.precision, config.model.dtype, device).name in ("bf16-mixed", "bf16")
    except RlftError:  # reported when the run starts
        bf16 = False
    return (VIRTUAL_RESERVE_BF16, RSS_RESERVE_BF16) if bf16 else (VIRTUAL_RESERVE, RSS_RESERVE)


def run_budget(config: Config, device: Any, local_ranks: int = 1) -> Budget | None:
    """The memory one rank of this run may use on `device` (a torch.device), or None when unknown.
    On CPU the `local_ranks` ranks of this machine share its RAM, each holding its own plan."""
    limit = config.training.memory_limit_gb
    if limit is not None:
        return Budget(f"training.memory_limit_gb={limit:g}", int(limit * GiB))
    if device.type == "cuda":
        import torch

        return Budget(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory,
                      CUDA_CONTEXT)
    if device.type != "cpu":
        return None
    reserve, rss_reserve = _reserves(config, device)
    split = f" split over {local_ranks} ranks" if local_ranks > 1 else ""
    budgets = []  # the ranks of this machine share its RAM and its cgroup; each has its own RLIMIT_AS
    cgroup = cgroup_memory_left()
    for name, free, left_note in (("this machine's available RAM", _meminfo_available(), ""),
                                  ("the memory cgroup's limit", cgroup, f"{(cgroup or 0) / GiB:.1f} GiB left, ")):
        if free is not None:
            budgets.append(Budget(f"{name}{split} ({left_note}{rss_reserve / GiB:g} GiB kept for the runtime)",
                                  max(free - rss_reserve, 0) // local_ranks, resident=True))
    left = address_space_left(reserve)
    if left is not None:
        budgets.append(Budget(f"the address-space limit (RLIMIT_AS; {left / GiB:.1f} GiB left after "
                              f"{reserve / GiB:g} GiB reserved for mappings)", left))
    return min(budgets, key=lambda b: b.capacity) if budgets else None


@dataclass(frozen=True)
class _Option:
    changes: dict[str, Any]
    setting: Any  # PlanInput
    cost: float


def _options(config: Config, base: Any) -> list[_Option]:
    """Every combination of the savers the config leaves free, with its cost."""
    online = config.is_online
    gc_free = ("gradient_checkpointing" not in config.model.model_fields_set and not config.model.gradient_checkpointing
               and not config.training.compile)  # compiled layers cannot be recomputed (config.py)
    micro_free = (config.algorithm.micro_batch_size if online else config.training.micro_batch_size) is None
    micro_key = "algorithm.micro_batch_size" if online else "training.micro_batch_size"
    rows = base.batch_size or base.micro_batch_size
    micros = [base.micro_batch_size]
    if micro_free:
        m = base.micro_batch_size
        while m > 1:
            m = (m + 1) // 2
            micros.append(m)
    gen_rows = base.group_size * base.prompts_per_step
    rollouts: list[int | None] = [base.rollout_batch_size]
    if online and config.rollout.engine == "hf" and config.rollout.batch_size is None:
        r = gen_rows
        while r > 1:
            r = (r + 1) // 2
            rollouts.append(r)
    out = []
    for gc, micro, gen in itertools.product([False, True] if gc_free else [base.gradient_checkpointing],
                                            micros, rollouts):
        changes: dict[str, Any] = {}
        cost = 0.0
        if gc and gc_free:
            changes["model.gradient_checkpointing"] = True
            cost += COST_CHECKPOINT
        if micro != base.micro_batch_size:
            changes[micro_key] = micro
            busy = base.device_type == "cpu" and micro * base.seq_len >= BUSY_TOKENS
            per_pass = COST_MICRO if busy else COST_THIN_MICRO
            cost += per_pass * (-(-rows // micro) - -(-rows // base.micro_batch_size))
        if gen != base.rollout_batch_size:
            changes["rollout.batch_size"] = gen
            cost += COST_ROLLOUT_SPLIT * (-(-gen_rows // gen) - 1)
        setting = replace(base, gradient_checkpointing=gc, micro_batch_size=micro, batch_size=rows,
                          rollout_batch_size=gen)
        out.append(_Option(changes, setting, cost))
    return out


def _apply(config: Config, changes: dict[str, Any]) -> Config:
    sections: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return config.model_copy(update={s: getattr(config, s).model_copy(update=v) for s, v in sections.items()})


def _describe(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def _pinned(config: Config) -> list[str]:
    """Savers the config sets itself, named for messages."""
    out = []
    if "gradient_checkpointing" in config.model.model_fields_set and not config.model.gradient_checkpointing:
        out.append("model.gradient_checkpointing=false")
    micro = config.algorithm.micro_batch_size if config.is_online else config.training.micro_batch_size
    if micro is not None:
        out.append(f"{'algorithm' if config.is_online else 'training'}.micro_batch_size={micro}")
    if config.is_online and config.rollout.batch_size is not None:
        out.append(f"rollout.batch_size={config.rollout.batch_size}")
    return out


def fit_memory(config: Config, world: Any, device: Any, local_ranks: int | None = None,
               world_size: int | None = None) -> Fit:
    """The config this run trains with: `config` itself when its plan fits the budget (or the plan or
    budget is unknown), else with the cheapest savers that fit. Raises RlftError, before any weight
    loads, when nothing fits or the sequences are longer than the model's positions (check_positions).
    `local_ranks`: ranks on this machine (default: torchrun's LOCAL_WORLD_SIZE) and `world_size`
    (default: the world's): the launcher passes --nproc for both to check before starting the ranks."""
    import os


    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    budget = run_budget(config, device, local_ranks)
    if budget is not None:
        # every rank must choose the same settings: plan for the smallest budget of them all
        capacity = int(-world.max([-budget.capacity])[0]) if world.active else budget.capacity
        budget = replace(budget, capacity=capacity)
    try:
        model_cfg = read_model_config(config.model.path, config.model.revision, config.model.trust_remote_code)
    except RlftError:
        return Fit(config)  # loading reports an unreadable model
    lengths = data_lengths(config)
    check_positions(config, model_cfg, lengths)  # with or without a memory budget
    if budget is None:
        return Fit(config)
    try:
        base = plan_input_from_config(config, world_size or world.size, device, lengths=lengths)

        def slack(setting: Any) -> int:  # in RAM, what the allocator keeps resident beside the plan
            return SLACK_LAYERS * micro_batch_layer_bytes(model_cfg, setting) if budget.resident else 0

        def need(setting: Any) -> int:
            return plan_memory(model_cfg, setting).total + slack(setting)

        base_total = need(base)
        slack_note = f" (with {size_text(slack(base))} of allocator slack)" if budget.resident else ""
    except (RlftError, ValueError):
        return Fit(config)  # loading reports an unreadable model; the planner knows Llama-family decoders only
    verdict = Verdict(budget.label, budget.capacity, base_total, budget.context)
    length_note = lengths.describe(config) if lengths is not None else "lengths: worst case (the data was not read)"
    record = {"budget": budget.label, "budget_gib": round(budget.capacity / GiB, 4),
              "usable_gib": round(verdict.usable / GiB, 4), "planned_gib": round(base_total / GiB, 4),
              "lengths": length_note}
    if verdict.fits:
        roomy = base_total <= ROOMY_SHARE * verdict.usable
        return Fit(config, record={**record, "fits": True, "changes": {}, "keeps_freed_pages": roomy}, roomy=roomy)
    planned = [(option, need(option.setting)) for option in _options(config, base)]
    fitting = [(option.cost, total, option) for option, total in planned
               if Verdict("", budget.capacity, total, budget.context).fits]
    pinned = _pinned(config)
    if not fitting:
        smallest, least = min(planned, key=lambda p: (p[1], p[0].cost))
        fixes = [a for a in advise(model_cfg, smallest.setting, budget.capacity, budget.context) if a.fits][:3]
        lines = [f"memory plan: this run needs about {size_text(base_total)} at the peak{slack_note}, and still "
                 f"{size_text(least)} with the memory savers rlft may turn on"
                 + (f" (the least: {_describe(smallest.changes)})" if smallest.changes else " (none left free)")
                 + f"; {budget.label} leaves about {size_text(verdict.usable)} usable. Stopped before loading "
                 "the weights.", f"  ({length_note})"]
        if pinned:
            lines.append(f"  set in the config, so left as is: {', '.join(pinned)}")
        if fixes:
            lines.append("Fix, one of:")
            lines += [f"  - {a.change}: {size_text(a.total)} (fits)" for a in fixes]
        else:
            lines.append("Fix: a smaller model, LoRA, shorter sequences or a machine with more memory")
        lines.append(f"  details: rlft plan CONFIG --memory-gb {budget.capacity / GiB:.4g}")
        raise RlftError("\n".join(lines))
    cost, total, best = min(fitting, key=lambda f: (f[0], f[1]))
    message = (f"memory: the plan needs {size_text(base_total)} at the peak{slack_note}, more than the "
               f"{size_text(verdict.usable)} "
               f"usable of {budget.label}; turned on {_describe(best.changes)}: {size_text(total)} "
               f"(the cheapest set that fits, about +{cost:.0%} step time)")
    if pinned:
        message += f"; left as set in the config: {', '.join(pinned)}"
    return Fit(_apply(config, best.changes), best.changes, message,
               {**record, "fits": False, "changes": best.changes, "fitted_gib": round(total / GiB, 4),
                "reason": message})
