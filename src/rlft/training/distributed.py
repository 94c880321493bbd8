"""Data parallelism on torch.distributed: one process per device, launched by torchrun.

    torchrun --nproc-per-node 2 -m rlft train CONFIG      (or: rlft train --nproc 2 CONFIG)

Each rank holds a shard of the policy's (and of the reference's and a separate critic's)
parameters, gradients and optimizer states -- FSDP2 `fully_shard` on every decoder layer and the
root -- and trains on its share of each global batch. What makes N ranks compute what one
process would:
- batch sizes in the config stay global; the loss normalisers (tokens, sequences, pairs) are those
  of the global batch, and FSDP's gradient average over ranks is undone (`LOSS_SCALE`), so the
  summed gradient is the one-process gradient;
- online RL: a prompt's G completions stay on one rank, and the advantages are computed on the
  gathered batch (group baselines, batch whitening, GAE) on every rank alike;
- every collective (a sharded forward, a backward, a gradient clip, a checkpoint) is reached by
  every rank the same number of times: ranks with less data run empty (zero-loss) micro-batches.

Rank 0 alone writes the run directory (metrics, samples, summary, final/); every rank writes its
part of a checkpoint (torch.distributed.checkpoint). A rank that dies or stops answering ends the
job within `training.dist_timeout_s` (the collectives' timeout) instead of hanging.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rlft.errors import RlftError
from rlft.training.torchrun import watch_parent


@dataclass(frozen=True)
class World:
    """Where this process is in the job; World() is a single process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1

    # -- collectives (each a no-op in a single process) ------------------------------------------
    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over ranks (float64, so counts stay exact)."""
        return self._all_reduce(values, "SUM")

    def max(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, "MAX")

    def _all_reduce(self, values: Sequence[float], op: str) -> list[float]:
        if not self.active:  # a single process (ReduceOp may not exist in a torch without distributed)
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return self.max([float(flag)])[0] > 0

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (picklable objects)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def agree(self, failure: str | None, what: str) -> str | None:
        """The end of a phase that can fail on one rank alone (a reward, a tool, an environment, a
        data row, a bug): one collective in which every rank says ok (None) or why it failed. The
        same answer on every rank: None when all are ok, else the first failed rank's reason naming
        that rank, so every rank stops at this phase and none is left waiting for a peer in a
        collective the peer never reaches (until training.dist_timeout_s). One process: `failure`
        itself, without a collective."""
        if not self.active:
            return failure
        failed = [(rank, reason) for rank, reason in enumerate(self.gather(failure)) if reason is not None]
        if not failed:
            return None
        rank, reason = failed[0]
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        return f"rank {rank} of {self.size} failed {what}{others}: {reason}"

    def share(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous share of n items (the first n % size ranks get
        one more)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)


SINGLE = World()


def init_world(device_type: str, timeout_s: float) -> World:
    """The job's World: a process group when torchrun started several processes (NCCL on CUDA,
    gloo on CPU), else a single process. Must run before a vLLM engine is built: vLLM creates a
    one-rank group of its own when none exists."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return SINGLE
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["RLFT_DIST_TIMEOUT_S"] = str(timeout_s)  # for the CLI's message if a peer dies
    watch_parent(timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return World(rank, size, local_rank)


def local_device(device: str, world: World) -> str:
    """model.device for this rank: under torchrun each rank takes its own GPU."""
    if world.active and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{world.local_rank}"
    return device


# FSDP averages gradients over ranks; rlft's losses are already divided by the global normaliser,
# so each rank's loss is scaled by the world size to make the average the one-process sum.
def loss_scale(world: World) -> float:
    return float(world.size)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM / classifier (under peft too): the sharding units."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "layers"):
        node = base
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, (torch.nn.ModuleList, list)) and len(node):
            return list(node)
    raise RlftError(f"cannot find the decoder layers of {type(base).__name__} to shard them across ranks; "
                    "train it in one process (without torchrun)")


def shard(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """FSDP2: each decoder layer its own unit (its parameters gathered for its forward only), the
    rest in the root unit. A no-op in a single process."""
    if not world.active:
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Register the shards again as every FSDP unit's parameters (a no-op where they already are).
    FSDP2 keeps the root unit's whole parameters after a forward, for the backward that follows
    in training; a forward with no backward after it (a held-out eval, reference log-probs, a
    frozen backbone) leaves them registered, and the optimizer, which holds the shards, then
    finds parameters it does not know (get_optimizer_state_dict: KeyError)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_rows(world: World, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """Every rank's rows of each tensor ([N_r] or [N_r, T_r]; 2-D ones right-padded with zeros to
    the longest T), concatenated in rank order -- the global batch, on every rank -- and this
    rank's [start, stop) rows in it."""
    if not world.active:
        n = tensors[0].shape[0] if tensors else 0
        return list(tensors), (0, n)
    device = tensors[0].device
    parts = world.gather([t.detach().cpu() for t in tensors])
    sizes = [p[0].shape[0] for p in parts]
    start = sum(sizes[:world.rank])
    out = []
    for k, t in enumerate(tensors):
        pieces = [p[k] for p in parts]
        if t.dim() == 2:
            width = max(p.shape[1] for p in pieces)
            pieces = [_pad_columns(p, width) for p in pieces]
        out.append(torch.cat(pieces).to(device))
    return out, (start, start + sizes[world.rank])


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros((t.shape[0], width), dtype=t.dtype)
    out[:, : t.shape[1]] = t
    return out


def full_state_dict(model: torch.nn.Module, world: World) -> dict[str, torch.Tensor]:
    """The model's whole state dict (its own naming) on every rank, gathered from the shards
    (collective) -- or the state dict itself in a single process."""
    if not world.active:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def describe_failure(exc: BaseException, world: World, timeout_s: float) -> str | None:
    """A readable line for a collective that failed because a peer rank died or stopped
    answering (None for other errors)."""
    text = f"{type(exc).__name__}: {exc}"
    markers = ("Connection reset", "Connection closed", "timed out", "Timeout", "Broken pipe", "peer",
               "NCCL", "gloo", "DistBackendError")
    if not world.active or not any(m in text for m in markers):
        return None
    limit = f"={timeout_s:g} s" if timeout_s else ""
    return (f"rank {world.rank}: a collective with the other ranks failed ({text.splitlines()[0][:200]}). Another "
            f"rank died or did not answer within training.dist_timeout_s{limit}; the job stops. Its last complete "
            "checkpoint can be resumed, on any number of ranks: rlft train --resume RUN_DIR [--nproc N]")


