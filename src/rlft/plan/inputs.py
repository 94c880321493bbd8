"""What the planner needs from a training config: the model's config.json (read without loading a
weight), the run's precision and lengths as the run will resolve them, and the report `rlft plan`
prints for a device."""

from __future__ import annotations

from typing import Any

from rlft.config import Config
from rlft.errors import ConfigError, RlftError
from rlft.models.hub import hub_source
from rlft.models.precision import resolve_precision
from rlft.plan.lengths import data_lengths, worst_case_note
from rlft.plan.advice import Verdict, advise
from rlft.plan.memory import (
    POSITION_KEYS,
    PlanInput,
    device_capacity,
    model_positions,
    plan_memory,
    size_text,
)
from rlft.plan.servers import ServerInput, plan_server


def plan_precision(config: Config, local_device: Any = None) -> str:
    """The run's training precision as the planner counts it: training.precision 'auto' resolved
    for `local_device` (a torch.device: the run's own), or, when planning for a named device, as
    bf16-mixed (every device the planner knows computes in bf16)."""
    if local_device is not None:
        return resolve_precision(config.training.precision, config.model.dtype, local_device).name
    if config.model.dtype in ("bf16", "fp16") and config.training.precision in ("auto", config.model.dtype):
        return config.model.dtype
    return "bf16-mixed" if config.training.precision == "auto" else config.training.precision


def _sampler_elsewhere(config: Config) -> bool:
    """rollout.sampler_device names another device than model.device (what the sampler holds is
    then planned apart from the trainer's device). 'cuda' is cuda:0: a sampler device is one
    process's, where rlft leaves the current GPU at 0."""
    import torch

    named, trainer = config.rollout.sampler_device, config.model.device
    if named == "auto":
        return False
    if trainer == "auto":  # the plan's device: CUDA when one is visible
        trainer = "cuda" if torch.cuda.is_available() else "cpu"
    return {"cuda": "cuda:0"}.get(named, named) != {"cuda": "cuda:0"}.get(trainer, trainer)


def plan_input_from_config(config: Config, world_size: int = 1, local_device: Any = None, lengths: Any = None) -> Any:
    """The planner's flat settings for an rlft config: lengths from `lengths` (a
    plan_lengths.DataLengths: the longest templated row of the data, plus max_new_tokens online) or
    else the worst case (max prompt + max new tokens; every SFT token a target), the run's precision
    (see plan_precision: fp32 master weights and AdamW states under *-mixed; fp32 around a 4-bit
    base) and torch's foreach AdamW as on a GPU."""
    d, t, r, a = config.data, config.training, config.rollout, config.algorithm
    precision = plan_precision(config, local_device)
    # pure bf16 keeps bf16 weights; fp32 and the mixed modes keep fp32 ones
    param_dtype = precision if precision in ("bf16", "fp16") else "fp32"
    if config.model.quantization == "4bit":
        # peft's prepare_model_for_kbit_training upcasts every unquantised weight to fp32, and the
        # hidden states between the 4-bit linears follow them
        precision = param_dtype = "fp32"
    common = dict(lora=config.lora.enabled, lora_r=config.lora.r, lora_dropout=config.lora.dropout,
                  lora_targets=config.lora.target_modules if isinstance(config.lora.target_modules, str)
                  else tuple(config.lora.target_modules),
                  param_dtype=param_dtype, precision=precision, quantization=config.model.quantization,
                  gradient_checkpointing=config.model.gradient_checkpointing,
                  attention="eager" if config.model.attn_implementation == "eager" else "sdpa",
                  world_size=world_size,
                  **({"device_type": local_device.type} if local_device is not None and
                     local_device.type in ("cuda", "cpu") else {}))
    if config.is_online:
        per_minibatch = max(1, r.group_size * r.prompts_per_step // world_size // a.minibatches)
        seq_len = lengths.sequence if lengths is not None else d.max_prompt_length + r.max_new_tokens
        return PlanInput(method="ppo" if config.method == "ppo" else "online", **common,
                         micro_batch_size=min(a.micro_batch_size or per_minibatch, per_minibatch),
                         batch_size=per_minibatch, seq_len=seq_len,
                         completion_len=r.max_new_tokens, group_size=r.group_size, prompts_per_step=r.prompts_per_step,
                         rollout_batch_size=r.batch_size, reference=a.kl_coef > 0 or a.kl_target is not None,
                         critic=config.critic.kind, engine=r.engine, fast_decode=r.fast_decode,
                         shared_prefix=t.shared_prefix, async_steps=r.async_steps,
                         sampler_elsewhere=_sampler_elsewhere(config), servers=bool(r.servers),
                         server_lora_sync=r.server.lora_sync)
    micro = t.micro_batch_size or t.batch_size
    if lengths is not None:
        seq_len, targets = lengths.sequence, max(1, min(lengths.targets, lengths.sequence))
    else:
        seq_len, targets = d.max_length, d.max_length - 1 if config.method == "dpo" else d.max_length
    return PlanInput(method=config.method, **common, micro_batch_size=micro, batch_size=t.batch_size,
                     seq_len=seq_len, completion_len=targets,
                     reference=config.method == "dpo" and not config.dpo.precompute_ref)


def server_input_from_config(config: Config, setting: PlanInput) -> ServerInput | None:
    """The servers of an online run with `rollout.servers` (None without): their count, the
    tensor-parallel size and memory share `rlft serve` was given (rollout.server), a step's
    sequences, and the adapter rank when LoRA sends adapters."""
    r = config.rollout
    if not (config.is_online and r.servers):
        return None
    adapters = config.lora.enabled and r.server.lora_sync == "adapter"
    return ServerInput(count=len(r.servers), tensor_parallel=r.server.tensor_parallel_size,
                       gpu_memory_utilization=r.server.gpu_memory_utilization,
                       sequences=r.prompts_per_step * r.group_size, seq_len=setting.seq_len,
                       lora_r=config.lora.r if adapters else None, lora_targets=setting.lora_targets)


def read_model_config(path: str, revision: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """config.json of a local folder or a hub id (only that file is read)."""
    source = hub_source(path, revision, "model.path")  # before the transformers import (seconds)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code).to_dict()
    except (OSError, ValueError) as exc:
        raise RlftError(f"could not read the model's config.json from {path!r}: {exc}\n"
                        "Fix: model.path must be a local checkpoint folder or a reachable hub id") from None


def check_positions(config: Config, model_cfg: dict[str, Any], lengths: Any = None) -> None:
    """Raise a ConfigError, before any weight loads, when the run's sequences can be longer than the
    model has positions for (config.json's max_position_embeddings): online, the prompt (the longest
    one `lengths` measured, else data.max_prompt_length) + rollout.max_new_tokens (with an agent:
    agent.max_total_tokens, the episode's budget after the prompt); offline, data.max_length. Past
    its positions a model either fails mid-run or, with rotary positions, samples and trains on
    garbage without a word."""
    limit = model_positions(model_cfg)
    if limit is None:
        return
    key = next(k for k in POSITION_KEYS if model_cfg.get(k) == limit)
    where = f"the model's {limit} positions ({key} in {config.model.path}/config.json)"
    d = config.data
    if not config.is_online:
        if d.max_length > limit:
            raise ConfigError(f"data.max_length={d.max_length} is more than {where}: a row that long would run "
                              f"past them.\nFix: data.max_length={limit} or less")
        return
    if lengths is not None:
        prompt, prompt_text = lengths.prompt, f"the longest prompt in the data ({lengths.prompt} tokens)"
    else:
        prompt, prompt_text = d.max_prompt_length, f"data.max_prompt_length={d.max_prompt_length}"
    field, after = (("agent.max_total_tokens", config.agent.max_total_tokens) if config.agent is not None
                    else ("rollout.max_new_tokens", config.rollout.max_new_tokens))
    if prompt + after <= limit:
        return
    room = limit - prompt
    fix = (f"{field}={room} or less" + ("" if lengths is not None else ", or a lower data.max_prompt_length")
           if room >= 1 else f"data.max_prompt_length and {field} that add up to at most {limit}")
    raise ConfigError(f"{prompt_text} + {field}={after} = {prompt + after} tokens per sequence, more than {where}: "
                      f"sequences would run past them.\nFix: {fix}")


def plan_lengths(config: Config, worst_case: bool = False) -> tuple[Any, str]:
    """(DataLengths or None, the line that says which lengths the plan assumes)."""
    lengths = None if worst_case else data_lengths(config)
    if lengths is not None:
        return lengths, lengths.describe(config)
    why = "" if worst_case else " (the data or tokenizer could not be read here)"
    return None, worst_case_note(config) + why


def plan_report(config: Config, device: str | None = None, memory_gb: float | None = None,
                world_size: int = 1, worst_case: bool = False, devices: int | None = None) -> str:
    """`rlft plan`'s report: the trainer's plan per rank on `world_size` devices, with rollout.servers
    the servers' too, and the layout against `devices` (the devices there are) when given."""
    model_cfg = read_model_config(config.model.path, config.model.revision, config.model.trust_remote_code)
    lengths, note = plan_lengths(config, worst_case)
    # the lengths the run will have (the data's, where it can be read), whatever --worst-case plans with
    check_positions(config, model_cfg, data_lengths(config) if worst_case else lengths)
    try:
        setting = plan_input_from_config(config, world_size, lengths=lengths)
        label, capacity = device_capacity(device, memory_gb)
        plan = plan_memory(model_cfg, setting)
    except ValueError as exc:
        raise ConfigError(f"rlft plan: {exc}") from None
    verdict = Verdict(label, capacity, plan.total)
    servers = server_input_from_config(config, setting)
    title = f"memory plan for {config.method} on {config.model.path} ({world_size} rank(s))"
    if servers is not None:
        title = (f"memory plan for {config.method} on {config.model.path}: the trainer on {world_size} x {label}, "
                 f"rollouts on {servers.count} server(s) x TP{servers.tensor_parallel}, planned apart")
    lines = [title, "", *(["trainer, per rank:"] if servers else []), plan.table(), "",
             "assumptions:", f"  - {note}", *[f"  - {a}" for a in plan.assumptions], "", verdict.text()]
    advice = advise(model_cfg, setting, capacity)
    if advice:
        lines += ["", "changes that lower the peak (largest effect first):"]
        lines += [f"  - {a.change}: {size_text(a.total)}{' (fits)' if a.fits else ''}" for a in advice]
    if servers is not None:
        lines += ["", *server_report(model_cfg, servers, label, capacity, world_size, verdict.fits, devices)]
    return "\n".join(lines)


def server_report(model_cfg: dict[str, Any], servers: ServerInput, label: str, capacity: int, world_size: int,
                  trainer_fits: bool, devices: int | None = None) -> list[str]:
    """The servers' part of `rlft plan`: one server device, its KV cache, and the whole layout
    (trainer devices + server devices, against `devices` when given)."""
    try:
        plan = plan_server(model_cfg, servers, capacity, label)
    except ValueError as exc:
        raise ConfigError(f"rlft plan: {exc}") from None
    head = (f"rollout servers (rollout.servers): {servers.count} x tensor parallel {servers.tensor_parallel} "
            f"(rollout.server.tensor_parallel_size), each device at gpu_memory_utilization "
            f"{servers.gpu_memory_utilization:g}; per server device:")
    lines = [head, plan.table(), "", plan.concurrency_text(), "", "assumptions:",
             *[f"  - {a}" for a in plan.assumptions]]
    if plan.max_model_len_note():
        lines.append(f"  - {plan.max_model_len_note()}")
    used = world_size + servers.devices
    layout = (f"layout: trainer {world_size} x {label} + {servers.count} server(s) x TP{servers.tensor_parallel} "
              f"= {used} devices" + (f" of {devices}" if devices is not None else ""))
    short = [what for what, ok in (("the trainer", trainer_fits), ("a server", plan.fits),
                                   (f"{used} devices", devices is None or used <= devices)) if not ok]
    return [*lines, "", plan.verdict(label), layout + (f": does NOT fit ({', '.join(short)})" if short else ": fits")]
