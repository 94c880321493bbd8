"""Weights from the trainer to `rlft serve` servers where NCCL is absent: a gloo transfer engine.

vLLM's RL routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) drive a pluggable `WeightTransferEngine` in every server worker; NCCL
and CUDA IPC are built in. This module adds `rlft_gloo`, the same dense broadcast over a gloo
process group (CPU tensors over TCP), registered with vLLM's two factories by `register`, which
vLLM calls in every process of a server through the `vllm.general_plugins` entry point
(pyproject.toml). The server picks it with `--weight-transfer-config '{"backend": "rlft_gloo"}'`
(`rlft serve` does so on a machine without CUDA).

One round: the trainer (group rank 0) sends the parameter names, dtypes and shapes over HTTP
(`/update_weights`), then broadcasts each tensor while the workers (ranks 1..tp) receive them in
the same order and hand each to the model's `load_weights` inside vLLM's layerwise reload (as its
NCCL engine does), so checkpoint-named tensors are re-packed into the server's kernels' layout.
The process group is made from a TCPStore the trainer listens on, apart from torch.distributed's
default group (a torchrun trainer's, or the server's own).

Importing this module imports vLLM: only the server processes and a trainer with servers do.
"""

from __future__ import annotations

import datetime
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine, WeightSource,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

log = logging.getLogger(__name__)

BACKEND = "rlft_gloo"


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """A gloo process group of `world_size` processes meeting at address:port (rank 0 listens),
    not registered with torch.distributed (its default group stays whatever it was)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("rlft-weights", store), rank, world_size, timeout)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What a server worker needs to join: the trainer's address and port, the rank of the
    server's first worker in the group (1: after the trainer) and the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The server side: receives each tensor of a round and loads it (one worker per TP rank)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        self.group = gloo_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("rlft_gloo weight transfer is not initialised: call /init_weight_transfer_engine first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            broadcast(self.group, weight)
            self.model.load_weights([(name, weight.to(self.device))])

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side: group rank 0, drives the round through the server's routes."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None
                     ) -> "GlooTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("the rlft_gloo trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.group = None
        if not engine.is_sender:
            return engine
        worker = GlooInitInfo(init_info.master_address, init_info.master_port, 1, init_info.world_size,
                              init_info.timeout_s)
        # the workers block in init until the group forms: ask them on a side thread, join here
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.group = gloo_group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                      init_info.timeout_s)
            joined.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        info = GlooUpdateInfo(names=[m.name for m in meta], dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                              shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(info))
            for (name, tensor), m in zip(self.source, meta):
                if name != m.name or tuple(tensor.shape) != m.shape:
                    raise ValueError(f"weight source order changed: {name!r} where {m.name!r} was declared")
                broadcast(self.group, tensor.to("cpu").contiguous())
            received.result()
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the worker's call blocked: never join it
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """vLLM's `vllm.general_plugins` hook: runs in every vLLM process, possibly more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
