"""Rollouts on vLLM servers of their own (`rollout.servers`): the same `Completion`s as the
colocated vLLM engine, sampled by `rlft serve` processes on other devices or machines.

Sampling: each prompt is one request to `/inference/v1/generate` (token ids in, token ids and
log-probs out, vLLM's own route), its n samples drawn together so a group stays on one server and
shares its prefix cache; a request goes to the server with the fewest requests in flight. The
seeds are the colocated engine's (rollout/seeds.py), so the streams do not depend on which server
samples. A server that fails (refused connection, timeout, 5xx) leaves the rotation and its
requests go to the others, up to `rollout.server.max_retries` times each; with none left the
call raises `ServerError`, on which the loop stops with a checkpoint (`rlft train --resume`
continues once a server is back).

Weights: before it samples, the engine pushes the trainer's weights whenever they changed (an
optimizer step, a resume: a resumed run always pushes first), through vLLM's weight-transfer
routes, to every server: NCCL (vLLM's engine) between CUDA trainers and servers, else rlft's gloo
engine (servers/transfer.py); the round's version is set on the server (`/update_weight_version`)
and every returned sample carries the versions it was drawn with, which must be the pushed one:
a server that missed an update is an error, never a silent off-policy batch. A LoRA policy sends
its adapter only: saved under `rollout.server.adapter_dir` (a path the servers read too) and
loaded with vLLM's runtime LoRA loading under a new name per version.

Several trainer ranks: rank 0 pushes, the others wait until every server reports the version, so
all ranks sample the same weights.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence
from urllib.parse import urlparse

import torch

from rlft.config import ServerSettings
from rlft.errors import ServerError
from rlft.rollout.contract import Completion, SamplingParams
from rlft.rollout.seeds import SamplingStreams, call_number, request_seeds
from rlft.rollout.servers.client import ServerClient, ServerLost, check_server, server_key
from rlft.rollout.vllm_engine import check_request, sampled_completion, token_caps
from rlft.rollout.vllm_weights import (StalenessTracker, base_model_of, full_state, lora_rank, merged_lora_state,
                                       watched_tensors)

log = logging.getLogger(__name__)

WAIT_FOR_VERSION_S = 600.0


def local_address_towards(url: str) -> str:
    """This machine's address on the route to `url`'s host (what a server's workers connect to
    for the weight broadcast)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class NamedTensors:
    """A vLLM `WeightSource` over the trainer's weights in checkpoint naming (a tied head included):
    the round's `snapshot`, taken once per push and read by every server's transfer (a transfer
    engine reads its source twice a round: metadata, then the tensors)."""

    def __init__(self) -> None:
        self.snapshot: list[tuple[str, torch.Tensor]] = []

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.snapshot]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.snapshot)

    def held_names(self) -> None:
        return None


class ServerEngine(SamplingStreams):
    STATE_NAME = "vllm"  # the colocated engine's streams: a run can move between it and servers on resume

    def __init__(self, policy: Any, stop_ids: Sequence[int], seed: int, urls: Sequence[str],
                 settings: ServerSettings | None = None, push: bool = True, version_prefix: str | None = None,
                 adapter_dir: str | Path | None = None):
        """`push`: this process sends the weights (rank 0); the others wait for them.
        `version_prefix`: the same on every rank of a run (names each round's weight version).
        `adapter_dir`: where a LoRA policy's adapter versions are saved for the servers to load
        (rollout.server.adapter_dir, default the run's `server-adapters/`)."""
        self.settings = s = settings or ServerSettings()
        self.tokenizer, self.model, self.device = policy.tokenizer, policy.model, policy.device
        self.is_lora = bool(policy.is_lora)
        self.stop_ids = sorted(set(stop_ids))
        self._seed, self._stream, self._calls = seed, "train", 0
        self.push = push
        self.prefix = version_prefix or uuid.uuid4().hex[:8]
        self.weight_pushes = 0
        self.sync_seconds: list[float] = []  # per push, for metrics and benchmarks
        self.version: str | None = None  # the version the servers hold (None: not pushed yet)
        self._adapter_sync = self.is_lora and s.lora_sync == "adapter"  # the adapter travels (its name: version)
        self._source = NamedTensors()
        self.adapter_dir = Path(adapter_dir or s.adapter_dir or "server-adapters").resolve()  # the run passes
        # rollout.server.adapter_dir or its own folder; the fallbacks serve an engine built on its own
        self._transfers: dict[str, Any] = {}  # url -> trainer-side transfer engine
        self.transfers: dict[str, str] = {}  # url -> how its weights travel ("rlft_gloo via 10.0.0.2")
        self._lock = threading.Lock()
        key = server_key(s.api_key_env)
        self.clients = [ServerClient(url, key, s.timeout_s) for url in urls]
        base = base_model_of(self.model)
        rank = lora_rank(self.model) if self._adapter_sync else None
        self.infos = [check_server(c, base.config, self.tokenizer, rank) for c in self.clients]
        self.max_model_len = min(c.max_model_len() for c in self.clients)
        self._pool = ThreadPoolExecutor(max_workers=s.max_concurrent_requests, thread_name_prefix="rlft-server")
        self._tracker = StalenessTracker(list(watched_tensors(self.model, self.is_lora)))

    # ---- weights -------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Bring every server to the trainer's weights when they changed since the last push."""
        if not self._tracker.stale:
            return
        start = time.perf_counter()
        version = f"rlft-{self.prefix}-{self.weight_pushes + 1}"
        if not self.push:
            self._wait_for(version)
        elif self._adapter_sync:
            self._push_adapter(version)
        else:
            self._push_tensors(version)
        self.version = version
        self._tracker.mark_synced()
        self.weight_pushes += 1
        self.sync_seconds.append(time.perf_counter() - start)
        log.info("weights %s on %d server(s) in %.2f s", version, len(self.live()), self.sync_seconds[-1])

    def mark_stale(self) -> None:
        self._tracker.mark_stale()

    def describe(self) -> str:
        """One line for the run's console: the servers and how weights reach them."""
        how = "adapters (runtime LoRA loading) from " + str(self.adapter_dir) \
            if self._adapter_sync else \
            ", ".join(sorted(set(self.transfers.values()))) or "not sent yet"
        return f"{len(self.live())} of {len(self.clients)} server(s) live; weights: {how}" + \
            ("" if self.push else " (sent by rank 0)")

    def _weights(self) -> list[tuple[str, torch.Tensor]]:
        return merged_lora_state(self.model) if self.is_lora else full_state(self.model)

    def _push_tensors(self, version: str) -> None:
        self._source.snapshot = [(k, v.detach()) for k, v in self._weights()]
        try:
            self._send(version)
        finally:
            self._source.snapshot = []
        self._require_live("while receiving weights")

    def _send(self, version: str) -> None:
        for client, info in zip(self.clients, self.infos):
            if not client.alive:
                continue
            try:
                transfer = self._transfers.get(client.url) or self._open_transfer(client, info)
                transfer.send_weights()
                client.update_weight_version(version)
                client.reset_prefix_cache()  # cached KV blocks were computed with the old weights
            except ServerLost as exc:
                self._drop(client, exc)
            except ServerError:
                raise
            except Exception as exc:  # a broken broadcast (the server died mid-round)
                self._drop(client, ServerError(f"rollout server {client.url}: the weight transfer failed "
                                               f"({type(exc).__name__}: {exc})"))

    def _open_transfer(self, client: ServerClient, info: dict[str, Any]) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from rlft.rollout.servers import transfer  # lazy: imports vLLM, which only a push needs

        backend = info.get("weight_transfer", transfer.BACKEND)
        address = self.settings.sync_address if self.settings.sync_address != "auto" else \
            local_address_towards(client.url)
        world = 1 + int(info.get("tensor_parallel_size", 1))
        if backend == transfer.BACKEND:
            transfer.register()
            init = transfer.GlooTrainerInitInfo(address, free_port(address), world, self.settings.timeout_s, rank=0)
        elif backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            if self.device.type != "cuda":
                raise ServerError(f"rollout server {client.url} receives weights over NCCL (a CUDA server), and this "
                                  "trainer runs on CPU: start the server with `rlft serve ... --weight-transfer "
                                  "rlft_gloo`, or train on a GPU")
            init = NCCLTrainerInitInfo(address, free_port(address), world, rank=0)
        else:
            raise ServerError(f"rollout server {client.url} uses the weight transfer backend {backend!r}, which rlft "
                              "does not drive; start it with rlft serve")
        self.transfers[client.url] = f"{backend} via {address}"
        log.info("weight transfer to %s: %s via %s", client.url, backend, address)
        engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=self._source)
        self._transfers[client.url] = engine
        return engine

    def _push_adapter(self, version: str) -> None:
        root = self.adapter_dir
        path = root / version
        self.model.save_pretrained(str(path))
        old = self.version  # the adapter the servers hold is named by its version
        for client in self.live():
            try:
                client.load_adapter(version, str(path))
                if old is not None:
                    client.unload_adapter(old)
                client.update_weight_version(version)
            except ServerLost as exc:
                self._drop(client, exc)
        self._require_live("while loading the adapter")
        if old is not None:
            shutil.rmtree(root / old, ignore_errors=True)

    def _wait_for(self, version: str) -> None:
        """Another rank pushes: wait until every live server holds `version`."""
        deadline = time.monotonic() + WAIT_FOR_VERSION_S
        for client in self.live():
            while client.weight_version() != version:
                if time.monotonic() > deadline:
                    raise ServerError(f"rollout server {client.url} did not receive weight version {version} from "
                                      f"rank 0 within {WAIT_FOR_VERSION_S:.0f} s")
                time.sleep(0.05)

    # ---- servers in and out of the rotation ---------------------------------------------------------

    def live(self) -> list[ServerClient]:
        return [c for c in self.clients if c.alive]

    def _drop(self, client: ServerClient, exc: BaseException) -> None:
        with self._lock:
            if client.alive:
                client.alive, client.failure = False, str(exc)
                log.warning("rollout server %s left the rotation: %s", client.url, exc)

    def _require_live(self, doing: str) -> None:
        if not self.live():
            failures = "; ".join(f"{c.url}: {c.failure}" for c in self.clients)
            raise ServerError(f"every rollout server failed {doing} ({failures}); restart them (rlft serve) and "
                              "continue with `rlft train --resume`")

    def _pick(self) -> ServerClient:
        with self._lock:
            live = [c for c in self.clients if c.alive]
            if not live:
                raise ServerError("no rollout server left")
            client = min(live, key=lambda c: c.outstanding)
            client.outstanding += 1
            return client

    # ---- sampling ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, first_prompt: int = 0,
                 streams: Sequence[str] | None = None) -> list[Completion]:
        """As `VLLMEngine.generate` (the streams, the greedy copies), one request per prompt."""
        call, self._calls = call_number(self._calls, streams)
        if not prompts:
            return []
        seeds = request_seeds(self._seed, self._stream, call, len(prompts), 1, first_prompt, streams)
        check_request(params)
        caps = token_caps(prompts, params, streams is not None, self.max_model_len)
        self.sync_weights()
        jobs = [self._pool.submit(self._sample, list(p), params, seed, cap) for p, seed, cap in zip(prompts, seeds, caps)]
        copies = params.n if params.temperature == 0 else 1
        out = []
        for i, (prompt, job) in enumerate(zip(prompts, jobs)):
            for choice in sorted(job.result(), key=lambda c: c["index"]):
                out += [self._completion(i, list(prompt), choice, params) for _ in range(copies)]
        return out

    def _payload(self, prompt: list[int], params: SamplingParams, seed: int, cap: int) -> dict[str, Any]:
        payload = {"token_ids": prompt, "sampling_params": {
            "n": 1 if params.temperature == 0 else params.n, "temperature": params.temperature, "max_tokens": cap,
            "seed": seed, "stop": list(params.stop) or None, "stop_token_ids": self.stop_ids, "ignore_eos": True,
            "logprobs": 0, "detokenize": bool(params.stop), "skip_special_tokens": True}}
        if self._adapter_sync:
            payload["model"] = self.version
        return payload

    def _sample(self, prompt: list[int], params: SamplingParams, seed: int, cap: int) -> list[dict[str, Any]]:
        """One prompt's samples from the least busy server, moving to another when one fails."""
        payload = self._payload(prompt, params, seed, cap)
        tries = 0
        while True:
            client = self._pick()
            try:
                choices = client.generate(payload)["choices"]
            except ServerLost as exc:
                self._drop(client, exc)
                tries += 1
                if tries > self.settings.max_retries or not self.live():
                    self._require_live(f"on a request ({tries} tries)")
                    raise
                continue
            finally:
                with self._lock:
                    client.outstanding -= 1
            self._check_versions(client, choices)
            return choices

    def _check_versions(self, client: ServerClient, choices: list[dict[str, Any]]) -> None:
        expected = self.version
        for choice in choices:
            seen = {span["version"] for span in choice.get("weight_versions") or []}
            if seen != {expected}:
                raise ServerError(f"rollout server {client.url} sampled with weight version(s) {sorted(seen)}, not "
                                  f"the pushed {expected}: it missed a weight update (restarted?). Restart it and "
                                  "resume the run (`rlft train --resume`): a resume pushes the weights again")

    def _completion(self, prompt_index: int, prompt: list[int], choice: dict[str, Any],
                    params: SamplingParams) -> Completion:
        logprobs = [step["logprob"] for step in choice["logprobs"]["content"]]
        return sampled_completion(self.tokenizer, prompt_index, prompt, list(choice["token_ids"]), logprobs,
                                  choice["finish_reason"], params.stop)

    # ---- reproducibility -----------------------------------------------------------------------

    def close(self) -> None:
        """Forget the trainer hooks and close the connections; the servers keep running (and
        keep the last weights) for the next run or a resume."""
        self._tracker.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for engine in self._transfers.values():
            engine.shutdown()
        for client in self.clients:
            client.close()
