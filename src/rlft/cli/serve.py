"""`rlft serve`: a vLLM server to train against (rollout.servers); see rlft/rollout/servers/serve.py."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def serve(
    model: Path = typer.Argument(..., help="What to serve: a model folder, a run directory or a run config (.yaml); "
                                           "a run serves its starting model and LoRA rank."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; anything but loopback needs an API key."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Key every route but /health asks for (default: "
                                                                  "the RLFT_SERVER_API_KEY environment variable)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", min=1,
                                             help="GPUs the model is split over (vLLM tensor parallelism)."),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", min=1,
                                            help="Accept LoRA adapters up to this rank (runs that train LoRA send "
                                                 "adapters; default: the run's rank when MODEL is a run)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", min=1,
                                                help="Longest prompt + completion (default: the model's)."),
    dtype: str = typer.Option("auto", help="auto, fp32, bf16 or fp16: the dtype the server computes in."),
    weight_transfer: str = typer.Option("auto", "--weight-transfer",
                                        help="How weights arrive: nccl (CUDA), rlft_gloo (CPU/TCP); auto: nccl "
                                             "where CUDA is."),
    kv_cache_bytes: Optional[int] = typer.Option(None, "--kv-cache-bytes", min=1,
                                                 help="KV cache size (default: 1 GiB on CPU, "
                                                      "--gpu-memory-utilization on GPUs)."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", min=0.05, max=1.0,
                                                 help="Share of each GPU vLLM may use."),
    vllm_args: Optional[List[str]] = typer.Option(None, "--vllm-arg",
                                                  help="Extra argument for vLLM's server, repeatable "
                                                       "(e.g. --vllm-arg=--max-num-seqs=64)."),
) -> None:
    """Serve MODEL with vLLM for training: the weight-update routes, rlft's transfer backend, the
    key on every route. Prints the URL; Ctrl-C or SIGTERM stops it and its workers."""
    from rlft.paths import stop_on
    from rlft.rollout.servers.client import server_key
    from rlft.rollout.servers.serve import KEY_ENV_DEFAULT, ServeOptions
    from rlft.rollout.servers.serve import serve as run_server

    stop_on(None if model.exists() else f"MODEL {model} does not exist")
    opts = ServeOptions(model=model, host=host, port=port, api_key=api_key or server_key(KEY_ENV_DEFAULT),
                        tensor_parallel_size=tensor_parallel_size, lora_rank=lora_rank, max_model_len=max_model_len,
                        dtype=dtype, weight_transfer=weight_transfer, kv_cache_bytes=kv_cache_bytes,
                        gpu_memory_utilization=gpu_memory_utilization, extra_args=tuple(vllm_args or ()))
    raise typer.Exit(run_server(opts, announce=lambda line: typer.echo(line)))


def register(app: typer.Typer) -> None:
    app.command("serve", help="Serve a model with vLLM for training against it (rollout.servers): weight-update "
                              "routes, the API key on every route, clean stop on Ctrl-C.")(serve)
