"""Rollout servers in the memory plan (`rollout.servers`): what one device of an `rlft serve`
process holds, and how many of a step's sequences its KV cache takes at once.

vLLM takes `gpu_memory_utilization` x the device's memory and, after loading its share of the
weights and profiling a forward, gives the rest to the KV cache. Per device, at tensor-parallel
size T (the trainer's side of a servers run is `memory._server_rollout`):
- weights: bf16 (what `vllm serve --dtype auto` loads for a bf16 checkpoint); the linears, the
  embedding and the output head split T ways, K/V projections replicated where T exceeds the
  KV heads, the norms whole;
- LoRA adapter slots (runs that send adapters): `rlft serve` starts vLLM with --max-loras 2;
- the profile forward: `max_num_batched_tokens` tokens through one layer (hidden states, q|k|v,
  gate|up, their product), and the sampler's fp32 logits and log-probs for `max_num_seqs` rows;
- CUDA context (counted inside vLLM's share: it measures non-torch memory) and CUDA graphs
  (not computed: `CUDA_GRAPHS` assumed);
- the KV cache: what is left, 2 x layers x KV heads / T x head_dim x 2 B per token, in blocks of
  `BLOCK_TOKENS`.
The sequence counts take no credit for prefix caching (a group's prompt blocks are shared on the
server), so they are a floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlft.plan.memory import CUDA_CONTEXT, Component, GiB, ModelShape, model_positions, size_text

SERVER_BYTES = 2  # bf16 weights and KV cache
BLOCK_TOKENS = 16  # vLLM's KV block size on CUDA
CUDA_GRAPHS = 1 * GiB  # assumed; vLLM 0.32 measures it at start-up (its log: "CUDA graph ... GiB")
MAX_LORAS = 2  # rlft serve's --max-loras (servers/serve.py)


@dataclass(frozen=True)
class ServerInput:
    """The servers of a run, as flat fields (the CLI fills them from `rollout.servers` and
    `rollout.server`)."""

    count: int  # len(rollout.servers)
    tensor_parallel: int = 1  # rollout.server.tensor_parallel_size
    gpu_memory_utilization: float = 0.9
    sequences: int = 32  # a step's sequences over all servers: prompts_per_step x group_size
    seq_len: int = 1024  # prompt + max_new_tokens
    lora_r: int | None = None  # the adapter rank a LoRA run sends (None: whole weights)
    lora_targets: str | tuple[str, ...] = "all-linear"

    def __post_init__(self) -> None:
        for name in ("count", "tensor_parallel", "sequences", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"servers: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"servers: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def devices(self) -> int:
        return self.count * self.tensor_parallel


def vllm_limits(capacity: int, device: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): `vllm serve`'s defaults for a device of this
    size (vLLM 0.32, engine/arg_utils.py: larger ones for H100/H200-class devices, not A100s)."""
    if capacity >= 160 * GiB:
        return 16384, 1024
    if capacity >= 70 * GiB and "a100" not in device.lower():
        return 8192, 1024
    return 2048, 256


def kv_heads_per_device(m: ModelShape, tp: int) -> int:
    """vLLM splits the KV heads over the devices, and replicates them where there are fewer than T."""
    return max(1, m.kv_heads // tp)


def _weights_per_device(m: ModelShape, tp: int) -> int:
    """Parameters one device holds at tensor-parallel size `tp`."""
    linear = m.linear_shapes()
    kv_share = kv_heads_per_device(m, tp) / m.kv_heads
    split = sum(a * b for name, (a, b) in linear.items() if name not in ("k_proj", "v_proj")) / tp
    kv = sum(a * b for name, (a, b) in linear.items() if name in ("k_proj", "v_proj")) * kv_share
    bias = (m.heads / tp + 2 * m.kv_heads * kv_share) * m.head_dim if m.qkv_bias else 0
    layer = split + kv + bias + 2 * m.hidden
    vocab = m.vocab * m.hidden * (1 if m.tied else 2) / tp
    return int(m.layers * layer + vocab + m.hidden)


@dataclass
class ServerPlan:
    """One server device: its components (all alive at once) and what is left for the KV cache."""

    components: list[Component]
    budget: int  # gpu_memory_utilization x the device's memory
    kv_bytes: int  # the KV cache: the budget less the components (negative: short)
    kv_token_bytes: int  # per token on this device
    setting: ServerInput
    positions: int | None  # the model's max_position_embeddings (vLLM's default max_model_len)
    max_num_seqs: int
    assumptions: list[str]

    @property
    def kv_tokens(self) -> int:
        return max(self.kv_bytes, 0) // self.kv_token_bytes

    @property
    def fits(self) -> bool:
        """Room for at least one of the run's sequences."""
        return self.concurrent_per_server >= 1

    @property
    def concurrent_per_server(self) -> int:
        """The run's sequences one server holds at once: whole KV blocks each, up to max_num_seqs."""
        blocks = self.kv_tokens // BLOCK_TOKENS
        return min(blocks // math.ceil(self.setting.seq_len / BLOCK_TOKENS), self.max_num_seqs)

    def table(self) -> str:
        name_w = max(len(c.name) for c in self.components) + 2
        lines = [f"{'component':<{name_w}}  {'GiB':>9}  note"]
        for c in self.components:
            lines.append(f"{c.name:<{name_w}}  {c.bytes / GiB:9.2f}  {c.note}")
        lines.append(f"{'= KV cache':<{name_w}}  {self.kv_bytes / GiB:9.2f}  "
                     f"{self.setting.gpu_memory_utilization:g} x the device ({size_text(self.budget)}) less the above")
        return "\n".join(lines)

    def concurrency_text(self) -> str:
        s = self.setting
        per, total = self.concurrent_per_server, self.concurrent_per_server * s.count
        head = (f"KV cache: {self.kv_tokens:,} tokens per server ({per} sequences of {s.seq_len} tokens at once"
                + (f", vLLM's max_num_seqs={self.max_num_seqs}" if per == self.max_num_seqs else "") + ")")
        if not self.fits:
            return f"{head}: not one of the run's sequences fits"
        if total >= s.sequences:
            return f"{head}; all {s.sequences} sequences of a step fit at once over {s.count} server(s)"
        return (f"{head}; {total} of a step's {s.sequences} sequences run at once over {s.count} server(s), "
                f"the rest wait (about {math.ceil(s.sequences / total)} rounds)")

    def max_model_len_note(self) -> str | None:
        """vLLM refuses to start when one sequence of max_model_len (default: the model's positions)
        does not fit its KV cache."""
        if self.positions is None or self.kv_tokens >= self.positions or not self.fits:
            return None
        room = self.kv_tokens - self.kv_tokens % BLOCK_TOKENS
        return (f"the model's {self.positions} positions do not fit one server's KV cache: start rlft serve with "
                f"--max-model-len {max(self.setting.seq_len, min(room, self.positions))} (at least the run's "
                f"{self.setting.seq_len})")

    def verdict(self, device: str) -> str:
        if self.fits:
            return (f"each server device fits on {device}: {size_text(self.kv_bytes)} of KV cache left in "
                    f"{self.setting.gpu_memory_utilization:g} x its memory")
        return (f"a server does NOT fit on {device} at tensor parallel {self.setting.tensor_parallel}: "
                f"{size_text(max(-self.kv_bytes, 0) + self.setting.seq_len * self.kv_token_bytes)} short of one "
                "sequence's KV cache; raise rollout.server.tensor_parallel_size (rlft serve --tensor-parallel-size) "
                "or gpu_memory_utilization")


def plan_server(model_config: Any, setting: ServerInput, capacity: int, device: str = "") -> ServerPlan:
    """What one device of each server holds (see the module docstring), for a device of `capacity` bytes."""
    m, s, tp = ModelShape.from_config(model_config), setting, setting.tensor_parallel
    batched, max_seqs = vllm_limits(capacity, device)
    weights = _weights_per_device(m, tp)
    out = [Component("weights", weights * SERVER_BYTES, ("static",),
                     f"{weights / 1e9:.2f}B per device (tensor parallel {tp}) x {SERVER_BYTES} B")]
    if s.lora_r is not None:
        slots = MAX_LORAS * m.lora_params(s.lora_r, s.lora_targets) // tp
        out.append(Component("LoRA adapter slots", slots * SERVER_BYTES, ("static",),
                             f"{MAX_LORAS} adapters of rank {s.lora_r} (vLLM rounds the slot up to a kernel rank)"))
    q, kv = m.heads * m.head_dim, 2 * kv_heads_per_device(m, tp) * m.head_dim
    per_token = 2 * m.hidden + q // tp + kv + 3 * m.intermediate // tp  # hidden, residual, q|k|v, gate|up, product
    out.append(Component("profile forward", batched * per_token * SERVER_BYTES, ("static",),
                         f"max_num_batched_tokens={batched} through one layer"))
    out.append(Component("sampler logits", 2 * max_seqs * m.vocab * 4, ("static",),
                         f"fp32 logits + log-probs for max_num_seqs={max_seqs} rows"))
    out.append(Component("CUDA context", CUDA_CONTEXT, ("static",), "inside vLLM's share (non-torch memory)"))
    out.append(Component("CUDA graphs", CUDA_GRAPHS, ("static",), "assumed; vLLM measures it at start-up"))
    budget = int(s.gpu_memory_utilization * capacity)
    kv_token = 2 * m.layers * kv_heads_per_device(m, tp) * m.head_dim * SERVER_BYTES
    note = (f"servers: vLLM's defaults for `vllm serve` on this device (max_num_batched_tokens={batched}, "
            f"max_num_seqs={max_seqs}; --vllm-arg changes them), bf16 weights and KV cache, blocks of "
            f"{BLOCK_TOKENS} tokens, no credit for prefix caching (a group's prompt is cached once: more fit)")
    return ServerPlan(out, budget, budget - sum(c.bytes for c in out), kv_token, s, model_positions(model_config),
                      max_seqs, [note])
