"""Soak: long runs on the tiny model, watched for leaks (RSS, open files, child processes, threads).

    OMP_NUM_THREADS=1 python benchmarks/soak.py                      # the three runs, full length
    OMP_NUM_THREADS=1 python benchmarks/soak.py --steps-scale 0.1    # a quick version (10x shorter)
    OMP_NUM_THREADS=1 python benchmarks/soak.py --runs async,agent   # some of them

Runs (GRPO on the tiny model, fp32, one torch thread, 4 prompts x G = 4, up to 16 new tokens,
a checkpoint every 100 steps: saving must not leak either):
- grpo:  500 steps, synchronous;
- async: 200 steps, rollout.async_steps = 1 with the sampler in a thread of the trainer's process;
- agent: 200 steps with the calculator tool (agent.tools = [calculator]). A random model never
  writes a tool call, so this run uses the tiny model trained to call the calculator
  (tests/agent_model.py, built in seconds); its call alone is 70 tokens, so its turns get up to
  80 new tokens (2 prompts x G = 4, up to 2 turns, 160 tokens an episode). Each call runs in a
  thread of its own: the run shows whether those end.

Each run is `rlft.api.train` in a child process (a real run, nothing of the parent's in it); the
parent samples the child (psutil, else /proc) every POLL_S seconds: resident memory, open file
descriptors, live child processes (zombies included) and threads. The step is the number of step
records in the run's metrics.jsonl. Every 50 steps (scaled) the sample of step N is the minimum of
each quantity over the probes of the WINDOW_S = 3 seconds before record N appeared (a few steps,
never before record 1; the last sample is taken before the run's export and teardown): the level the process returns
to, not the transient of a reward or tool call's thread or a checkpoint being written. The peak RSS
of the window is kept too, and the targets of the open fds (reported when fds grow).

Verdict per run, after warm-up (the first 100 steps of the 500-step run, 50 of the 200-step runs,
scaled): RSS at the last sample at most 5 % above RSS at the warm-up sample, and the file
descriptors, child processes and threads of every later sample no more than at warm-up. Prints a
table, writes benchmarks/results/soak.json (`--out`), exits 1 if a verdict fails. Models, data and
run folders go to benchmarks/work/soak/ (git-ignored); every run starts from an empty folder.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "work" / "soak"
OUT = HERE / "results" / "soak.json"

SAMPLE_EVERY = 50
CHECKPOINT_EVERY = 100
RSS_GROWTH_LIMIT = 0.05  # RSS after warm-up may grow less than this (a fraction)
COUNTS = ("fds", "children", "threads")  # these may not grow at all
POLL_S = 0.1  # seconds between probes of the child
WINDOW_S = 3.0  # a step's sample: the minimum over the probes of the last WINDOW_S seconds before its record

# name: (steps, warm-up steps, what it adds to the base config)
RUNS: dict[str, tuple[int, int, dict]] = {
    "grpo": (500, 100, {}),
    "async": (200, 50, {"rollout": {"async_steps": 1, "sampler": "thread"},
                        "algorithm": {"rollout_correction": "tis"}}),  # async_steps > 0 needs a correction
    "agent": (200, 50, {"rollout": {"prompts_per_step": 2, "max_new_tokens": 80},
                        "agent": {"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 160}}),
}


@dataclass(frozen=True)
class Plan:
    name: str
    steps: int
    warmup: int  # the step of the warm-up sample
    every: int  # sample every this many steps
    checkpoint_every: int

    @property
    def sample_steps(self) -> list[int]:
        steps = list(range(self.every, self.steps + 1, self.every))
        if self.warmup not in steps:
            steps.append(self.warmup)
        if steps[-1] != self.steps:
            steps.append(self.steps)
        return sorted(set(steps))


def plan(name: str, scale: float = 1.0, steps: int | None = None, warmup: int | None = None) -> Plan:
    """The run's length, warm-up and sampling interval at `scale` (or explicit steps / warm-up:
    the sampling and checkpoint intervals then follow the steps' ratio to the full length)."""
    full, full_warmup, _ = RUNS[name]
    if steps is not None:
        scale = steps / full
    steps = steps if steps is not None else max(2, round(full * scale))
    warmup = warmup if warmup is not None else max(1, round(full_warmup * scale))
    every = max(1, round(SAMPLE_EVERY * scale))
    return Plan(name, steps, min(warmup, steps), every, max(1, round(CHECKPOINT_EVERY * scale)))


# -- inputs --------------------------------------------------------------------------------------

def prepare(work: Path, names: list[str]) -> dict[str, Path]:
    """The models and prompt files the runs need, built once into `work`."""
    work.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    prompts = work / "prompts.jsonl"
    if not prompts.exists():
        rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10, 90, 7) for b in (3, 25, 61)]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["prompts"] = prompts
    if any(n != "agent" for n in names):
        model = work / "tiny-model"
        if not (model / "config.json").exists():
            from rlft.models.tiny import build_tiny_model
            shutil.rmtree(model, ignore_errors=True)
            build_tiny_model(model, seed=0)
        paths["model"] = model
    if "agent" in names:
        calc = work / "calculator-model"
        if not (calc / "config.json").exists():
            sys.path.insert(0, str(ROOT / "tests"))
            from agent_model import build_calculator_model  # the tiny model trained to call the calculator
            shutil.rmtree(calc, ignore_errors=True)
            build_calculator_model(calc)
        sys.path.insert(0, str(ROOT / "tests"))
        from agent_model import prompt_rows
        agent_prompts = work / "agent-prompts.jsonl"
        agent_prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
        paths["calculator-model"], paths["agent-prompts"] = calc, agent_prompts
    return paths


def run_config(p: Plan, paths: dict[str, Path], output_dir: Path) -> dict:
    """The rlft config of one soak run."""
    agent = p.name == "agent"
    cfg: dict = {
        "method": "grpo", "output_dir": str(output_dir), "seed": 0,
        "model": {"path": str(paths["calculator-model" if agent else "model"])},
        "data": {"train": str(paths["agent-prompts" if agent else "prompts"])},
        # a small learning rate: the agent run's model keeps calling the tool for the whole run
        "training": {"learning_rate": 1e-5, "lr_scheduler": "constant", "max_steps": p.steps, "num_threads": 1,
                     "precision": "fp32"},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 16, "temperature": 1.0},
        "rewards": [{"fn": f"{HERE / 'rewards.py'}:digit_share"}],
        "checkpoint": {"every": p.checkpoint_every, "keep_last": 2},
        "logging": {"progress": False, "sample_every": 10},
    }
    for section, values in RUNS[p.name][2].items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


# -- sampling the child --------------------------------------------------------------------------

def probe(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open fds, live child processes (recursive, zombies included) and threads of
    `pid`, or None once it is gone."""
    try:
        import psutil
    except ImportError:
        return _probe_proc(pid)
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return {"rss_mb": proc.memory_info().rss / 2**20, "fds": proc.num_fds(),
                    "children": len(proc.children(recursive=True)), "threads": proc.num_threads()}
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def _children_proc(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids + [g for k in kids for g in _children_proc(k)]


def _probe_proc(pid: int) -> dict[str, float] | None:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        status = dict(line.split(":", 1) for line in lines if ":" in line)
        if status.get("State", "").strip().startswith("Z"):
            return None
        return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "children": len(_children_proc(pid)), "threads": int(status["Threads"])}
    except (OSError, KeyError, ValueError):
        return None


def fd_targets(pid: int) -> list[str]:
    """Where the child's file descriptors point (for a report when fds grow)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            out.append(os.readlink(fd))
        except OSError:
            pass
    return sorted(out)


class StepCounter:
    """Counts the step records of a growing metrics.jsonl, reading only what is new."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest, self.step = path, 0, b"", 0

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.step
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and "reward/mean" in row:
                self.step = max(self.step, row["step"])
        return self.step


def measure(p: Plan, cfg: dict, run_dir: Path, log: Path, poll_s: float = POLL_S, window_s: float = WINDOW_S) -> dict:
    """Runs `cfg` in a child process and samples it at p.sample_steps; returns the run's record."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / f"{p.name}.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MKL_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    code = "import json, sys; from rlft.api import train; train(json.load(open(sys.argv[1])))"
    wanted = p.sample_steps
    taken: dict[int, dict] = {}  # step -> its sample
    fds_at: dict[int, list[str]] = {}  # step -> the fd targets of its sample
    recent: collections.deque = collections.deque()  # (time, probe, fd targets) of the last window_s seconds
    counter = StepCounter(run_dir / "metrics.jsonl")
    started = time.time()
    with open(log, "w") as logf:
        child = subprocess.Popen([sys.executable, "-c", code, str(cfg_path)], stdout=logf, stderr=subprocess.STDOUT,
                                 env=env, cwd=ROOT)
        while True:
            done = counter.poll()  # steps whose record is written
            now = time.time()
            for n in wanted:  # record n just came: its sample is the window of probes before it
                if n <= done and n not in taken and recent:
                    taken[n] = {"step": n, "time_s": round(now - started, 1),
                                **{key: min(r[1][key] for r in recent) for key in ("rss_mb", *COUNTS)},
                                "rss_peak_mb": max(r[1]["rss_mb"] for r in recent), "probes": len(recent)}
                    fds_at[n] = min(recent, key=lambda r: r[1]["fds"])[2]
            sample = probe(child.pid) if child.poll() is None else None
            if sample is None:
                if child.poll() is not None:
                    break
            elif done >= 1:  # from the first record on: the start-up (loading, the first step) is no window
                recent.append((now, sample, fd_targets(child.pid)))
                while recent and recent[0][0] < now - window_s:
                    recent.popleft()
            time.sleep(poll_s)
        rc = child.wait()
    samples = [taken[n] for n in sorted(taken)]
    record = {"run": p.name, "steps": p.steps, "warmup_step": p.warmup, "sample_every": p.every,
              "checkpoint_every": p.checkpoint_every, "returncode": rc, "wall_s": round(time.time() - started, 1),
              "steps_done": counter.poll(), "log": str(log), "samples": samples,
              "verdict": verdict(samples, p.warmup, p.steps if rc == 0 else None)}
    grown = record["verdict"].get("fds_growth", 0) > 0
    if grown and p.warmup in fds_at:
        last = max(fds_at)
        record["fd_targets"] = {"warmup": fds_at[p.warmup], "last": fds_at[last]}
    for key in ("rss_mb", "rss_peak_mb"):
        for s in samples:
            s[key] = round(s[key], 1)
    return record


def verdict(samples: list[dict], warmup_step: int, final_step: int | None) -> dict:
    """RSS growth from the warm-up sample to the last (< 5 %), and each count's largest later value
    less its warm-up value (<= 0). `final_step`: the run must have reached it (None: it failed)."""
    by_step = {s["step"]: s for s in samples}
    if final_step is None or warmup_step not in by_step or final_step not in by_step:
        return {"ok": False, "why": "the run did not complete, or a sample is missing"
                                    f" (sampled steps {sorted(by_step)})"}
    warm, last = by_step[warmup_step], by_step[final_step]
    after = [s for s in samples if s["step"] >= warmup_step]
    out: dict = {"rss_growth": (last["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"]}
    for key in COUNTS:
        out[f"{key}_growth"] = max(s[key] for s in after) - warm[key]
    failed = [f"RSS +{out['rss_growth']:.1%}"] if out["rss_growth"] >= RSS_GROWTH_LIMIT else []
    failed += [f"{key} +{out[f'{key}_growth']}" for key in COUNTS if out[f"{key}_growth"] > 0]
    out["ok"] = not failed
    out["why"] = ", ".join(failed) if failed else "no growth after warm-up"
    return out


# -- report --------------------------------------------------------------------------------------

def table(records: list[dict]) -> str:
    lines = ["| run | step | RSS MiB | peak RSS MiB | fds | children | threads |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        for s in r["samples"]:
            mark = " (warm-up)" if s["step"] == r["warmup_step"] else ""
            lines.append(f"| {r['run']} | {s['step']}{mark} | {s['rss_mb']:.1f} | {s['rss_peak_mb']:.1f} | "
                         f"{s['fds']} | {s['children']} | {s['threads']} |")
    lines += ["", "| run | steps | wall s | RSS growth | fds | children | threads | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for r in records:
        v = r["verdict"]
        growth = (f"{v['rss_growth']:+.1%} | " + " | ".join(f"{v[f'{k}_growth']:+d}" for k in COUNTS)
                  if "rss_growth" in v else "| | |")
        lines.append(f"| {r['run']} | {r['steps_done']}/{r['steps']} | {r['wall_s']:.0f} | {growth} | "
                     f"{'PASS' if v['ok'] else 'FAIL'}: {v['why']} |")
    return "\n".join(lines)


def machine() -> dict:
    import torch
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(), "load_1min_at_start": load,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def soak(names: list[str], scale: float = 1.0, work: Path = WORK, poll_s: float = POLL_S,
         plans: dict[str, Plan] | None = None) -> list[dict]:
    """The named runs, one after another; their records (see `measure`)."""
    paths = prepare(work, names)
    records = []
    for name in names:
        p = (plans or {}).get(name) or plan(name, scale)
        print(f"[soak] {name}: {p.steps} steps, warm-up {p.warmup}, a sample every {p.every}, "
              f"a checkpoint every {p.checkpoint_every} ...", flush=True)
        run_dir = work / "runs" / name
        rec = measure(p, run_config(p, paths, run_dir), run_dir, work / f"{name}.log", poll_s)
        print(f"[soak] {name}: {'PASS' if rec['verdict']['ok'] else 'FAIL'} ({rec['verdict']['why']}), "
              f"{rec['wall_s']:.0f} s", flush=True)
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale every run's length (0.1: quick)")
    parser.add_argument("--runs", default="grpo,async,agent", help="comma-separated subset of " + ",".join(RUNS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--work", type=Path, default=WORK)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        parser.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    if args.steps_scale <= 0:
        parser.error("--steps-scale must be > 0")
    info = machine()
    records = soak(names, args.steps_scale, args.work)
    print(table(records))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "steps_scale": args.steps_scale,
                                    "rss_growth_limit": RSS_GROWTH_LIMIT, "runs": records}, indent=1) + "\n")
    print(f"[soak] wrote {args.out}")
    return 0 if all(r["verdict"]["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
