"""Memory planner: will a training run fit on a device, from the model's config.json alone?

`plan_memory(model_config, PlanInput(...))` adds up what a training step holds at once, per phase,
before any weight is loaded. A step has phases that do not overlap in time, so the peak is the
largest phase, not the sum of everything:

- `static`: weights, fp32 master weights, optimizer states, the reference model and a separate
  critic -- alive for the whole run;
- `update`: saved activations, the output head's working set (`head_bytes`: it never holds whole
  [tokens, V] logits), autocast's weight casts, and the gradients when micro-batches are
  accumulated (with one micro-batch, backward frees a layer's activations as it fills that
  layer's gradients, so the two never add up);
- `recompute` (gradient checkpointing): the layer inputs, one rebuilt layer and the gradients;
- `rollout` (online methods, hf engine): the KV cache and the engine's working copies while sampling;
- `optimizer`: the gradients and the optimizer step's temporaries (torch's foreach AdamW on GPU);
- `sync` and `push` (rollout.servers): gathering the whole weights after the step (torchrun), then
  building what is sent to the servers (merged LoRA weights).
With rollout.servers the servers sample on devices of their own, planned in `rlft.plan.servers`.

The activation terms count the tensors autograd saves in a Llama/Qwen2 decoder layer as
transformers runs it (autograd keeps an input only when a gradient needs it); they were checked
tensor by tensor on CPU with `rlft.monitor.memory.LiveTensorTracker`, and whole runs are compared
in `benchmarks/plan_vs_measured.py`. Per token and layer, with b bytes per activation element,
H hidden, Q = heads x head_dim, I intermediate, T the sequence length:
  - each RMSNorm: its input in fp32 and rsqrt (4H + 4), and the normalised tensor (bH) when its
    weight trains;
  - the inputs of the linears (bH twice, bI for down_proj) when their weights train; under
    autocast (*-mixed) each linear reading a norm's fp32 output keeps its own bf16 cast (5 x 2H);
    under LoRA each adapted linear keeps its own copy of its input instead, fp32 or, under
    autocast, bf16 (see `_linear_input_bytes`);
  - attention (sdpa): q, k, v and the output (4bQ; padded batches pass a mask, so transformers
    repeats grouped K/V heads to the full head count before sdpa), log-sum-exp (4 x heads) and the
    additive mask (bT); eager attention keeps the [heads, T] softmax in fp32 (4 x heads x T), its
    cast back to b bytes (b x heads x T when b < 4) and a contiguous copy for o_proj;
  - MLP: gate, silu(gate) and up (3bI).
With gradient checkpointing a layer keeps only its input (bH per token) and one layer is rebuilt
at a time in backward. Kernels differ by device (`device_type`): the defaults model CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlft.models.head_logprobs import block_shape
from rlft.models.shared_prefix import AttentionCost, completions_per_segment

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# model.quantization=4bit stores each decoder linear's weight in NF4 with double quantisation (Dettmers
# et al. 2023, QLoRA, arXiv:2305.14314, sec. 3; bitsandbytes' defaults): 4 bits per weight, one absmax
# per block of 64 weights kept in 8 bits (8/64 bit per weight), and one fp32 absmax per 256 of those
# (32/(64*256) bit): 4 + 0.125 + 0.00195 = 4.127 bits = 0.5159 B per weight.
NF4_BYTES_PER_PARAM = (4 + 8 / 64 + 32 / (64 * 256)) / 8

# Total memory as nvidia-smi reports it (MiB); the first GiB is left for the CUDA context.
DEVICES_MIB = {
    "H200 141GB": 143771, "H100 80GB": 81559, "A100 80GB": 81920, "A100 40GB": 40960,
    "L40S 48GB": 46068, "A10G 24GB": 23028, "RTX 4090 24GB": 24564, "L4 24GB": 23034,
}
CUDA_CONTEXT = 1 * GiB
FRAGMENTATION = 0.10  # share of the rest kept free for the caching allocator's fragmentation

Method = Literal["sft", "dpo", "reward_model", "online", "ppo"]
Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16"]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder (Llama, Qwen2, Mistral) read from config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: the planner knows Llama-family decoders "
                             "(Llama, Qwen2, Mistral) only")
        if cfg.get("num_local_experts") or cfg.get("num_experts"):
            raise ValueError("mixture-of-experts configs are not supported by the planner")
        heads = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
                   heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
                   # transformers' default is True, but Llama/Qwen2 configs of large models say false
                   tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear in one decoder layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        linear = sum(a * b for a, b in self.linear_shapes().values())
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return linear + bias + 2 * self.hidden  # + the two RMSNorm weights

    def params(self, lm_head: bool = True) -> int:
        embed = self.vocab * self.hidden
        head = embed if lm_head and not self.tied else 0
        return embed + head + self.layers * self.layer_params() + self.hidden

    def quantized_params(self) -> int:
        """Weights bitsandbytes stores in 4 bits: every decoder linear's weight (not their biases, the
        norms, the embedding or the output head, which transformers keeps in full precision)."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    def lora_params(self, r: int, targets: str | tuple[str, ...]) -> int:
        return self.layers * sum(r * (a + b) for name, (a, b) in self.linear_shapes().items()
                                 if name in lora_targets(targets))


def lora_targets(targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """peft's 'all-linear' adapts every linear but the output head."""
    if targets == "all-linear":
        return LINEARS
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    unknown = [n for n in names if n not in LINEARS]
    if unknown:
        raise ValueError(f"unknown LoRA target modules {unknown}; the planner knows {', '.join(LINEARS)}")
    return names


@dataclass(frozen=True)
class PlanInput:
    """One training setting, as flat fields (the CLI fills them from an rlft config)."""

    method: Method = "sft"
    lora: bool = False
    lora_r: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.05  # > 0: each adapted linear keeps its own dropped-out input copy
    param_dtype: Literal["fp32", "bf16", "fp16"] = "bf16"  # frozen weights (LoRA base, reference)
    # "4bit": QLoRA, the decoder linears in NF4 (NF4_BYTES_PER_PARAM); the other weights in param_dtype
    # (fp32 after peft's prepare_model_for_kbit_training, which rlft calls)
    quantization: Literal["none", "4bit"] = "none"
    precision: Precision = "bf16"  # fp32 | pure bf16/fp16 | *-mixed: fp32 master + autocast
    gradient_checkpointing: bool = False
    attention: Literal["sdpa", "eager"] = "sdpa"
    micro_batch_size: int = 1  # sequences per forward (dpo: pairs, each two sequences)
    batch_size: int | None = None  # sequences per optimizer step (None: one micro-batch, no accumulation)
    seq_len: int = 1024  # prompt + completion tokens
    completion_len: int = 256  # tokens with log-probs (online, dpo); sft: target tokens
    group_size: int = 8  # online: G
    prompts_per_step: int = 4
    rollout_batch_size: int | None = None  # sequences generated per forward (None: G x prompts)
    reference: bool = False  # a KL term (or DPO) needs the reference policy
    critic: Literal["separate", "shared"] = "separate"  # ppo only
    world_size: int = 1  # FSDP-style sharding of weights, gradients and optimizer states
    engine: Literal["hf", "vllm"] = "hf"
    # rollout.servers: sampling runs on `rlft serve` processes on other devices (plan/servers.py);
    # the trainer keeps no engine, KV cache or engine weights
    servers: bool = False
    server_lora_sync: Literal["merged", "adapter"] = "adapter"  # rollout.server.lora_sync
    fast_decode: bool = True  # hf engine: fused copies of the projection weights while sampling
    async_steps: int = 0  # rollout.async_steps: a sampler thread with its own copy, sampling while training
    sampler_elsewhere: bool = False  # rollout.sampler_device: the async hf sampler on a device of its own
    device_type: Literal["cuda", "cpu"] = "cuda"  # kernels: fused dropout and foreach AdamW on cuda
    shared_prefix: Literal["auto", "on", "off"] = "off"  # online: training.shared_prefix

    @property
    def dropout_active(self) -> bool:
        """rlft turns dropout off for methods that compare the policy with itself (online RL's
        importance ratio, DPO's log-ratios to the reference): LoRA dropout costs memory in SFT and
        reward-model training only."""
        return self.lora_dropout > 0 and self.method in ("sft", "reward_model")

    def __post_init__(self) -> None:
        pure = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}.get(self.precision)
        if pure and pure != self.param_dtype:
            raise ValueError(f"precision {self.precision!r} trains {pure} weights, but param_dtype is "
                             f"{self.param_dtype!r}; set param_dtype={pure!r} or use a *-mixed precision")
        for name in ("micro_batch_size", "seq_len", "group_size", "prompts_per_step", "world_size", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.quantization == "4bit" and not self.lora:
            raise ValueError("quantization 4bit trains LoRA adapters on the frozen 4-bit base; set lora")
        if self.quantization == "4bit" and self.method == "reward_model":
            raise ValueError("quantization 4bit is for causal-LM policies; reward-model training is not quantised")
        if self.quantization == "4bit" and (self.world_size > 1 or self.engine == "vllm"):
            raise ValueError("quantization 4bit runs on one GPU with the hf engine (no FSDP sharding or vLLM "
                             "weight sync of 4-bit weights)")
        if self.servers and self.engine != "vllm":
            raise ValueError("rollout servers are vLLM servers: set engine='vllm' with servers")
        if not 0 < self.completion_len <= self.seq_len:
            raise ValueError(f"completion_len must be in [1, seq_len={self.seq_len}], got {self.completion_len}")

    @property
    def online(self) -> bool:
        return self.method in ("online", "ppo")

    @property
    def accumulates(self) -> bool:
        """Gradients of earlier micro-batches are alive while the next one runs forward."""
        return (self.batch_size or self.micro_batch_size) > self.micro_batch_size

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    phases: tuple[str, ...]  # ("static",): the whole run; else the phases it is alive in
    note: str = ""

    @property
    def phase(self) -> str:
        return "+".join(self.phases)


@dataclass
class MemoryPlan:
    components: list[Component]
    assumptions: list[str] = field(default_factory=list)

    def phase_total(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if "static" in c.phases or phase in c.phases)

    @property
    def phases(self) -> dict[str, int]:
        names = sorted({p for c in self.components for p in c.phases} - {"static"}) or ["static"]
        return {p: self.phase_total(p) for p in names}

    @property
    def total(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases.items(), key=lambda kv: kv[1])[0]

    def table(self) -> str:
        unit, scale = ("GiB", GiB) if self.total >= GiB else ("MiB", 2**20)
        name_w = max(len(c.name) for c in self.components)
        phase_w = max(len(c.phase) for c in self.components)
        lines = [f"{'component':<{name_w}}  {'phase':<{phase_w}}  {unit:>9}  note"]
        for c in self.components:
            lines.append(f"{c.name:<{name_w}}  {c.phase:<{phase_w}}  {c.bytes / scale:9.2f}  {c.note}")
        for phase, total in self.phases.items():
            lines.append(f"{'= ' + phase + ' phase':<{name_w}}  {'':<{phase_w}}  {total / scale:9.2f}")
        lines.append(f"{'peak (largest phase)':<{name_w}}  {'':<{phase_w}}  {self.total / scale:9.2f}  "
                     f"({self.peak_phase})")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The arithmetic


def _norm_bytes(s: PlanInput, h: int) -> int:
    """An RMSNorm keeps its input in fp32 and rsqrt; the normalised tensor too when its weight trains
    (autocast keeps that one in fp32, an fp32 weight multiplies it)."""
    return 4 * h + 4 + (0 if s.lora else (4 if s.mixed else s.act_bytes) * h)


def _linear_input_bytes(s: PlanInput, fan_in: int, readers: tuple[str, ...], fp32_input: bool = False) -> int:
    """What the linears reading one input (per token) keep for backward; `fp32_input`: the input is
    an RMSNorm's output, which stays fp32 under autocast (the residual stream is fp32).

    A trained weight keeps its input once (shared by the readers), except under autocast, where
    each linear casts an fp32 input to bf16 itself (autocast caches casts of weights, not of
    activations) and keeps its own copy. Under LoRA the frozen base keeps nothing; each adapted
    reader keeps its own copy: peft casts the input to the adapter's fp32 and lora_A saves that, or
    under autocast lora_A's bf16 cast of it. With dropout (fp32) CUDA's fused kernel keeps a
    one-byte mask, CPU's an fp32 noise tensor, and without autocast lora_A keeps the fp32 output.
    lora_A's rank-r output (fp32, bf16 under autocast) is kept by lora_B."""
    b = s.act_bytes
    if not s.lora:
        return (len(readers) if s.mixed and fp32_input else 1) * b * fan_in
    adapted = [r for r in readers if r in lora_targets(s.lora_targets)]
    if not adapted:
        return 0
    if s.mixed:  # lora_A's input is autocast's bf16/fp16 cast, its output bf16/fp16 too
        per_reader, shared = b * (s.lora_r + fan_in), 0
    else:
        per_reader, shared = 4 * s.lora_r, 0
        if b < 4 or s.dropout_active:  # peft's fp32 cast (pure bf16) or the dropout output
            per_reader += 4 * fan_in
        else:
            shared = b * fan_in
    if s.dropout_active:
        per_reader += (1 if s.device_type == "cuda" else 4) * fan_in  # the mask / the noise
    return len(adapted) * per_reader + shared


def layer_activation_bytes(m: ModelShape, s: PlanInput, seq_len: int) -> int:
    """Bytes autograd saves per token in one decoder layer (the module docstring lists the terms)."""
    b, h, q, i = s.act_bytes, m.hidden, m.heads * m.head_dim, m.intermediate
    if s.attention == "sdpa":  # its output is the o_proj input as well (one storage)
        attn = 4 * b * q + 4 * m.heads + b * seq_len
        o_in = 0 if not s.lora else _linear_input_bytes(s, q, ("o_proj",))
    else:
        attn = 3 * b * q + 4 * m.heads * seq_len + (b * m.heads * seq_len if b < 4 else 0)
        o_in = _linear_input_bytes(s, q, ("o_proj",))
    mlp = 3 * b * i  # gate, silu(gate), up
    return (2 * _norm_bytes(s, h) + attn + mlp + o_in
            + _linear_input_bytes(s, h, ("q_proj", "k_proj", "v_proj"), fp32_input=True)
            + _linear_input_bytes(s, h, ("gate_proj", "up_proj"), fp32_input=True)
            + _linear_input_bytes(s, i, ("down_proj",)))


def head_bytes(m: ModelShape, s: PlanInput, tokens: int) -> int:
    """Peak of the output head for `tokens` scored tokens (rlft.models.head_logprobs: the logits are
    never held whole). Kept for backward: the picked hidden states [tokens, H] (fp32 unless pure
    bf16), and in backward their gradient; working set: one block of logits (chunk x vocabulary
    slice) in fp32 three times (logits, exp, the product or gradient), its matmul output in the
    compute dtype, and the head weight cast to the compute dtype."""
    b, v = s.act_bytes, m.vocab
    state_bytes = 2 if s.precision in ("bf16", "fp16") else 4
    chunk, vb = block_shape(tokens, v)
    block = chunk * vb * (3 * 4 + (b if b < 4 else 0))
    cast = v * m.hidden * b if b < 4 else 0
    return tokens * m.hidden * (state_bytes + 4) + block + cast


def _static(m: ModelShape, s: PlanInput, out: list[Component], notes: list[str]) -> int:
    """Weights, master weights, gradients and optimizer states; returns the trainable count."""
    n = s.world_size
    shard = f" / {n} ranks" if n > 1 else ""
    total = m.params(lm_head=s.method != "reward_model") + (m.hidden if s.method == "reward_model" else 0)
    p_bytes = DTYPE_BYTES[s.param_dtype]
    if s.lora:
        trainable = m.lora_params(s.lora_r, s.lora_targets)
        if s.quantization == "4bit":
            q = m.quantized_params()
            out.append(Component("weights (frozen base, 4-bit)", int(q * NF4_BYTES_PER_PARAM) + (total - q) * p_bytes,
                                 ("static",), f"{q / 1e9:.2f}B in NF4 x {NF4_BYTES_PER_PARAM:.4f} B + "
                                 f"{(total - q) / 1e9:.2f}B unquantised x {p_bytes} B"))
            notes.append("4-bit base (NF4, double quantisation): the decoder linears at 4.127 bits per weight; "
                         "embeddings, norms and the output head upcast to fp32 by prepare_model_for_kbit_training, "
                         "so hidden states are fp32 too")
        else:
            out.append(Component("weights (frozen base)", total * p_bytes // n, ("static",), f"{total / 1e9:.2f}B x "
                                 f"{p_bytes} B{shard}"))
        weight_bytes = 4  # peft keeps adapters in fp32 even on a bf16/fp16 base
        name = "LoRA"
        notes.append(f"LoRA r={s.lora_r} on {', '.join(lora_targets(s.lora_targets))}: {trainable / 1e6:.1f}M "
                     "trainable parameters, kept in fp32 by peft")
    else:
        trainable = total
        weight_bytes = 4 if s.mixed else DTYPE_BYTES[s.param_dtype]
        name = ""
        if s.mixed:
            cast = m.layers * (m.layer_params() - 2 * m.hidden)  # the decoder linears (the head: head_bytes)
            out.append(Component("weights (bf16/fp16 working copy)", 2 * cast // n, ("update",),
                                 "autocast's cast of each trained linear weight, kept until backward"))
    label = (name + " " if name else "")
    out.append(Component(f"{label}weights" + (" (fp32 master)" if s.mixed and not s.lora else ""),
                         trainable * weight_bytes // n, ("static",),
                         f"{trainable / 1e9:.3f}B x {weight_bytes} B{shard}"))
    # Backward frees a layer's activations as it fills that layer's gradients, so with one micro-batch
    # per step the two never add up; under accumulation the earlier micro-batches' gradients do.
    if s.accumulates:
        phases, note = ("update", "recompute", "optimizer"), "kept across accumulated micro-batches"
    else:
        phases, note = ("recompute", "optimizer"), "filled while backward frees activations"
    if not s.gradient_checkpointing:
        phases = tuple(p for p in phases if p != "recompute")
    out.append(Component(f"{label}gradients", trainable * weight_bytes // n, phases, note))
    if not s.accumulates and not s.lora and not m.tied and s.method != "reward_model":
        out.append(Component("output head gradient", m.vocab * m.hidden * weight_bytes // n, ("update",),
                             "the first gradient backward makes"))
    out.append(Component(f"{label}AdamW states", 2 * trainable * weight_bytes // n, ("static",),
                         f"exp_avg + exp_avg_sq in the weights' dtype ({weight_bytes} B each)"))
    if s.device_type == "cuda":
        out.append(Component("AdamW step temporary", trainable * weight_bytes // n, ("optimizer",),
                             "foreach AdamW's sqrt(exp_avg_sq) for all tensors at once"))
    if n > 1:
        gathered = 2 * m.layer_params() * (2 if s.mixed else p_bytes)
        out.append(Component("FSDP gathered layers", gathered, ("update",), "two decoder layers unsharded at a time"))
    return trainable


def plan_memory(model_config: Any, setting: PlanInput) -> MemoryPlan:
    """The memory one training step needs, by component and phase (see the module docstring)."""
    m = ModelShape.from_config(model_config)
    s = setting
    out: list[Component] = []
    notes = [f"attention: {s.attention}" + (" (T x T scores kept)" if s.attention == "eager" else
                                            " (no T x T scores; K/V heads repeated when a padding mask is passed)"),
             "activations counted as saved by autograd in a transformers Llama/Qwen2 layer; a few small "
             "per-sequence tensors (masks, positions) are left out"]
    _static(m, s, out, notes)
    p_bytes, b, n = DTYPE_BYTES[s.param_dtype], s.act_bytes, s.world_size
    total_params = m.params()

    if s.reference and not s.lora:
        out.append(Component("reference model", total_params * p_bytes // n, ("static",), "frozen copy of the policy"))
    elif s.reference:
        notes.append("reference model: the policy with its adapters disabled (no extra memory)")

    rows, tokens, per_layer = _micro_batch(m, s)
    final_norm = _norm_bytes(s, m.hidden) + (0 if s.lora else b * m.hidden)  # + lm_head's input
    if s.gradient_checkpointing:
        # backward rebuilds one layer at a time, after the logits' gradient is gone
        acts = tokens * (m.layers * (4 if s.mixed else b) * m.hidden + final_norm)
        out.append(Component("activations (layer inputs)", acts, ("update", "recompute"),
                             f"{tokens} tokens; gradient checkpointing keeps each layer's input"))
        out.append(Component("recomputed layer", tokens * per_layer, ("recompute",),
                             f"one layer's saved tensors, {per_layer / 1024:.1f} KiB per token"))
    else:
        acts = tokens * (m.layers * per_layer + final_norm)
        out.append(Component("activations", acts, ("update",), f"{tokens} tokens x {m.layers} layers x "
                             f"{per_layer / 1024:.1f} KiB per token and layer"))

    if s.quantization == "4bit":
        # bitsandbytes' 4-bit matmul saves no input (only the packed weight) but, per call, dequantises
        # the weight and casts the fp32 input to the bf16 compute dtype: transients of the largest linear
        largest = max(a * c for a, c in m.linear_shapes().values())
        widest = max(a for a, _ in m.linear_shapes().values())
        out.append(Component("4-bit matmul temporaries", 2 * largest + 2 * tokens * widest,
                             ("update", "recompute") if s.gradient_checkpointing else ("update",),
                             "bf16 copies of the largest linear's weight and input while it runs"))

    if s.method != "reward_model":
        scored = rows * s.completion_len
        out.append(Component("output head (blocked log-softmax)", head_bytes(m, s, scored), ("update",),
                             f"{scored} scored tokens' hidden states + one block of logits"))
    if s.lora and s.mixed and s.quantization == "none":
        # autocast caches casts of weights that require grad only: each frozen base linear casts its
        # weight in every forward, and keeps the cast for backward (the input's gradient needs it)
        casts = m.quantized_params() * b
        out.append(Component("frozen weights' autocast casts", casts if not s.gradient_checkpointing
                             else casts // m.layers, ("update", "recompute") if s.gradient_checkpointing else
                             ("update",), "bf16/fp16 copies of the decoder linears, kept until backward"
                             + (" (one layer at a time: checkpointing)" if s.gradient_checkpointing else "")))

    if s.method == "ppo":
        _critic(m, s, out, acts)
    if s.online:
        _rollout(m, s, out, notes)
    return MemoryPlan(out, notes)


def _micro_batch(m: ModelShape, s: PlanInput) -> tuple[int, int, int]:
    """(rows, tokens, bytes saved per token in one layer) of one micro-batch of the update."""
    rows = s.micro_batch_size * (2 if s.method == "dpo" else 1)  # dpo: chosen and rejected in one forward
    tokens, attended = shared_prefix_tokens(m, s, rows)
    return rows, tokens, layer_activation_bytes(m, s, attended)


def micro_batch_layer_bytes(model_config: Any, setting: PlanInput) -> int:
    """Bytes autograd saves in one decoder layer for one micro-batch of the update."""
    _, tokens, per_layer = _micro_batch(ModelShape.from_config(model_config), setting)
    return tokens * per_layer


def shared_prefix_tokens(m: ModelShape, s: PlanInput, rows: int) -> tuple[int, int]:
    """(tokens, attended length) of a training micro-batch of `rows` rows: with training.shared_prefix,
    one prompt per segment of k completions, attention over [prompt | k completions] (k as
    `shared_prefix.completions_per_segment` picks it under 'auto'; a micro-batch holds whole groups)."""
    if not s.online or s.shared_prefix == "off" or rows < 2:
        return rows * s.seq_len, s.seq_len

    prompt, completion = s.seq_len - s.completion_len, s.completion_len
    group = min(s.group_size, rows)
    cost = AttentionCost.from_shape(m.hidden, m.heads, m.head_dim, m.kv_heads, m.intermediate)
    k = group if s.shared_prefix == "on" else completions_per_segment(cost, prompt, [completion] * group)
    return math.ceil(rows / k) * prompt + rows * completion, prompt + k * completion


def _critic(m: ModelShape, s: PlanInput, out: list[Component], policy_acts: int) -> None:
    if s.critic == "shared":
        out.append(Component("critic (shared value head)", 16 * m.hidden, ("static",), "one linear on the policy"))
        return
    n = s.world_size
    critic_params = m.params(lm_head=False)
    if s.lora:
        w = critic_params * DTYPE_BYTES[s.param_dtype] + 16 * m.lora_params(s.lora_r, s.lora_targets)
        note = "its own base weights + LoRA adapters with AdamW"
    else:
        per = 16 if (s.mixed or s.precision == "fp32") else 4 * DTYPE_BYTES[s.param_dtype]
        w = critic_params * per
        note = "a second model: weights + gradients + AdamW"
    out.append(Component("critic model", w // n, ("static",), note))
    out.append(Component("critic activations", policy_acts, ("update",), "forward/backward alongside the policy's"))


def _rollout(m: ModelShape, s: PlanInput, out: list[Component], notes: list[str]) -> None:
    """Sampling with the hf engine (KV cache in the trainer's memory) or vLLM (its own budget).
    Asynchronous rollouts sample while the trainer updates: what sampling holds is held in every
    phase, and the sampler has its own copy of the policy (and the trainer's published versions)."""
    if s.servers:
        _server_rollout(m, s, out, notes)
        return
    if s.sampler_elsewhere and s.async_steps and s.engine == "hf":  # another device's memory
        own: list[Component] = []
        _async_sampler(m, s, out, notes, sampler_out=own)  # the published versions stay in host memory
        _hf_sampling(m, s, own)
        notes.append("rollout.sampler_device holds, on its own device (not counted here): " + ", ".join(
            f"{c.name} ({c.bytes / 2**30:.2f} GiB)" for c in own))
        return
    if s.async_steps:
        _async_sampler(m, s, out, notes)
    if s.engine == "vllm":
        _vllm_sampling(m, s, out, notes)
    else:
        _hf_sampling(m, s, out)


def _vllm_sampling(m: ModelShape, s: PlanInput, out: list[Component], notes: list[str]) -> None:
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim * s.act_bytes
    gen_rows = _generated_rows(s)
    out.append(Component("rollout KV cache", kv_per_token * s.seq_len * gen_rows, ("static",),
                         f"2 x {m.layers} layers x {m.kv_heads} kv heads x {m.head_dim} x {s.seq_len} tokens x "
                         f"{gen_rows} seqs x {s.act_bytes} B, vLLM's own KV budget (set gpu_memory_utilization)"))
    out.append(Component("vLLM weights copy", m.params() * 2, ("static",), "the engine's own bf16 weights"))
    notes.append("vLLM reserves gpu_memory_utilization x device memory up front; set it to cover its rows "
                 "above, not the default 0.9, when it shares the GPU with the trainer")


def _server_rollout(m: ModelShape, s: PlanInput, out: list[Component], notes: list[str]) -> None:
    """rollout.servers: the servers sample (plan/servers.py), so the trainer holds no engine, but what
    the run keeps to send them weights: under torchrun every rank's whole copy of the policy
    (`LoadedModel.mirror`, which rank 0 sends from) and the whole state dict `sync_mirror` gathers
    into it after each step (freed before the push); a LoRA run with lora_sync=merged, the merged
    linears on the sending rank; an async run, the sampler's copy in host memory (`_async_sampler`)."""
    p_bytes = DTYPE_BYTES[s.param_dtype]
    whole = m.params() * p_bytes + (4 * m.lora_params(s.lora_r, s.lora_targets) if s.lora else 0)
    if s.async_steps:
        _async_sampler(m, s, out, notes)
    if s.world_size > 1:
        out.append(Component("whole copy of the policy (mirror)", whole, ("static",),
                             "torchrun: each rank keeps the policy unsharded; rank 0 sends it to the servers"))
        out.append(Component("gathered state dict", whole, ("sync",),
                             "sync_mirror gathers the whole weights on every rank after each step"))
    if s.lora and s.server_lora_sync == "merged":
        merged = m.layers * sum(a * b for k, (a, b) in m.linear_shapes().items() if k in lora_targets(s.lora_targets))
        out.append(Component("merged LoRA weights", merged * p_bytes, ("push",),
                             "rollout.server.lora_sync=merged: W + BA of every adapted linear, sent at once"))
    notes.append("rollout.servers: the servers sample; the trainer holds no engine, KV cache or engine weights "
                 "(the servers are planned apart)")


def _generated_rows(s: PlanInput) -> int:
    rows = math.ceil(s.group_size * s.prompts_per_step / s.world_size)
    return min(s.rollout_batch_size or rows, rows)


def _hf_sampling(m: ModelShape, s: PlanInput, out: list[Component]) -> None:
    """The hf engine's KV cache and working set: in the rollout phase, or throughout beside an async
    run's updates."""
    n, b = s.world_size, s.act_bytes
    gen_rows = _generated_rows(s)
    prompt_len = s.seq_len - s.completion_len
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim * b
    phase = ("static",) if s.async_steps else ("rollout",)
    out.append(Component("rollout KV cache", kv_per_token * s.seq_len * gen_rows, phase,
                         f"2 x {m.layers} layers x {m.kv_heads} kv heads x {m.head_dim} x {s.seq_len} tokens x "
                         f"{gen_rows} seqs x {b} B, in the trainer's memory"))
    # The prefill's cache stays referenced while the lean decoder copies it into preallocated buffers;
    # dropping finished rows copies the key buffers (then the value buffers) once more.
    out.append(Component("hf engine cache copies", kv_per_token * gen_rows * (2 * prompt_len + s.seq_len) // 2,
                         phase, "prefill cache kept while decoding + keys copied when rows finish"))
    if s.fast_decode and s.quantization == "none":  # a 4-bit model samples through its own forward
        linear = {k: a * c for k, (a, c) in m.linear_shapes().items()}
        fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        if b != DTYPE_BYTES[s.param_dtype]:  # autocast rollouts: every linear cast once (a frozen head too)
            size = (m.layers * sum(linear.values()) + (m.vocab * m.hidden if s.lora else 0)) * b
            what = f"every linear cast to {b}-byte compute once" + (", LoRA merged, the frozen head" if s.lora else "")
        else:
            copied = sum(linear.values()) if s.lora else sum(linear[k] for k in fused)
            size = m.layers * copied * DTYPE_BYTES[s.param_dtype]
            what = "q|k|v and gate|up concatenated" + (", LoRA merged into every linear" if s.lora else "")
        out.append(Component("fast-decode fused weights", size, phase, what))
    # one prefill per distinct prompt: a batch of rows in prompt order spans ceil(rows / G) prompts,
    # one more when it starts inside a group
    prompts = min(gen_rows, math.ceil(gen_rows / s.group_size) + (1 if gen_rows % s.group_size else 0))
    prefill = prompts * prompt_len * (4 * m.hidden + 3 * m.intermediate) * b + 5 * gen_rows * m.vocab * 4
    out.append(Component("prefill + sampling working set", prefill, phase,
                         f"one layer at a time, {prompts} prompts; [rows, V] probs"))
    if n > 1:  # async: published from (and evaluated on) while the sampler samples, so held throughout
        out.append(Component("gathered weights for sampling", m.params() * DTYPE_BYTES[s.param_dtype], phase,
                             "the hf engine samples with full (unsharded) weights on each rank" +
                             ("; the async sampler's copy is loaded from them" if s.async_steps else "")))


def _async_sampler(m: ModelShape, s: PlanInput, out: list[Component], notes: list[str],
                   sampler_out: list[Component] | None = None) -> None:
    """The sampler thread's copy of the policy (on the device for hf, counted in `sampler_out`,
    default `out`; host memory for vLLM, which pushes from it) and the k + 1 CPU snapshots of the
    trained weights the queue's pacing can hold."""
    p_bytes = DTYPE_BYTES[s.param_dtype]
    trained = m.lora_params(s.lora_r, s.lora_targets) * 4 if s.lora else m.params() * p_bytes
    host = [("the sampler's copy of the policy", m.params() * p_bytes)] if s.engine == "vllm" else []
    host.append((f"{s.async_steps + 1} published weight versions", (s.async_steps + 1) * trained))
    if s.engine == "hf":
        (out if sampler_out is None else sampler_out).append(Component(
            "sampler's copy of the policy", m.params() * p_bytes, ("static",),
            "rollout.async_steps: the sampler thread samples from its own copy"))
    if s.device_type == "cpu":
        for name, size in host:
            out.append(Component(name, size, ("static",), "rollout.async_steps (CPU)"))
    else:
        notes.append("rollout.async_steps also holds in host memory: " + ", ".join(
            f"{name} ({size / 2**30:.2f} GiB)" for name, size in host))


# ---------------------------------------------------------------------------------------------
# Verdict and advice


def device_capacity(device: str | None = None, memory_gb: float | None = None) -> tuple[str, int]:
    """(label, bytes) of a known device name (case, spaces, '-' and '_' ignored; a prefix naming one
    device, such as 'h100', will do) or of `memory_gb` GiB."""
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError(f"memory must be positive, got {memory_gb} GiB")
        return f"{memory_gb:g} GiB", int(memory_gb * GiB)

    def key(name: str) -> str:
        return "".join(c for c in name.lower() if c not in " -_")

    wanted = key(device or "H100 80GB")
    exact = [n for n in DEVICES_MIB if key(n) == wanted]
    named = exact or [n for n in DEVICES_MIB if key(n).startswith(wanted)]
    if len(named) == 1:
        return named[0], DEVICES_MIB[named[0]] * 2**20
    which = f"{device!r} could be {' or '.join(named)}" if named else f"unknown device {device!r}"
    raise ValueError(f"{which}; known: {', '.join(DEVICES_MIB)} (or give the memory in GiB)")


# config.json's names for the positions a model has: Llama/Qwen2/Mistral, GPT-2, others
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_positions(model_config: Any) -> int | None:
    """The longest sequence the model has positions for, from its config.json; None where it does not say."""
    cfg = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    for key in POSITION_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def size_text(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB (tiny models, tight limits)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"
