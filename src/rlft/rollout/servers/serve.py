"""`rlft serve`: a vLLM OpenAI-compatible server set up for training against (`rollout.servers`).

It runs vLLM's own server (`python -m vllm.entrypoints.openai.api_server`) with:
- the RL weight routes (VLLM_SERVER_DEV_MODE=1) and a weight transfer backend: vLLM's NCCL where
  CUDA is, else rlft's gloo engine (servers/transfer.py, loaded in every server process through
  the `vllm.general_plugins` entry point);
- the token-in/token-out route `/inference/v1/generate` (`--enable-scale-out`), log-probs of the
  temperature-scaled distribution (`--logprobs-mode processed_logprobs`, the trainer's);
- runtime LoRA loading when `--lora-rank` is given (the trainer sends adapters);
- `servers/guard.RouteGuard` as middleware: the key on every route but /health (vLLM's own
  `--api-key` leaves the weight routes open), and `/rlft/info` (what the trainer checks).
The key travels in the environment, never on a command line. Binding anything but a loopback
address without a key is refused. The server runs in its own process group, which is stopped as
a whole on SIGINT / SIGTERM (and when `rlft serve` dies: the child gets SIGTERM with it).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlft.config import ModelConfig, ServerSettings, load_config
from rlft.errors import ConfigError, RlftError
from rlft.models.loading import load_tokenizer
from rlft.rollout.servers.client import model_facts, tokenizer_facts
from rlft.rollout.servers.guard import INFO_ENV, KEY_ENV
from rlft.rollout.vllm_engine import CPU_KV_CACHE_BYTES, VLLM_DTYPES, lora_slot

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEY_ENV_DEFAULT = ServerSettings.model_fields["api_key_env"].default
STOP_GRACE_S = 30.0


@dataclass
class ServeOptions:
    model: Path  # a model folder (config.json), a run directory or a run config (.yaml)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    tensor_parallel_size: int = 1
    lora_rank: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    weight_transfer: str = "auto"  # auto | nccl | rlft_gloo
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    extra_args: tuple[str, ...] = ()


def resolve_served_model(target: Path) -> tuple[Path, int | None]:
    """(the model folder to serve, the LoRA rank its run trains or None). A run directory or a
    run's config serves the run's starting model (the trainer pushes its weights on start)."""
    config_file = target / "config.yaml" if target.is_dir() and (target / "config.yaml").is_file() else \
        target if target.suffix in (".yaml", ".yml") and target.is_file() else None
    if config_file is None:
        if not (target / "config.json").is_file():
            raise RlftError(f"{target} is not a model folder (no config.json), a run directory or a run config "
                            "(.yaml); give the model the run trains, e.g. rlft serve runs/tiny-model")
        return target, None
    cfg = load_config(config_file)
    model = Path(cfg.model.path)
    if not model.is_absolute():
        model = (config_file.parent / model) if (config_file.parent / model).exists() else model
    return model, (cfg.lora.r if cfg.lora.enabled else None)


def model_info(model: Path, opts: ServeOptions, backend: str) -> dict[str, Any]:
    from transformers import AutoConfig

    facts = model_facts(AutoConfig.from_pretrained(model))
    return {"model": {**facts, "path": str(model)}, "tokenizer": tokenizer_facts(load_tokenizer(ModelConfig(path=str(model)))),
            "weight_transfer": backend,
            "tensor_parallel_size": opts.tensor_parallel_size, "max_lora_rank": opts.lora_rank}


def server_command(model: Path, opts: ServeOptions, backend: str, on_gpu: bool) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", opts.host, "--port", str(opts.port), "--tensor-parallel-size", str(opts.tensor_parallel_size),
           "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
           "--weight-transfer-config", json.dumps({"backend": backend}),
           "--middleware", "rlft.rollout.servers.guard.RouteGuard", "--dtype", VLLM_DTYPES.get(opts.dtype, opts.dtype),
           "--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if opts.max_model_len:
        cmd += ["--max-model-len", str(opts.max_model_len)]
    kv = opts.kv_cache_bytes or (None if on_gpu else CPU_KV_CACHE_BYTES)
    if kv:
        cmd += ["--kv-cache-memory-bytes", str(kv)]
    if not on_gpu:
        # eager (no compile on CPU), and whole prompts per step: a prompt split over steps rewinds the
        # request's seeded generator, which CPU generators cannot do (see rollout/vllm_engine.py)
        cmd += ["--enforce-eager", "--no-enable-chunked-prefill"]
    if opts.lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_slot(opts.lora_rank)), "--max-loras", "2"]
    return cmd + list(opts.extra_args)


def check_options(opts: ServeOptions) -> None:
    if opts.host not in LOOPBACK and not opts.api_key:
        raise ConfigError(f"rlft serve --host {opts.host} opens the server (and its weight-update routes) to the "
                          f"network: give it a key (--api-key, or the {KEY_ENV_DEFAULT} environment variable), or "
                          "bind 127.0.0.1")
    if opts.weight_transfer not in ("auto", "nccl", "rlft_gloo"):
        raise ConfigError(f"--weight-transfer {opts.weight_transfer!r}: choose auto, nccl or rlft_gloo")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when rlft serve dies (even by SIGKILL), and its own group."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (API server, engine core, workers), then
    SIGKILL to whatever is left after a grace period: no orphan workers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


ANY_ADDRESS = ("", "0.0.0.0", "::")


def server_url(host: str, port: int, any_address: str) -> str:
    """The URL of a server bound to `host` (`any_address` standing in for a bind to every address);
    an IPv6 address in brackets."""
    name = any_address if host in ANY_ADDRESS else host
    return f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"


def wait_until_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RlftError(f"the vLLM server exited with status {proc.returncode} while starting (its log is above)")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RlftError(f"the vLLM server did not answer {url}/health within {timeout_s:.0f} s")


def serve(opts: ServeOptions, ready_timeout_s: float = 900.0, announce: Any = print) -> int:
    """Run the server until it exits or a signal stops it; the exit status."""
    import torch

    check_options(opts)
    model, run_rank = resolve_served_model(opts.model)
    if opts.lora_rank is None:
        opts.lora_rank = run_rank
    on_gpu = torch.cuda.is_available()
    backend = opts.weight_transfer if opts.weight_transfer != "auto" else ("nccl" if on_gpu else "rlft_gloo")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", INFO_ENV: json.dumps(model_info(model, opts, backend)),
           KEY_ENV: opts.api_key or ""}
    env.pop("VLLM_API_KEY", None)  # one key, checked by the guard on every route
    if opts.lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if not on_gpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    url = server_url(opts.host, opts.port, socket.getfqdn())  # bound to every address: the machine's name
    proc = subprocess.Popen(server_command(model, opts, backend, on_gpu), env=env, preexec_fn=_die_with_parent)
    try:
        wait_until_ready(proc, server_url(opts.host, opts.port, "127.0.0.1"), ready_timeout_s)
        announce(f"rlft serve: {url} serving {model} (weight transfer: {backend}, tensor parallel "
                 f"{opts.tensor_parallel_size}, {'API key required' if opts.api_key else 'no API key: loopback only'})"
                 + (f", LoRA up to rank {lora_slot(opts.lora_rank)}" if opts.lora_rank else ""))
        announce(f"train against it with rollout: {{engine: vllm, servers: [{url}]}}")
        return proc.wait()
    finally:
        stop_group(proc)
