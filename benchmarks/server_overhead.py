"""Rollouts on an `rlft serve` server vs the colocated vLLM engine, and the weight push per update.

    .venv/bin/python benchmarks/server_overhead.py [--steps 10] [--repeats 2] [--sync-steps 11] [--no-bf16]

1. **The demo's GRPO stage both ways.** The configs `rlft demo` writes (`rlft.demo.tiny.configs`):
   its SFT stage once (the ~1M model `rlft tiny-model` writes, the demo's base model; kept in
   benchmarks/work/ for later runs), then its GRPO stage from the SFT model -- 16 prompts x G = 8
   two-digit additions, at most 48 new tokens, temperature 1.0, lr 1e-4 constant, no KL, the math +
   format rewards, one torch thread -- with `rollout.engine: vllm` colocated (the engine core in the
   trainer's process) and through one `rlft serve` server on this machine (`rollout.servers`),
   alternating, `--repeats` runs of each. Same seed, same steps: the two paths sample the same
   completions (the JSON's `same_rewards`). `training.precision: fp32` and float32 engines on both
   paths: the demo's `auto` is bf16-mixed on a CPU with bf16 units and float32 elsewhere; fp32 keeps
   the comparison the same on every machine. A colocated run runs with no server up; a server runs
   only for its run. The held-out evaluations the demo runs after each stage are left out.
   Reported: medians over every run's steps 2.. of `time/step` and `time/generate` (sampling alone:
   the push of a step's new weights runs after its update, inside `time/step`, outside
   `time/generate`, on both paths), the median `time/weight_sync` (the server push), server /
   colocated.
2. **The weight push per update** for the ~1M and the ~28M model (`rlft tiny-model --size small`,
   random weights) into a float32 and a bf16 server (the trainer sends float32 either way; a bf16
   server casts as it loads): a light GRPO run (4 prompts x G = 4 of benchmarks/prompts.jsonl, 16 new
   tokens, the digit-share reward of the other benchmarks, so the weights change every step) through
   a fresh server; the median `time/weight_sync` over steps 2.. (step 1's push also opens the gloo
   group: reported apart as the first push).

`time/weight_sync` is the last push's seconds (step k's: the push after step k-1's update; step 1's:
the initial one), so a step whose weights did not change (all-equal rewards in every group) repeats
the previous value; only steps with a new push are counted (`steps_with_a_push`). Every run is its own `rlft train` process; every server an `rlft serve`
process in its own session, stopped with SIGTERM (then SIGKILL for anything of it left) in a
`finally`. Models, data, configs, logs and run folders go to benchmarks/work/server_overhead/; the
results to benchmarks/results/server_overhead.json with the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "work" / "server_overhead"
KV_CACHE_BYTES = 256 << 20  # the same on both paths
SIZES = {"tiny": "~1M", "small": "~28M"}
T0 = time.perf_counter()  # runs record when they ran (seconds from here), to read against the load samples


def env() -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    out.pop("RLFT_SERVER_API_KEY", None)  # loopback servers without a key
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class Server:
    """`rlft serve MODEL --dtype D` in its own session; `stop()` ends it and everything it started."""

    def __init__(self, model: Path, dtype: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.started = time.perf_counter()
        self.ready_s: float | None = None
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen([sys.executable, "-m", "rlft", "serve", str(model), "--port", str(self.port),
                                      "--dtype", dtype, "--kv-cache-bytes", str(KV_CACHE_BYTES)],
                                     cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._known: set[psutil.Process] = set()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        with open(self.log, "w") as fh:
            for line in self.proc.stdout:
                fh.write(line)
                fh.flush()
                self.lines.append(line)
                if line.startswith("rlft serve: http") and not self._ready.is_set():
                    self.ready_s = time.perf_counter() - self.started
                    self._ready.set()

    def wait(self, timeout: float = 600) -> Server:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rlft serve did not start ({self.log}):\n" + "".join(self.lines[-30:]))
        self._known.update(tree(self.proc.pid))
        return self

    def stop(self) -> list[int]:
        """SIGTERM to rlft serve (it stops vLLM's process group), SIGKILL to anything left; the pids killed."""
        self._known.update(tree(self.proc.pid))  # before it exits: its children are re-parented then
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        killed = []
        for p in self._known:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return killed


def build_model(size: str) -> Path:
    model = WORK / f"model-{size}"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "rlft", "tiny-model", str(model), "--size", size, "--force"],
                       check=True, capture_output=True, env=env(), cwd=ROOT)
    return model


def model_sizes(model: Path) -> dict:
    """Parameters (a tied head counted once) and the float32 bytes one push sends: every tensor of
    the state dict, the tied `lm_head.weight` included (rlft.rollout.vllm_weights.full_state)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return {"params": sum(p.numel() for p in m.parameters()),
            "push_mb": sum(t.numel() * t.element_size() for t in m.state_dict().values()) / 1e6}


def demo_configs(steps: int) -> dict[str, dict]:
    """The demo's SFT and GRPO stages (rlft.demo.tiny.configs), fp32, under WORK, without the
    held-out suites the demo runs after each stage's last step (not part of a step)."""
    from rlft.demo import DemoSettings
    from rlft.demo.arithmetic import make_datasets
    from rlft.demo.tiny import configs

    s = DemoSettings(engine="vllm", precision="fp32", rl_steps=steps)
    data = make_datasets(WORK / "data", s.seed, s.heldout, s.sft_rows, s.rl_rows, s.forget_rate)
    cfgs = configs(WORK, build_model("tiny"), data, s)  # the demo's base model: the same builder and seed
    for cfg in cfgs.values():
        cfg.pop("eval")
        cfg.update({"logging": {"progress": False}, "checkpoint": {"every": 10_000}})
    return cfgs


def write_config(cfg: dict, name: str) -> Path:
    cfg = {**cfg, "output_dir": str(WORK / "runs" / name)}
    path = WORK / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def demo_grpo(base: dict, name: str, servers: list[str]) -> Path:
    cfg = json.loads(json.dumps(base))
    cfg["rollout"].update({"servers": servers, "vllm": {"dtype": "fp32", "kv_cache_bytes": KV_CACHE_BYTES}})
    return write_config(cfg, name)


def sync_config(model: Path, name: str, steps: int, server: str) -> Path:
    """A light GRPO run through `server` that changes the weights every step: the digit-share reward
    of the other benchmarks (a random model's samples differ in it, so no group is all-equal)."""
    return write_config({
        "method": "grpo", "seed": 0, "model": {"path": str(model)}, "data": {"train": str(HERE / "prompts.jsonl")},
        "training": {"learning_rate": 1e-5, "max_steps": steps, "num_threads": 1, "precision": "fp32",
                     "lr_scheduler": "constant"},
        "rollout": {"engine": "vllm", "servers": [server], "group_size": 4, "prompts_per_step": 4,
                    "max_new_tokens": 16, "temperature": 1.0},
        "algorithm": {"kl_coef": 0.0}, "rewards": [{"fn": f"{HERE / 'rewards.py'}:digit_share"}],
        "logging": {"progress": False}, "checkpoint": {"every": 10_000}}, name)


def train(cfg: Path, online: bool = True) -> dict:
    out = Path(yaml.safe_load(cfg.read_text())["output_dir"])
    shutil.rmtree(out, ignore_errors=True)
    log = WORK / "logs" / f"{cfg.stem}.log"
    started = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "rlft", "train", str(cfg)], cwd=ROOT, env=env(), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        raise RuntimeError(f"rlft train {cfg} exited {rc}; its log, {log}:\n" + log.read_text()[-3000:])
    if not online:
        return {}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]
    rest = rows[1:]  # the first step warms up (and on the server path opens the weight transfer)

    def med(key: str) -> float | None:
        vals = [r[key] for r in rest if key in r]
        return statistics.median(vals) if vals else None

    # time/weight_sync is the last push's seconds: a step without a push (weights unchanged) repeats it
    syncs = [r.get("time/weight_sync") for r in rows]
    new_push = [s is not None and (i == 0 or s != syncs[i - 1]) for i, s in enumerate(syncs)]
    pushed = [s for s, new in zip(syncs[1:], new_push[1:]) if new]
    res = {"steps": len(rows), "s_per_step": med("time/step"), "generate_s": med("time/generate"),
           "weight_sync_s": statistics.median(pushed) if pushed else None,
           "steps_with_a_push": sum(new_push),
           "step_s_all": [r["time/step"] for r in rows], "generate_s_all": [r.get("time/generate") for r in rows], "completion_tokens_per_step": med("completion/tokens"),
           "first_step_s": rows[0]["time/step"], "first_weight_sync_s": rows[0].get("time/weight_sync"),
           "weight_sync_all_s": syncs,
           "reward_mean_per_step": [r.get("reward/mean") for r in rows],
           "process_wall_s": round(time.perf_counter() - started, 1), "log": str(log.relative_to(ROOT)),
           "ran_from_to_s": [round(started - T0), round(time.perf_counter() - T0)]}
    return res


def machine() -> dict:
    import torch

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                        None), "torch": torch.__version__}


def vllm_servers_left() -> list[str]:
    """vLLM API servers still running on a model of this benchmark (WORK): none should be."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.NoSuchProcess:
            continue
        if "vllm.entrypoints" in cmd and str(WORK) in cmd:
            out.append(f"{p.pid} {cmd[:200]}")
    return out


def pooled(runs: list[dict], key: str) -> float:
    """The median over every run's steps 2.. of `key` (a per-step list)."""
    return statistics.median(v for r in runs for v in r[key][1:] if v is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps of each demo run (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="demo runs per path, the paths alternating")
    parser.add_argument("--sync-steps", type=int, default=11, help="steps of each weight-push run")
    parser.add_argument("--no-bf16", action="store_true", help="float32 servers only in part 2")
    parser.add_argument("--out", default=str(HERE / "results" / "server_overhead.json"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM still runs the finally blocks
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    started = T0
    result: dict = {"command": " ".join([".venv/bin/python", str(Path(sys.argv[0]).resolve().relative_to(ROOT)),
                                         *sys.argv[1:]]),
                    "machine": machine(), "date": datetime.date.today().isoformat(),
                    "loadavg_start": os.getloadavg(), "precision": "fp32 (training.precision and the engines)",
                    "threads": 1, "kv_cache_bytes": KV_CACHE_BYTES,
                    "args": {"steps": args.steps, "repeats": args.repeats, "sync_steps": args.sync_steps,
                             "bf16": not args.no_bf16}}
    loads: list[tuple[float, float]] = []  # (seconds since the start, 1-minute load average) every 15 s
    done = threading.Event()

    def sample_load() -> None:
        while not done.wait(15):
            loads.append((round(time.perf_counter() - started), os.getloadavg()[0]))

    threading.Thread(target=sample_load, daemon=True).start()
    models = {size: build_model(size) for size in ("tiny", "small")}
    result["models"] = {size: model_sizes(path) for size, path in models.items()}
    servers: list[Server] = []

    def start(model: Path, dtype: str, tag: str) -> Server:
        server = Server(model, dtype, WORK / "logs" / f"serve-{tag}.log")
        servers.append(server)
        server.wait()
        print(f"rlft serve {tag}: ready in {server.ready_s:.1f} s at {server.url}", flush=True)
        return server

    def stop(server: Server) -> None:
        killed = server.stop()
        servers.remove(server)
        if killed:
            print(f"  (SIGKILLed what SIGTERM left of the server: {killed})", flush=True)

    try:
        # 0. the demo's SFT stage, once (kept in WORK): GRPO starts from the model it makes
        cfgs = demo_configs(args.steps)
        sft_final = WORK / "runs" / "sft" / "final"
        if not (sft_final / "config.json").exists():
            t = time.perf_counter()
            train(write_config(cfgs["sft"], "sft"), online=False)
            result["sft_s"] = round(time.perf_counter() - t, 1)
            print(f"the demo's SFT stage: {result['sft_s']} s", flush=True)
        cfgs["grpo"]["model"] = {"path": str(sft_final)}

        # 1. the demo's GRPO stage: colocated (no server up), then through one server, alternating
        local, remote = [], []
        for i in range(args.repeats):
            run = train(demo_grpo(cfgs["grpo"], f"demo-colocated-{i}", []))
            local.append(run)
            print(f"colocated vLLM {i}: {run['s_per_step']:.3f} s/step (generate {run['generate_s']:.3f}), "
                  f"{run['completion_tokens_per_step']:.0f} tokens/step, process {run['process_wall_s']} s", flush=True)
            server = start(sft_final, "fp32", f"demo-{i}")
            try:
                run = train(demo_grpo(cfgs["grpo"], f"demo-server-{i}", [server.url]))
            finally:
                stop(server)
            run["server_ready_s"] = server.ready_s
            remote.append(run)
            print(f"rlft serve {i}:     {run['s_per_step']:.3f} s/step (generate {run['generate_s']:.3f}, weight sync "
                  f"{run['weight_sync_s']:.4f}, {run['steps_with_a_push']}/{run['steps']} steps pushed), "
                  f"{run['completion_tokens_per_step']:.0f} tokens/step, process {run['process_wall_s']} s", flush=True)
        demo = {"steps": args.steps, "repeats": args.repeats, "colocated": local, "server": remote,
                "colocated_s_per_step": pooled(local, "step_s_all"), "server_s_per_step": pooled(remote, "step_s_all"),
                "colocated_generate_s": pooled(local, "generate_s_all"),
                "server_generate_s": pooled(remote, "generate_s_all"),
                "server_weight_sync_s": statistics.median(r["weight_sync_s"] for r in remote),
                "same_rewards": all(a["reward_mean_per_step"] == b["reward_mean_per_step"]
                                    for a, b in zip(local, remote))}
        demo["server_vs_colocated_step"] = demo["server_s_per_step"] / demo["colocated_s_per_step"]
        demo["server_vs_colocated_generate"] = demo["server_generate_s"] / demo["colocated_generate_s"]
        result["demo"] = demo
        print(f"median s/step: colocated {demo['colocated_s_per_step']:.3f}, server {demo['server_s_per_step']:.3f} "
              f"({demo['server_vs_colocated_step']:.2f}x; generation {demo['server_vs_colocated_generate']:.2f}x, "
              f"weight sync {demo['server_weight_sync_s']:.4f} s); the same rewards every step: "
              f"{demo['same_rewards']}", flush=True)

        # 2. the weight push per update: each model into a float32 (and a bf16) server
        result["weight_sync"] = []
        for size in ("tiny", "small"):
            for dtype in ("fp32",) if args.no_bf16 else ("fp32", "bf16"):
                server = start(models[size], dtype, f"{size}-{dtype}")
                try:
                    run = train(sync_config(models[size], f"sync-{size}-{dtype}", args.sync_steps, server.url))
                finally:
                    stop(server)
                mb = result["models"][size]["push_mb"]  # float32 on the wire
                row = {"model": size, "params": result["models"][size]["params"], "server_dtype": dtype,
                       "mb_sent": mb, "server_ready_s": server.ready_s, **run,
                       "mb_per_s": mb / run["weight_sync_s"] if run["weight_sync_s"] else None}
                result["weight_sync"].append(row)
                print(f"weight push {size} ({SIZES[size]}, {mb:.1f} MB) -> {dtype} server: "
                      f"{run['weight_sync_s']:.4f} s median ({row['mb_per_s']:.0f} MB/s; "
                      f"{run['steps_with_a_push']}/{run['steps']} steps pushed), first push (opens the group) "
                      f"{run['first_weight_sync_s']:.3f} s; {run['s_per_step']:.3f} s/step", flush=True)
    finally:
        while servers:  # stop() takes each off the list
            stop(servers[-1])
    done.set()
    left = vllm_servers_left()
    result.update({"loadavg_end": os.getloadavg(), "wall_s": round(time.perf_counter() - started, 1),
                   "loadavg_1min_every_15s": loads,
                   "vllm_servers_left": left})
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} in {result['wall_s']} s; this benchmark's vLLM servers left running: {left or 'none'}")


if __name__ == "__main__":
    main()
