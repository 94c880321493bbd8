"""GPU check: every training method end to end on CUDA at bf16-mixed (what `precision: auto`
picks on a bf16 GPU), with step times and peak memory.

    python benchmarks/gpu_check.py OUT_DIR [--size small]

Runs SFT, GRPO (full, LoRA, vLLM engine), DAPO (LoRA + checkpointing), RLOO, REINFORCE++, PPO
(separate critic and shared value head), asynchronous GRPO (k = 1: hf full and LoRA, vLLM, and the
sampler on a second GPU where there is one), DPO and reward-model training for a few steps each on the
~27M-parameter test model, times rlft's rollout engine against `model.generate` on the same batch,
then runs the test suite's CUDA-only tests (`pytest -m cuda`: QLoRA with bitsandbytes, fp16-mixed's
loss scaler, bf16-mixed, NCCL on 2+ GPUs, vLLM sleep mode, the planner against
torch.cuda.max_memory_allocated). Writes OUT_DIR/gpu_check.json (after every stage, so a run cut
short keeps what it measured) and OUT_DIR/pytest-cuda.txt. Needs a CUDA GPU.

Server mode (issue 41; `--server on`, the default, runs it after the stages above and before the
CUDA tests; `--server only` runs SFT and then it alone; `--server off` skips it): `rlft serve` on the
GPU and a short GRPO (the SFT model, `--server-steps` steps, the grpo stages' config) with the
trainer pointing at it through `rollout.servers`, the API key in RLFT_SERVER_API_KEY. Checks that the
weight transfer the trainer chose is the expected one (nccl on CUDA: the engine's log line "weight
transfer to URL: nccl via ADDR") and that rollout/logprob_diff_max stays within the bound the
colocated vLLM engine is held to (0.08 at bf16-mixed, tests/test_bf16.py's BF16_LOGPROB_BOUND;
1e-3 in fp32); records s/step against colocated vLLM on the same config and command (each run is
`gpu_check.py --run-child SPEC` in its own process) and the seconds of each weight push
(ServerEngine.sync_seconds: the first includes opening the transfer group, the rest are one per
optimizer step). Layout: with 2+ GPUs the server takes GPUs 1..k (tensor parallel k, the largest power of
two <= n-1 dividing the head count) and the trainer GPU 0; with one GPU the server sits beside the
trainer on it (--gpu-memory-utilization 0.35, a fixed KV cache). NCCL refuses two ranks on one GPU
("Duplicate GPU detected"), so on one GPU the nccl run is expected to fail at the first push and a
second server with --weight-transfer rlft_gloo (rlft's gloo engine, still a GPU server) gives the
server path's numbers. Bounded by --server-budget-s; every server is stopped at the end (SIGTERM to
its process group, SIGKILL after a grace period) whatever happened, and the JSON says whether any of
its processes outlived that. `--allow-cpu` runs the server mode without CUDA as a smoke test (fp32,
rlft_gloo, the tiny model recommended):

    python benchmarks/gpu_check.py /tmp/gpu-out                           # everything (GPU)
    python benchmarks/gpu_check.py /tmp/gpu-out --server only             # SFT + server mode (GPU)
    OMP_NUM_THREADS=1 python benchmarks/gpu_check.py /tmp/cpu-out --server only --allow-cpu --size tiny
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
_SAVE_TO: Path | None = None  # gpu_check.json, rewritten after every stage
_INTERRUPTED: str | None = None  # the signal that stopped the check


def stage(results: dict, name: str, fn) -> None:
    cuda = torch.cuda.is_available()  # False only in the server mode's --allow-cpu smoke test
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        info = fn() or {}
        results[name] = {"ok": True, "seconds": round(time.perf_counter() - start, 2),
                         "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None, **info}
    except Exception:
        results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    print(name, json.dumps(results[name])[:400], flush=True)
    save(results)


def save(results: dict) -> None:
    if _SAVE_TO is not None:
        _SAVE_TO.write_text(json.dumps(results, indent=2))


def step_times(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["time/step"] for r in rows if "time/step" in r) or \
        sorted(r["step_time"] for r in rows if "step_time" in r)
    last = rows[-1]
    keep = {k: last[k] for k in ("reward/mean", "loss", "kl", "eval/accuracy", "eval/rewards/accuracy") if k in last}
    return {"median_step_s": times[len(times) // 2] if times else None, "steps": len(times), **keep}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="where gpu_check.json, pytest-cuda.txt and the server logs go")
    parser.add_argument("--size", default="small", choices=["tiny", "small"],
                        help="test model: small (~27M parameters, default) or tiny (~1M)")
    parser.add_argument("--server", default="on", choices=["on", "off", "only"],
                        help="server mode (rlft serve + a GRPO against it): on (after the other stages, before "
                             "the CUDA tests; default), off, or only (SFT, then the server mode alone)")
    parser.add_argument("--server-budget-s", type=float, default=300.0,
                        help="wall-clock limit of the whole server mode, servers' start and stop included "
                             "(default 300)")
    parser.add_argument("--server-steps", type=int, default=6, help="GRPO steps per server-mode run (default 6)")
    parser.add_argument("--server-transfers", default="auto",
                        help="comma-separated weight transfers to run a server with (nccl, rlft_gloo); auto: "
                             "nccl with 2+ GPUs, nccl and rlft_gloo with one, rlft_gloo without CUDA")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="smoke-test the server mode without CUDA (with --server only): fp32, rlft_gloo")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not (args.allow_cpu and args.server == "only"):
        parser.error("needs a CUDA GPU (without one, only `--server only --allow-cpu` runs: a smoke test)")
    return args


def main() -> None:
    global _SAVE_TO
    args = parse_args(sys.argv[1:])
    out, size = args.out_dir.resolve(), args.size
    out.mkdir(parents=True, exist_ok=True)
    _SAVE_TO = out / "gpu_check.json"
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # `timeout` / a lease ending: the servers still get stopped
    from rlft.api import train
    from rlft.models.tiny import build_tiny_model

    cuda = torch.cuda.is_available()
    results: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                     "size": size, "gpus": torch.cuda.device_count()}
    work = Path("/tmp/rlft-gpu")
    shutil.rmtree(work, ignore_errors=True)  # fresh runs: a run dir left by an earlier check would be resumed
    model = build_tiny_model(work / "model", size=size, seed=0, overwrite=True)
    data = REPO / "examples" / "data"
    fmt = r"\d\+\d=\d+, carry [01]\. \d\+\d\+[01]=\d+\. The answer is \d+\."
    common = {"seed": 0, "logging": {"progress": False},
              "model": {"path": str(model), "device": "cuda" if cuda else "cpu"}}
    mixed = {"precision": "bf16-mixed"} if cuda else {"precision": "fp32", "num_threads": 1}  # cpu: --allow-cpu
    rl_rewards = [{"fn": "regex", "name": "format", "args": {"pattern": fmt, "mode": "fullmatch"}}]

    def sft():
        cfg = {**common, "method": "sft", "output_dir": str(work / "sft"),
               "data": {"train": str(data / "arith_sft.jsonl")},
               "training": {**mixed, "learning_rate": 1e-3, "batch_size": 64, "max_steps": 60}}
        train(cfg)
        return step_times(work / "sft")

    def online_config(name, method, **extra):
        cfg = {**common, "method": method, "output_dir": str(work / name),
               "model": {**common["model"], "path": str(work / "sft" / "final")},
               "data": {"train": str(data / "arith_rl_prompts.jsonl")}, "rewards": rl_rewards,
               "training": {**mixed, "learning_rate": 1e-5, "max_steps": 6},
               "rollout": {"group_size": 8, "prompts_per_step": 16, "max_new_tokens": 48}}
        for key, value in extra.items():
            cfg[key] = {**cfg.get(key, {}), **value}
        return cfg

    def online(name, method, **extra):
        train(online_config(name, method, **extra))
        return step_times(work / name)

    def server_mode():
        if cuda:
            torch.cuda.empty_cache()  # what the stages above left cached, for the server and the runs' processes
        steps = {"training": {**mixed, "learning_rate": 1e-5, "max_steps": args.server_steps}}
        server_section(results, args, out, model=work / "sft" / "final",
                       config=lambda name, **extra: online_config(name, "grpo", **steps, **extra))

    def preference(name, method):
        cfg = {**common, "method": method, "output_dir": str(work / name),
               "model": {**common["model"], "path": str(work / "sft" / "final")},
               "data": {"train": str(data / "arith_pref_train.jsonl"), "eval": str(data / "arith_pref_heldout.jsonl")},
               "training": {**mixed, "learning_rate": 1e-4, "batch_size": 32, "max_steps": 10}}
        train(cfg)
        return step_times(work / name)

    def generation():
        from rlft.config import LoraConfig, ModelConfig
        from rlft.models.loading import load_policy
        from rlft.models.template import encode_prompt, end_of_turn_ids
        from rlft.rollout.contract import SamplingParams
        from rlft.rollout.hf import HFEngine

        policy = load_policy(ModelConfig(path=str(work / "sft" / "final"), dtype="bf16", device="cuda"), LoraConfig())  # sampling only
        prompts = [encode_prompt(policy.tokenizer, [{"role": "user", "content": f"What is {10 + i} + {30 + i}?"}])
                   for i in range(16)]
        engine = HFEngine(policy.model, policy.tokenizer, end_of_turn_ids(policy.tokenizer), policy.device)
        params = SamplingParams(n=8, max_new_tokens=64)
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        rlft_s = time.perf_counter() - t
        tokens = sum(len(o.completion_ids) for o in outs)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), policy.tokenizer.pad_token_id, device="cuda")
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kwargs = dict(do_sample=True, num_return_sequences=8, max_new_tokens=64, temperature=1.0, top_k=0,
                      eos_token_id=end_of_turn_ids(policy.tokenizer), pad_token_id=policy.tokenizer.pad_token_id)
        policy.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen = policy.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - t
        hf_tokens = int((gen[:, width:] != policy.tokenizer.pad_token_id).sum())
        return {"rlft_tokens_per_s": round(tokens / rlft_s), "hf_generate_tokens_per_s": round(hf_tokens / hf_s)}

    stage(results, "sft", sft)
    if args.server == "only":
        server_mode()
        return finish(results)
    stage(results, "grpo_full", lambda: online("grpo_full", "grpo"))
    stage(results, "grpo_lora", lambda: online("grpo_lora", "grpo", lora={"enabled": True, "r": 16, "alpha": 32}))
    stage(results, "dapo_lora_ckpt", lambda: online("dapo", "dapo", lora={"enabled": True},
                                                   model={"gradient_checkpointing": True}))
    stage(results, "grpo_vllm", lambda: online("grpo_vllm", "grpo", rollout={"engine": "vllm"}))
    # issue 26: a sampler thread one step ahead (hf, vLLM), and on a GPU of its own where there are two
    correct = {"rollout_correction": "tis"}
    stage(results, "grpo_async_k1", lambda: online("grpo_async", "grpo", rollout={"async_steps": 1}, algorithm=correct))
    stage(results, "grpo_async_k1_lora", lambda: online("grpo_async_lora", "grpo", rollout={"async_steps": 1},
                                                        algorithm=correct, lora={"enabled": True}))
    stage(results, "grpo_vllm_async_k1", lambda: online("grpo_vllm_async", "grpo", algorithm=correct,
                                                        rollout={"engine": "vllm", "async_steps": 1}))
    if torch.cuda.device_count() > 1:
        stage(results, "grpo_async_sampler_gpu1", lambda: online(
            "grpo_async_gpu1", "grpo", algorithm=correct,
            rollout={"async_steps": 1, "sampler_device": "cuda:1"}, model={"device": "cuda:0"}))
    else:
        results["grpo_async_sampler_gpu1"] = {"ok": True, "skipped": "one GPU: rollout.sampler_device needs a second"}
    stage(results, "rloo", lambda: online("rloo", "rloo"))
    stage(results, "reinforce_pp", lambda: online("reinforce_pp", "reinforce_pp"))
    stage(results, "ppo_separate", lambda: online("ppo", "ppo", critic={"warmup_steps": 1}))
    stage(results, "ppo_shared", lambda: online("ppo_shared", "ppo", critic={"kind": "shared", "warmup_steps": 1}))
    stage(results, "dpo", lambda: preference("dpo", "dpo"))
    stage(results, "reward_model", lambda: preference("rm", "reward_model"))
    stage(results, "generation", generation)
    if args.server == "on":
        server_mode()
    else:
        results["server"] = {"skipped": "--server off"}
    stage(results, "pytest_cuda", lambda: cuda_tests(out))
    finish(results)


def finish(results: dict) -> None:
    save(results)
    print("ALL OK" if all(v.get("ok", True) for v in results.values() if isinstance(v, dict)) else "FAILURES")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    global _INTERRUPTED
    _INTERRUPTED = signal.Signals(signum).name
    raise SystemExit(128 + signum)  # unwinds through the server mode's finally


def cuda_tests(out: Path) -> dict:
    """tests/ marked `cuda` (skipped on machines without a GPU), in a fresh process; raises when
    one fails, so the stage records the failure."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda",
                           "tests"], cwd=REPO, capture_output=True, text=True, timeout=3600)
    (out / "pytest-cuda.txt").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode != 0:
        raise RuntimeError(f"pytest -m cuda: {summary}\n{done.stdout[-2500:]}")
    return {"summary": summary}



# ---- server mode (issue 41) ------------------------------------------------------------------------

# rollout/logprob_diff_max the colocated vLLM engine is held to: bf16-mixed trainer vs a bf16 engine
# (tests/test_bf16.py's BF16_LOGPROB_BOUND), fp32 vs fp32 (tests/test_vllm_engine.py's runs)
LOGPROB_BOUND = {"bf16-mixed": 0.08, "fp32": 1e-3}
SERVER_GPU_MEMORY_UTILIZATION = 0.35  # vLLM's start-up check; the KV cache is fixed below
KV_CACHE_BYTES = {"cuda": 4 << 30, "cpu": 1 << 30}  # the same for the servers and the colocated engine
STOP_GRACE_S = 45.0  # rlft serve gives vLLM 30 s after its SIGTERM, then SIGKILLs its group
TRANSFER_LINE = re.compile(r"weight transfer to (\S+): (\S+) via (\S+)")


def server_section(results: dict, args: argparse.Namespace, out: Path, model: Path, config) -> None:
    """`rlft serve` + GRPO against it, next to colocated vLLM on the same config: stages server_start,
    server_colocated, server_<transfer> (one per transfer), server_stop, and the summary under
    results["server"]. `config(name, **extra)` is the grpo stages' config for a run named `name`."""
    deadline = time.monotonic() + args.server_budget_s
    cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if cuda else 0
    heads = json.loads((model / "config.json").read_text())["num_attention_heads"] if model.is_dir() else 1
    layout = server_layout(n_gpus, heads)
    transfers = ([t.strip() for t in args.server_transfers.split(",") if t.strip()] if args.server_transfers != "auto"
                 else ["rlft_gloo"] if not cuda else ["nccl", "rlft_gloo"] if n_gpus == 1 else ["nccl"])
    precision = "bf16-mixed" if cuda else "fp32"
    bound = LOGPROB_BOUND[precision]
    kv = KV_CACHE_BYTES["cuda" if cuda else "cpu"]
    key = secrets.token_hex(16)  # the servers' key, in the environment only (as users give it)
    env = {**os.environ, "RLFT_SERVER_API_KEY": key}
    if not cuda:
        env.setdefault("OMP_NUM_THREADS", "1")
    summary: dict = {"layout": layout, "transfers": transfers, "precision": precision, "logprob_bound": bound,
                     "steps": args.server_steps, "budget_s": args.server_budget_s}
    results["server"] = summary
    if not (model / "config.json").is_file():
        results["server_start"] = {"ok": False, "error": f"no SFT model at {model} (the sft stage failed?)"}
        return save(results)
    servers: dict[str, Server] = {}
    try:
        def start():
            for transfer in transfers:  # all at once: vLLM's start-up dominates; fixed KV caches, no profiling race
                servers[transfer] = Server(model, transfer, layout, "bf16" if cuda else "fp32", kv, out, env)
            ready, failed = {}, []
            for transfer, server in servers.items():
                try:
                    ready[transfer] = server.wait_ready(deadline - STOP_GRACE_S)
                except RuntimeError as exc:
                    failed.append(str(exc))
            if failed:
                raise RuntimeError(f"started: {ready}\n" + "\n".join(failed))
            return {"servers": ready}

        stage(results, "server_start", start)
        up = {t: s for t, s in servers.items() if s.url}

        def child_timeout(cap_s: float) -> float:
            left = deadline - time.monotonic() - STOP_GRACE_S
            if left < 20:
                raise RuntimeError(f"server mode out of time (--server-budget-s {args.server_budget_s:.0f})")
            return min(left, cap_s)

        def server_run(transfer: str) -> dict:
            server = up.get(transfer)
            if server is None:
                raise RuntimeError(f"the {transfer} server did not start: {server_failure(servers.get(transfer))}")
            cfg = config(f"server_{transfer}", model={"path": str(model), "device": layout["trainer_device"]},
                         rollout={"engine": "vllm", "servers": [server.url]})
            run = run_child(f"server_{transfer}", cfg, out, child_timeout(600 if not cuda else 180), env)
            chosen = run["transfer_chosen"]
            info = pick(run, "transfer_chosen", "median_step_s", "steps", "logprob_diff_max", "reward/mean",
                        "sync_seconds", "sync_s_first", "sync_s_per_update_median", "weight_sync_metric_per_step",
                        "weight_pushes", "transfers", "transfer_engines", "wall_s", "child_peak_cuda_mb", "engine_log")
            if chosen != [transfer]:
                why = f" (the run: {error_line(run.get('error'), prefer=())})" if not run["ok"] else ""
                raise CheckFailed(f"expected the {transfer} weight transfer, the engine chose {chosen or 'none'}{why}",
                                  info, run)
            if not run["ok"]:
                raise CheckFailed(f"the run against the {transfer} server failed: "
                                  f"{error_line(run.get('error'), prefer=())}", info, run)
            if run["steps"] != args.server_steps:
                raise CheckFailed(f"{run['steps']} of {args.server_steps} steps recorded", info, run)
            if not all(d <= bound for d in run["logprob_diff_per_step"]):
                raise CheckFailed(f"rollout/logprob_diff_max {run['logprob_diff_per_step']} above the colocated "
                                  f"bound {bound}", info, run)
            if len(run["sync_seconds"]) < args.server_steps:  # a push before each step's sampling
                raise CheckFailed(f"{len(run['sync_seconds'])} weight pushes for {args.server_steps} steps", info, run)
            return info

        def colocated() -> dict:
            cfg = config("server_colocated", model={"path": str(model), "device": layout["trainer_device"]},
                         rollout={"engine": "vllm", "vllm": {"kv_cache_bytes": kv}})
            run = run_child("server_colocated", cfg, out, child_timeout(900 if not cuda else 240), env)
            info = pick(run, "median_step_s", "steps", "logprob_diff_max", "reward/mean", "wall_s",
                        "child_peak_cuda_mb")
            if not run["ok"]:
                raise CheckFailed(f"the colocated run failed: {error_line(run.get('error'), prefer=())}", info, run)
            if not all(d <= bound for d in run["logprob_diff_per_step"]):
                raise CheckFailed(f"colocated rollout/logprob_diff_max {run['logprob_diff_per_step']} above {bound}",
                                  info, run)
            return info

        # the transfer expected to work first, colocated next (the servers idle), nccl on one GPU last (it
        # is expected to fail there, and a hang would only cost what is left of the budget)
        order = [t for t in transfers if not (t == "nccl" and n_gpus == 1)]
        for transfer in order:
            stage(results, f"server_{transfer}", lambda t=transfer: server_run(t))
        stage(results, "server_colocated", colocated)
        for transfer in transfers:
            if transfer not in order:
                stage(results, f"server_{transfer}", lambda t=transfer: server_run(t))
    finally:
        stage(results, "server_stop", lambda: stop_servers(servers))
        summarise_servers(results, summary)


class CheckFailed(RuntimeError):
    def __init__(self, message: str, info: dict, run: dict):
        detail = {k: v for k, v in info.items() if k != "engine_log"}
        error = run.get("error") or ""
        engine_log = "\n".join(run.get("engine_log", [])[-6:])
        super().__init__(f"{message}\nmeasured: {json.dumps(detail)[:1500]}\nengine log:\n{engine_log}\n"
                         f"{'run error: ' + error[-1500:] if error else ''}\nlog: {run.get('log')}")


def server_layout(n_gpus: int, heads: int) -> dict:
    """Where the server and the trainer go. NCCL cannot put two ranks of one group on one GPU, so
    with 2+ GPUs the server takes GPUs 1..k and the trainer GPU 0; with one they share it."""
    if n_gpus == 0:
        return {"server_gpus": None, "tensor_parallel_size": 1, "trainer_device": "cpu", "shared_gpu": False}
    if n_gpus == 1:
        return {"server_gpus": "0", "tensor_parallel_size": 1, "trainer_device": "cuda:0", "shared_gpu": True}
    tp = 1
    while tp * 2 <= n_gpus - 1 and heads % (tp * 2) == 0:
        tp *= 2
    return {"server_gpus": ",".join(str(i) for i in range(1, 1 + tp)), "tensor_parallel_size": tp,
            "trainer_device": "cuda:0", "shared_gpu": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # resolved here, not in the forked child (no loader lock taken between fork and exec)
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _own_group_dies_with_parent() -> None:
    """In a child before exec: its own process group (stopped as a whole), SIGTERM when this
    script dies, even by SIGKILL."""
    os.setsid()
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class Server:
    """One `rlft serve` process (its own process group; vLLM under it in another group)."""

    def __init__(self, model: Path, transfer: str, layout: dict, dtype: str, kv_bytes: int, out: Path, env: dict):
        self.transfer, self.port, self.url = transfer, free_port(), None
        self.log_path = out / f"serve-{transfer}.log"
        self.cmd = [sys.executable, "-m", "rlft", "serve", str(model), "--port", str(self.port),
                    "--tensor-parallel-size", str(layout["tensor_parallel_size"]), "--dtype", dtype,
                    "--weight-transfer", transfer, "--kv-cache-bytes", str(kv_bytes),
                    "--gpu-memory-utilization", str(SERVER_GPU_MEMORY_UTILIZATION)]
        env = dict(env)
        if layout["server_gpus"] is not None:
            env["CUDA_VISIBLE_DEVICES"] = layout["server_gpus"]
        self.log = open(self.log_path, "w")  # noqa: SIM115 (open while the server runs; closed by stop)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     preexec_fn=_own_group_dies_with_parent)  # noqa: PLW1509 (setsid, prctl)
        self.descendants: set[int] = set()

    def wait_ready(self, until: float) -> dict:
        """Until `rlft serve` prints its URL line (it does once vLLM answers /health)."""
        while time.monotonic() < until:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("rlft serve: http"):
                    self.url = line.split()[2]
                    self.descendants = descendants(self.proc.pid)
                    return {"url": self.url, "start_s": round(time.monotonic() - self.started, 1), "line": line}
            if self.proc.poll() is not None:
                raise RuntimeError(f"rlft serve ({self.transfer}) exited with status {self.proc.returncode} while "
                                   f"starting; {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(0.5)
        raise RuntimeError(f"rlft serve ({self.transfer}) not ready within the budget; {self.log_path}:\n"
                           f"{tail(self.log_path)}")

    def stop(self) -> dict:
        """SIGTERM to its process group (rlft serve stops vLLM's group in turn), SIGKILL to the
        groups of everything it started if rlft serve outlives STOP_GRACE_S or leaves a process
        behind; says which."""
        self.descendants |= descendants(self.proc.pid)
        groups = ({self.proc.pid} | {g for g in map(pgid_of, self.descendants) if g is not None}) - {os.getpgrp()}
        start = time.monotonic()
        forced = False
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                forced = True
        outlived = still_alive(self.descendants, wait_s=5.0)
        if forced or outlived:  # what rlft serve should have stopped itself
            for group in groups:
                try:
                    os.killpg(group, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait()
        self.log.close()
        return {"stop_s": round(time.monotonic() - start, 1), "exit_status": self.proc.returncode,
                "processes": 1 + len(self.descendants), "needed_sigkill": forced, "outlived_rlft_serve": len(outlived),
                "left_after_sigkill": len(still_alive(self.descendants, wait_s=5.0))}


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def still_alive(pids: set[int], wait_s: float) -> list[int]:
    """Those of `pids` still running (zombies aside) after up to `wait_s`."""
    until = time.monotonic() + wait_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= until:
            return left
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def tail(path: Path, chars: int = 2500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def server_failure(server: Server | None) -> str:
    return "never started" if server is None else tail(server.log_path, 800)


def stop_servers(servers: dict) -> dict:
    stopped, errors = {}, []
    for transfer, server in servers.items():
        try:
            stopped[transfer] = server.stop()
        except Exception:  # noqa: BLE001 (stop the others whatever this one raised)
            errors.append(traceback.format_exc()[-800:])
    left = sum(s["left_after_sigkill"] for s in stopped.values())
    if errors or left:
        raise RuntimeError(f"servers not stopped cleanly: {stopped} {errors}")
    return {"servers": stopped}


def error_line(error: str | None, prefer: tuple[str, ...] = ("CheckFailed", "RuntimeError")) -> str:
    """An exception's message, first line, out of a traceback: the first of a `prefer` kind (a
    stage's own error), else the last one raised."""
    found = re.findall(r"^(?:\w+\.)*(\w+(?:Error|Failed|Exception|Halted|Interrupt|Exit)): (.*)$", error or "",
                       flags=re.MULTILINE)
    first = next((f for f in found if f[0] in prefer), found[-1] if found else None)
    return f"{first[0]}: {first[1]}"[:500] if first else (error or "").strip()[-300:]


def g3(x: object) -> object:
    return f"{x:.3g}" if isinstance(x, float) else x


def pick(run: dict, *keys: str) -> dict:
    return {k: run[k] for k in keys if k in run}


def run_child(name: str, cfg: dict, out: Path, timeout_s: float, env: dict) -> dict:
    """`gpu_check.py --run-child SPEC` (train(cfg), instrumented) in its own process group; its
    result, or an error after `timeout_s` (SIGTERM, then SIGKILL, to its group)."""
    spec, result, log = out / f"{name}.spec.json", out / f"{name}.result.json", out / f"{name}.log"
    result.unlink(missing_ok=True)
    shutil.rmtree(cfg["output_dir"], ignore_errors=True)  # a fresh run (an existing one would be resumed)
    spec.write_text(json.dumps({"cfg": cfg, "result": str(result)}, indent=2))
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--run-child", str(spec)], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                preexec_fn=_own_group_dies_with_parent)  # noqa: PLW1509 (setsid + a resolved prctl)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise RuntimeError(f"{name}: no result within {timeout_s:.0f} s; {log}:\n{tail(log)}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the run left in its group (vLLM workers)
            except ProcessLookupError:
                pass
    if not result.is_file():
        raise RuntimeError(f"{name}: exited with status {proc.returncode} and no result; {log}:\n{tail(log)}")
    return {**json.loads(result.read_text()), "log": str(log)}


def child_main(spec_path: str) -> None:
    """One training run for the server mode: train(cfg) with the server engine watched (its log
    lines, each push's seconds); writes the result JSON the spec names."""
    spec = json.loads(Path(spec_path).read_text())
    cfg = spec["cfg"]
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            print(f"[engine] {record.getMessage()}", file=sys.stderr, flush=True)

    engine_log = logging.getLogger("rlft.rollout.servers.engine")
    engine_log.setLevel(logging.INFO)
    engine_log.addHandler(Keep())
    engines: list = []
    if cfg["rollout"].get("servers"):
        from rlft.rollout.servers.engine import ServerEngine

        init = ServerEngine.__init__

        def watched_init(self, *a, **k):
            init(self, *a, **k)
            engines.append(self)

        ServerEngine.__init__ = watched_init
    from rlft.api import train

    result: dict = {"ok": False}
    start = time.perf_counter()
    try:
        summary = train(cfg)
        result.update(ok=True, summary=json.loads(json.dumps(summary, default=str)))
    except BaseException:  # noqa: BLE001 (recorded: the parent reports it)
        result["error"] = traceback.format_exc()[-4000:]
    result["wall_s"] = round(time.perf_counter() - start, 2)
    run = Path(cfg["output_dir"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").is_file() else []
    if rows:
        result.update(step_times(run))
    diffs = [r["rollout/logprob_diff_max"] for r in rows if "rollout/logprob_diff_max" in r]
    result["logprob_diff_per_step"] = diffs
    result["logprob_diff_max"] = max(diffs) if diffs else None
    result["steps"] = sum(1 for r in rows if "reward/mean" in r)
    syncs = [r["time/weight_sync"] for r in rows if "time/weight_sync" in r]
    if syncs:
        result["weight_sync_metric_per_step"] = [round(x, 4) for x in syncs]  # the run's time/weight_sync
    chosen = {m.group(2) for m in map(TRANSFER_LINE.search, lines) if m}  # "weight transfer to URL: nccl via ADDR"
    if engines:
        sync = [s for e in engines for s in e.sync_seconds]
        described = {url: how for e in engines for url, how in getattr(e, "transfers", {}).items()}
        chosen |= {how.split()[0] for how in described.values()}
        result.update(sync_seconds=[round(s, 4) for s in sync], sync_s_first=round(sync[0], 4) if sync else None,
                      sync_s_per_update_median=round(sorted(sync[1:])[len(sync[1:]) // 2], 4) if sync[1:] else None,
                      weight_pushes=sum(e.weight_pushes for e in engines), transfers=described,
                      transfer_engines=sorted({type(t).__name__ for e in engines
                                               for t in getattr(e, "_transfers", {}).values()}))
    result["transfer_chosen"] = sorted(chosen)
    if torch.cuda.is_available():
        result["child_peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    result["engine_log"] = lines
    Path(spec["result"]).write_text(json.dumps(result, indent=2))


def summarise_servers(results: dict, summary: dict) -> None:
    """results["server"]: the comparison in one place, and printed."""
    colocated = results.get("server_colocated", {})
    base = colocated.get("median_step_s")
    runs = {}
    for transfer in summary["transfers"]:
        r = results.get(f"server_{transfer}", {})
        runs[transfer] = {"ok": r.get("ok", False),
                          **pick(r, "transfer_chosen", "median_step_s", "logprob_diff_max", "sync_s_first",
                                 "sync_s_per_update_median", "sync_seconds")}
        if base and r.get("median_step_s"):
            runs[transfer]["step_vs_colocated"] = round(r["median_step_s"] / base, 3)
        if not r.get("ok", False):
            runs[transfer]["error"] = error_line(r.get("error")) if "error" in r else "not run"
    if _INTERRUPTED:
        summary["interrupted"] = f"{_INTERRUPTED}: the server mode stopped early (the runs not reported did not finish)"
    summary.update(colocated={"ok": colocated.get("ok", False),
                              **pick(colocated, "median_step_s", "logprob_diff_max")}, runs=runs,
                   stop=results.get("server_stop", {}).get("servers"))
    save(results)
    layout = summary["layout"]
    where = ("CPU" if layout["server_gpus"] is None else f"server on GPU(s) {layout['server_gpus']}, trainer on "
             f"{layout['trainer_device']}{' (shared)' if layout['shared_gpu'] else ''}")
    print(f"\n== server mode: {where}, tensor parallel {layout['tensor_parallel_size']}, {summary['precision']}, "
          f"{summary['steps']} GRPO steps, log-prob bound {summary['logprob_bound']}", flush=True)
    print(f"  colocated vLLM      : s/step {g3(colocated.get('median_step_s'))}  logprob_diff_max "
          f"{g3(colocated.get('logprob_diff_max'))}  {'ok' if colocated.get('ok') else 'FAILED'}", flush=True)
    for transfer, r in runs.items():
        print(f"  server {transfer:<12} : s/step {g3(r.get('median_step_s'))} (x{r.get('step_vs_colocated')} "
              f"colocated)  transfer chosen {r.get('transfer_chosen')}  weight sync: first {g3(r.get('sync_s_first'))} "
              f"s, per update (median) {g3(r.get('sync_s_per_update_median'))} s  logprob_diff_max "
              f"{g3(r.get('logprob_diff_max'))}  {'ok' if r['ok'] else 'FAILED: ' + r.get('error', '')}", flush=True)
    print(f"  servers stopped     : {summary['stop']}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-child"]:
        child_main(sys.argv[2])
    else:
        main()
