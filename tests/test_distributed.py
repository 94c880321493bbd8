"""Data parallelism on torch.distributed (FSDP2 over gloo on this CPU, two ranks under torchrun):
N ranks compute what one process would, checkpoints move between world sizes, and a dead rank
ends the job instead of hanging it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import DIGITS_REWARD, assert_clean_user_error, children_of, descendants, run_main
from rlft.demo.arithmetic import preference_rows, split_problems
from rlft.models.tiny import build_tiny_model

DRIVER = str(Path(__file__).parent / "dist_driver.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    build_tiny_model(root / "model", seed=0)
    (root / "reward.py").write_text(DIGITS_REWARD)
    (root / "sft.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {i} + {i % 7}?", "completion": f"The answer is {i + i % 7}."}) + "\n"
        for i in range(24)))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(16)))
    pairs = preference_rows(split_problems()[0][:12], seed=3)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return root


def config(root: Path, method: str, name: str, lora: bool = False, held_out: bool = False, **training) -> Path:
    cfg = {"method": method, "output_dir": str(root / name), "seed": 0,
           "model": {"path": str(root / "model"), "device": "cpu"},
           "lora": {"enabled": lora, "r": 4, "alpha": 8, "dropout": 0.0},
           # adam_eps 1e-6: a gradient element near 0 differs between layouts only by summation-order
           # noise, which Adam's g / sqrt(v) would blow up to a full learning-rate step at eps 1e-8
           # fp32: layouts are compared to 1e-5, float32 summation-order noise (tests/test_bf16.py has
           # the bf16-mixed comparison with its own bound)
           "training": {"learning_rate": 1e-3, "adam_eps": 1e-6, "num_threads": 1, "lr_scheduler": "constant",
                        "dist_timeout_s": 60, "precision": "fp32", **training},
           "checkpoint": {"every": 1, "keep_last": 3}, "logging": {"progress": False}}
    if method == "sft":
        cfg["data"] = {"train": str(root / "sft.jsonl"), "max_length": 64, "shuffle": False}
        cfg["training"].setdefault("batch_size", 8)
        if held_out:  # eval loss plus greedy generations
            cfg["data"]["eval"] = str(root / "sft.jsonl")
            cfg["eval"] = {"max_new_tokens": 4, "max_examples": 4}
    elif method == "dpo":
        cfg["data"] = {"train": str(root / "pairs.jsonl"), "max_length": 96}
        if held_out:
            cfg["data"]["eval"] = str(root / "pairs.jsonl")
        cfg["training"].setdefault("batch_size", 4)
    else:
        cfg["data"] = {"train": str(root / "prompts.jsonl")}
        cfg["rollout"] = {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8}
        cfg["rewards"] = [{"fn": f"{root / 'reward.py'}:digits"}]
    cfg["training"].setdefault("max_steps", 3)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(*configs: Path, replay: bool = True, ranks: int = 2, env: dict | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """The configs run one after another in `ranks` processes (torchrun), or in one plain process."""
    args = [DRIVER, *(["replay"] if replay else []), *map(str, configs)]
    command = [sys.executable, *args] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})})


def in_process(cfg: Path, replay: bool = True, tool_calls: bool = False) -> dict:
    """A single-process run in this process (the reference the ranks are compared with);
    `tool_calls`: the replay engine writes calculator calls (dist_driver's `replay-calls`)."""
    import rlft.training.online.loop as online
    from dist_driver import use_replay_engine
    from rlft.api import train

    real = online.rollout_engine
    if replay:
        use_replay_engine(tool_calls)
    try:
        return train(cfg)
    finally:
        online.rollout_engine = real
        torch.set_num_threads(1)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def assert_close_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= atol, worst


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# gspo: sequence-level ratios and a per-sequence mean, whose normaliser must count both ranks' sequences
RUNS = [("sft", False), ("sft", True), ("dpo", False), ("grpo", False), ("grpo", True), ("gspo", False), ("cispo", True)]


@pytest.fixture(scope="module")
def two_ranks(root) -> subprocess.CompletedProcess:
    """Every method of RUNS trained on two ranks, the full fine-tunes with a held-out eval (and SFT
    resumed), then GRPO with the real engines: the HF engine (synchronous, then with
    rollout.async_steps=1), and a vLLM engine per rank (one
    torchrun: the processes start once; the vLLM run last, since an engine leaves its process
    group behind it when it closes)."""
    runs = [config(root, m, f"{m}{'-lora' if lora else ''}-2", lora) for m, lora in RUNS]
    # each prompt once per group on both ranks (FSDP: the models' full-logits path), see below
    runs += [config(root, "grpo", f"grpo{'-lora' if lora else ''}-prefix-2", lora, shared_prefix="on")
             for lora in (False, True)]
    # the same run as sft-eval-2, one step longer: it resumes from sft-eval-2's last checkpoint
    more = config(root, "sft", "sft-eval-2", held_out=True, max_steps=3, eval_every=1, precision="fp32")
    more = more.rename(root / "sft-eval-2-more.yaml")
    held_out = [config(root, m, f"{m}-eval-2", held_out=True, max_steps=2, eval_every=1, precision="fp32")
                for m in ("sft", "dpo")]
    hf = config(root, "grpo", "grpo-hf-2", precision="fp32")
    hf_async = async_config(root, "async-hf-2")  # rollout.async_steps=1 on two ranks, the HF engine
    vllm = config(root, "grpo", "grpo-vllm-2", precision="fp32")
    cfg = yaml.safe_load(vllm.read_text())
    cfg["rollout"].update(engine="vllm", vllm={"kv_cache_bytes": 1 << 26})
    vllm.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           DRIVER, "replay", *map(str, runs + held_out + [more]), f"real:{hf}", str(hf_async),
                           str(vllm)],
                          capture_output=True, text=True, timeout=900, env=ENV)


@pytest.mark.parametrize("method, lora", RUNS)
def test_two_ranks_train_what_one_process_trains(root, two_ranks, method, lora):
    """Same global batch, same data (for GRPO the same completions: see dist_driver.py): after 3
    optimizer steps the parameters agree to 1e-5 and so do the logged losses."""
    assert two_ranks.returncode == 0, two_ranks.stderr[-3000:]
    name = f"{method}{'-lora' if lora else ''}"
    assert in_process(config(root, method, f"{name}-1", lora))["status"] == "completed"
    assert_close_weights(root / f"{name}-2", root / f"{name}-1", atol=1e-5)
    m2, m1 = metrics(root / f"{name}-2"), metrics(root / f"{name}-1")
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3]
    assert [r["loss"] for r in m2] == pytest.approx([r["loss"] for r in m1], rel=1e-5, abs=1e-7)
    assert (root / f"{name}-2" / "checkpoints" / "step-00000003" / "dcp").is_dir()  # every rank's shard


@pytest.mark.parametrize("lora", [False, True])
def test_two_ranks_sharing_prompts_train_what_one_plain_process_trains(root, two_ranks, lora):
    """training.shared_prefix: on, on two ranks (each group's prompt computed once in the policy's and
    the reference's forwards), against one process with every row computed alone: the same
    parameters after 3 steps to 1e-5 and the same logged losses."""
    assert two_ranks.returncode == 0, two_ranks.stderr[-3000:]
    name = f"grpo{'-lora' if lora else ''}"
    plain = config(root, "grpo", f"{name}-plain-1", lora, shared_prefix="off")
    assert in_process(plain)["status"] == "completed"
    assert_close_weights(root / f"{name}-prefix-2", root / f"{name}-plain-1", atol=1e-5)
    m2, m1 = metrics(root / f"{name}-prefix-2"), metrics(root / f"{name}-plain-1")
    assert [r["loss"] for r in m2] == pytest.approx([r["loss"] for r in m1], rel=1e-5, abs=1e-7)


def test_each_rank_samples_on_its_own_vllm_engine(root, two_ranks):
    """rollout.engine: vllm on two ranks: one engine per rank, fed the weights gathered from the
    shards after every step (its log-probs equal the trainer's before each update)."""
    assert two_ranks.returncode == 0, two_ranks.stderr[-3000:]
    rows = metrics(root / "grpo-vllm-2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]


def test_full_fine_tunes_checkpoint_after_a_held_out_eval(root, two_ranks):
    """Issue 23: a held-out eval of a full fine-tune on two ranks (SFT, DPO) ran the sharded model
    forward with no backward after it, which leaves FSDP's root unit unsharded; the checkpoint
    after it then died with KeyError: 0 in get_optimizer_state_dict. Trained with an eval and a
    checkpoint after every step, then SFT resumed from its step-2 checkpoint to step 3."""
    assert two_ranks.returncode == 0, two_ranks.stderr[-3000:]
    for name, steps in (("sft-eval-2", [1, 2, 3]), ("dpo-eval-2", [1, 2])):
        run = root / name
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["step"] == steps[-1], summary
        assert (run / "final" / "model.safetensors").is_file()
        assert (run / "checkpoints" / f"step-{steps[-1]:08d}" / "dcp").is_dir()
        rows = metrics(run)
        assert [r["step"] for r in rows] == steps
        assert all("eval/loss" in r for r in rows)
    assert "(step 2 of 3)" in " ".join(two_ranks.stderr.split())  # resumed, not started again


def test_each_rank_samples_from_the_trained_weights_with_the_hf_engine(root, two_ranks):
    """Issue 24: the two-rank runs above sample with a stand-in engine whose sync_weights does
    nothing. With the real HF engine each rank samples from its whole copy of the policy, which
    must be brought up to the trained shards after every optimizer step: the trainer's log-probs
    of the sampled tokens (before the update) then equal the engine's, at fp32 to summation-order
    noise. A stale copy differs after step 1 by what one update at lr 1e-3 moves."""
    assert two_ranks.returncode == 0, two_ranks.stderr[-3000:]
    rows = metrics(root / "grpo-hf-2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]


@pytest.mark.parametrize("first, then", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_a_run_killed_on_one_world_size_resumes_on_another(root, first, then):
    """SIGKILL right after the step-2 checkpoint, resumed on the other world size to step 4: it
    ends where an uninterrupted run ends (to float tolerance: summation order differs between
    layouts; on the same layout a resume is bitwise, see test_resume.py)."""
    name = f"kill-{first}to{then}"
    cfg = config(root, "grpo", name, max_steps=4)
    killed = launch(cfg, ranks=first, env={"RLFT_FAULT": "ckpt-done@2"})
    assert killed.returncode != 0
    assert (root / name / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert not (root / name / "final").exists()
    if then == 1:
        assert in_process(cfg)["status"] == "completed"
    else:
        resumed = launch(cfg, ranks=then)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert in_process(config(root, "grpo", f"whole-{name}", max_steps=4))["status"] == "completed"
    assert_close_weights(root / name, root / f"whole-{name}", atol=1e-5)
    assert [r["step"] for r in metrics(root / name)] == [1, 2, 3, 4]


def async_config(root: Path, name: str, output: str | None = None, agent: bool = False, **training) -> Path:
    """GRPO with rollout.async_steps=1 (a sampler thread per rank, one step ahead; tis corrects for
    it), written to NAME.yaml and training into `output` (default NAME). fp32 (config()): the
    layouts are compared to 1e-5, float32 summation-order noise. `agent`: calculator episodes,
    with room for the replay engine's calls (dist_driver.py's replay-calls)."""
    path = config(root, "grpo", name, **training)
    cfg = yaml.safe_load(path.read_text())
    cfg["rollout"]["async_steps"] = 1
    cfg["rollout"]["sampler"] = "thread"  # one process's auto would start a child (seconds); it samples alike
    cfg["algorithm"] = {"rollout_correction": "tis"}
    cfg["output_dir"] = str(root / (output or name))
    if agent:
        cfg["rollout"]["max_new_tokens"] = 80
        cfg["agent"] = {"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 200}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_two_ranks_with_async_rollouts_train_what_one_process_trains(root, two_ranks):
    """Each rank's sampler thread samples its share of every batch from the weights the trainer
    published (gathered from the shards in the loop's thread; no collective off it): after 3
    steps at k = 1 the same completions and rewards as one process at k = 1, the parameters to
    1e-5. The real HF engine, since a stale or partial copy would sample other tokens (the replay
    engine below ignores the weights); sampling runs on whole fp32 copies in both layouts, so the
    weights' summation-order noise (~1e-7) is far too small to flip a sampled token."""
    assert two_ranks.returncode == 0, two_ranks.stderr[-3000:]
    assert in_process(async_config(root, "async-hf-1"), replay=False)["status"] == "completed"
    assert_close_weights(root / "async-hf-2", root / "async-hf-1", atol=1e-5)
    m2, m1 = metrics(root / "async-hf-2"), metrics(root / "async-hf-1")
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in m2] == [0.0, 1.0, 1.0]
    assert [r["reward/mean"] for r in m2] == [r["reward/mean"] for r in m1]
    assert [r["completion/tokens"] for r in m2] == [r["completion/tokens"] for r in m1]
    assert [r["loss"] for r in m2] == pytest.approx([r["loss"] for r in m1], rel=1e-5, abs=1e-7)


@pytest.mark.slow  # ~90 s: three two-rank launches, each building a vLLM engine per rank
def test_async_rollouts_on_vllm_on_two_ranks_push_each_version_and_resume_exactly(root):
    """rollout.async_steps=1 with a vLLM engine per rank: each rank's sampler thread pushes the
    weights the trainer published (gathered from the shards) into its engine beside the training
    collectives. Step 1 samples version 0 and trains version 0 (engine and trainer agree to float
    noise), later steps sample one update older; a run stopped after 2 steps and continued equals
    the uninterrupted one bitwise."""
    def vllm_async(name: str, steps: int, output: str | None = None) -> Path:
        path = async_config(root, name, output, max_steps=steps, learning_rate=1e-2)
        cfg = yaml.safe_load(path.read_text())
        cfg["rollout"].update(engine="vllm", vllm={"kv_cache_bytes": 1 << 26})
        cfg["rollout"].pop("sampler")
        path.write_text(yaml.safe_dump(cfg))
        return path

    for cfg in (vllm_async("vllm-async-2", 3), vllm_async("vllm-async-stop-2", 2),
                vllm_async("vllm-async-stop-2-more", 3, output="vllm-async-stop-2")):
        result = launch(cfg, replay=False, timeout=300)  # one engine per launch: it outlives its group
        assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(root / "vllm-async-2")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    diffs = [r["rollout/logprob_diff_max"] for r in rows]
    assert diffs[0] < 1e-3 and all(d > 1e-3 for d in diffs[1:]), diffs  # v0 pushed, then one update old
    assert [r["reward/mean"] for r in metrics(root / "vllm-async-stop-2")] == [r["reward/mean"] for r in rows]
    whole, split = weights(root / "vllm-async-2"), weights(root / "vllm-async-stop-2")
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)



@pytest.fixture(scope="module")
def async_replay(root) -> subprocess.CompletedProcess:
    """Async runs on two ranks with the replay engine (dist_driver.py; one launch): a 3-step run;
    the same run stopped after step 1 and continued to 3 (its checkpoint holds the sampler's
    batch 2, sampled but not trained); one stopped after step 1 to be continued in one process,
    and one begun in one process continued here; agent episodes (replay-calls)."""
    async_config(root, "async-1to2", max_steps=1)
    assert in_process(root / "async-1to2.yaml")["status"] == "completed"
    runs = [async_config(root, "async-2"), async_config(root, "async-stop-2", max_steps=1),
            async_config(root, "async-stop-2-more", output="async-stop-2"), async_config(root, "async-2to1", max_steps=1),
            async_config(root, "async-1to2-more", output="async-1to2"),
            f"calls:{async_config(root, 'async-agent-2', agent=True)}"]
    return launch(*runs)


@pytest.mark.slow  # a launch of six runs (~1 min); make test-slow
def test_an_async_run_on_two_ranks_stopped_and_continued_is_exact(root, async_replay):
    """Stopped after step 1 and continued to 3 on the same two ranks: the checkpoint holds the
    queued batches whole (both ranks' shares), each rank takes its share back, and the run ends
    bit for bit where the uninterrupted one ends -- which is where one process ends, to 1e-5."""
    assert async_replay.returncode == 0, async_replay.stderr[-3000:]
    state = torch.load(root / "async-stop-2" / "checkpoints" / "step-00000001" / "trainer_state.pt",
                       weights_only=False)["parts"]["rollouts"]
    # batches 1 and 2, whole: both ranks' groups (4 prompts x 4 samples)
    assert state["first"] == 1 and [sorted(set(r.group_ids)) for r in state["rollouts"]] == [[0, 1, 2, 3]] * 2
    assert all(len(r.completions) == 16 for r in state["rollouts"])
    stopped, whole = weights(root / "async-stop-2"), weights(root / "async-2")
    assert all(torch.equal(stopped[k], whole[k]) for k in whole)
    assert [r["loss"] for r in metrics(root / "async-stop-2")] == [r["loss"] for r in metrics(root / "async-2")]
    assert in_process(async_config(root, "async-1"))["status"] == "completed"
    assert_close_weights(root / "async-2", root / "async-1", atol=1e-5)
    assert [r["reward/mean"] for r in metrics(root / "async-2")] == [r["reward/mean"] for r in metrics(root / "async-1")]


@pytest.mark.slow
def test_an_async_run_moves_between_world_sizes(root, async_replay):
    """Stopped on two ranks after step 1 and continued in one process, or the other way round: the
    run ends where one process ends (to 1e-5, the layouts' summation order)."""
    assert async_replay.returncode == 0, async_replay.stderr[-3000:]
    assert in_process(async_config(root, "async-2to1-more", output="async-2to1"))["status"] == "completed"
    if not (root / "async-1" / "final").exists():
        assert in_process(async_config(root, "async-1"))["status"] == "completed"
    for moved in ("async-2to1", "async-1to2"):
        assert [r["step"] for r in metrics(root / moved)] == [1, 2, 3]
        assert_close_weights(root / moved, root / "async-1", atol=1e-5)
        assert [r["loss"] for r in metrics(root / moved)] == \
               pytest.approx([r["loss"] for r in metrics(root / "async-1")], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_async_agent_episodes_on_two_ranks_log_the_whole_steps_metrics(root, async_replay):
    """Calculator episodes (replay-calls) at k = 1: each rank's sampler thread runs its share's
    episodes; the agent metrics, summed over ranks in the loop's thread, equal one process's."""
    assert async_replay.returncode == 0, async_replay.stderr[-3000:]
    assert in_process(async_config(root, "async-agent-1", agent=True), tool_calls=True)["status"] == "completed"
    assert_close_weights(root / "async-agent-2", root / "async-agent-1", atol=1e-5)
    a2, a1 = metrics(root / "async-agent-2"), metrics(root / "async-agent-1")
    keys = [k for k in a1[0] if k.startswith("agent/") and "latency" not in k]
    assert "agent/tool_calls_mean" in keys and all(r["agent/tool_calls_mean"] > 0.2 for r in a1)
    for r2, r1 in zip(a2, a1):
        assert {k: r2[k] for k in keys} == pytest.approx({k: r1[k] for k in keys}, rel=1e-12)


def test_a_dead_rank_ends_the_job_instead_of_hanging_it(root):
    cfg = config(root, "grpo", "dead-rank", max_steps=200)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             DRIVER, "replay", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True)
    run = root / "dead-rank"
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-00000002" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    workers = [int(p) for p in subprocess.run(["pgrep", "-f", f"dist_driver.py replay {cfg}"], capture_output=True,
                                              text=True).stdout.split() if int(p) != proc.pid]
    assert len(workers) == 2, workers
    started = time.time()
    os.kill(max(workers), signal.SIGKILL)  # one rank dies mid-run
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - started < 60  # well within dist_timeout_s (60): torchrun saw it die
    assert "exitcode  : -9" in err or "Signal 9" in err or "SIGKILL" in err, err[-2000:]


@pytest.mark.slow  # ~15-30 s each: a two-rank launch; make test keeps the dead-rank test
@pytest.mark.parametrize("method", ["grpo", "dapo"])
def test_a_reward_error_on_one_rank_stops_every_rank_at_once(root, method):
    """The failing rank names its error; the other stops at the same step naming that rank,
    instead of waiting in the update's collectives until dist_timeout_s. DAPO's dynamic sampling
    votes after each of its rounds (their collectives follow), and no second time for the batch."""
    name = f"reward-error-{method}"
    (root / f"{name}.py").write_text(  # rank 1 fails from its second step on (8 rows a round)
        "import os, pathlib\n"
        "def digits(prompt, completion, **row):\n"
        f"    calls = pathlib.Path({str(root)!r}) / ('{name}-calls-' + os.environ.get('RANK', '0'))\n"
        "    with calls.open('a') as f:\n"
        "        f.write('.')\n"
        "    if os.environ.get('RANK') == '1' and calls.stat().st_size > 8:\n"
        "        raise ValueError('rank one cannot score this')\n"
        "    return float(len(completion) % 2)  # groups with signal: dynamic sampling keeps them\n")
    cfg = yaml.safe_load(config(root, method, name).read_text())
    cfg["rewards"] = [{"fn": f"{root / (name + '.py')}:digits"}]
    cfg["training"]["dist_timeout_s"] = 300
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.time()
    result = launch(path, timeout=280)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert time.time() - started < 120, out[-3000:]  # far below dist_timeout_s: no rank waited for the other
    assert "rank one cannot score this" in out, out[-3000:]
    assert "rank 1 of 2 failed sampling or scoring its share of " in out, out[-3000:]
    # each rank stops on its own: no rank left waiting in a collective its peer never joined
    assert "[rank0]: rlft.errors.TrainingHalted" in out and "[rank1]: rlft.errors.TrainingHalted" in out, out[-3000:]
    assert "all_gather" not in out, out[-3000:]
    assert (root / name / "checkpoints" / "step-00000001" / "COMPLETE").exists(), out[-3000:]  # saved together


@pytest.mark.slow  # ~20 s: a two-rank launch
def test_any_error_on_one_rank_while_sampling_stops_every_rank_with_it(root):
    """Not only a reward or an environment: a bug on one rank (here its engine raising at step 2)
    stopped that rank alone, and the other waited in the batch's vote until torchrun killed it,
    with no checkpoint and no word of why. Now every rank raises the same error naming rank 1 and
    the bug (whose traceback rank 1 logs), after saving step 1 together."""
    name = "engine-error"
    path = config(root, "grpo", name, dist_timeout_s=300)
    started = time.time()
    result = launch(path, timeout=280, env={"DIST_DRIVER_FAIL": "1@1"})
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert time.time() - started < 120, out[-3000:]  # far below dist_timeout_s
    said = ("rank 1 of 2 failed sampling or scoring its share of the batch: RuntimeError: the replay engine "
            "failed at call 1")
    halted = [line for line in out.splitlines() if "rlft.errors.TrainingHalted: stopped:" in line]
    assert sorted(line.split(":")[0] for line in halted) == ["[rank0]", "[rank1]"], out[-3000:]
    assert all(said in line for line in halted), out[-3000:]
    assert "raise RuntimeError" in out, out[-3000:]  # the bug's traceback, in rank 1's log
    assert (root / name / "checkpoints" / "step-00000001" / "COMPLETE").exists(), out[-3000:]  # saved together


EVAL_REWARD = """
import os

def digits(prompt, completion, **row):
    if os.environ.get("RANK") == "1" and prompt.startswith("Say"):  # the held-out rows, on rank 1 alone
        raise ValueError("rank one cannot score this")
    return float(len(completion) % 2)
"""


def test_a_reward_error_in_one_ranks_evaluation_stops_every_rank_at_once(root):
    """A reward failing on rank 1 alone in the held-out evaluation after step 1 (`rlft train --nproc
    2`): rank 1 stopped while rank 0 went on into step 2's collectives and waited there until
    training.dist_timeout_s (300 s here). Now every evaluation ends in a vote (World.agree): both
    ranks save step 1 and stop at once with the same error, naming the reward and rank 1; the
    launcher's status is the ranks' (2, an `error:`), and no process is left."""
    name = "eval-error"
    (root / f"{name}.py").write_text(EVAL_REWARD)
    (root / "say.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(4)))
    cfg = yaml.safe_load(config(root, "grpo", name, dist_timeout_s=300, eval_every=1).read_text())
    cfg["rewards"] = [{"fn": f"{root / name}.py:digits"}]
    cfg["data"]["eval"] = str(root / "say.jsonl")
    cfg["eval"] = {"max_new_tokens": 4, "max_examples": 4}
    cfg["checkpoint"]["every"] = 100  # rank 0 goes straight on from the evaluation into step 2
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.time()
    with open(root / f"{name}.log", "w") as log:  # a file, not a pipe: an orphaned rank would hold that open
        proc = subprocess.Popen([sys.executable, "-m", "rlft", "train", "--nproc", "2", str(path)],
                                env={**ENV, "COLUMNS": "250"}, stdout=log, stderr=subprocess.STDOUT)
    below: list[int] = []
    try:
        while len(below) < 3 and proc.poll() is None:  # torchrun and its two ranks
            below = descendants(proc.pid)
            time.sleep(0.1)
        proc.wait(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
        wait_gone(below, within=10)  # no rank left waiting, no orphan
    out = (root / f"{name}.log").read_text()
    assert len(below) >= 3 and time.time() - started < 120, out[-3000:]  # far below dist_timeout_s
    assert proc.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors and all(line.startswith(
        "error: the evaluation after step 1 failed: rank 1 of 2 failed in the evaluation: reward 'digits' "
        f"({root / name}.py:digits) raised on {root / 'say.jsonl'}:") for line in errors), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    summary = json.loads((root / name / "summary.json").read_text())
    assert summary["status"] == "eval_failed" and summary["step"] == 1, summary
    assert (root / name / "checkpoints" / "step-00000001" / "COMPLETE").exists()  # saved together


def test_a_lost_peer_is_one_error_line_though_its_message_quotes_brackets(root, monkeypatch, capsys):
    """gloo's message for a lost peer quotes its source as "[/__w/.../pair.cc:553]", which the
    console read as a closing markup tag: a MarkupError traceback instead of the error line."""
    def lost_peer(*args, **kwargs):
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                           "by peer [127.0.0.1]:65223")

    monkeypatch.setattr("rlft.api.train", lost_peer)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = run_main(monkeypatch, capsys, "train", str(config(root, "sft", "lost-peer")))
    out = result.stdout + result.stderr
    assert result.returncode == 3 and "Traceback" not in out, out
    [line] = [line for line in out.splitlines() if line.startswith("error:")]
    assert line.startswith("error: rank 1: a collective with the other ranks failed (RuntimeError: "
                           "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"), out


def test_a_failed_rank_ends_torchrun_with_its_status_and_one_line(monkeypatch, capsys):
    """`rlft train --nproc` printed torchrun's ChildFailedError traceback (40 lines) after the ranks'
    own `error:` line, and exited 1. Now one line naming the rank that ended by itself, and its
    status; not a rank torchrun stopped after it within the same second (SIGTERM)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from rlft.training import torchrun as wrapper

    failures = {0: ProcessFailure(0, 11, -signal.SIGTERM, "<N/A>"), 1: ProcessFailure(1, 12, 2, "<N/A>")}
    for failure in failures.values():
        failure.timestamp = 1_700_000_000

    def torchrun(argv: list[str]) -> None:
        raise ChildFailedError("rlft", failures)

    monkeypatch.setattr("torch.distributed.run.main", torchrun)
    assert wrapper.main(["rlft.py"]) == 2
    assert capsys.readouterr().err == "rlft: rank 1 ended with status 2; the job stopped (the ranks' errors are above)\n"


def alive(pids: list[int]) -> list[int]:
    """The pids still running (a zombie, dead but not yet reaped, counts as gone)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def start_cli_run(root: Path, name: str) -> subprocess.Popen:
    """`rlft train --nproc 2` of a long SFT run with no checkpoint due (the only one is what a stop
    saves)."""
    cfg = config(root, "sft", name, max_steps=1000, epochs=1000)
    raw = yaml.safe_load(cfg.read_text())
    raw["checkpoint"]["every"] = 1000
    cfg.write_text(yaml.safe_dump(raw))
    with open(root / f"{name}.log", "w") as log:  # a file, not a pipe: an orphaned rank would hold that open
        return subprocess.Popen([sys.executable, "-m", "rlft", "train", "--nproc", "2", str(cfg)], env=ENV,
                                stdout=log, stderr=subprocess.STDOUT)


def after_first_step(proc: subprocess.Popen, run: Path) -> list[int]:
    """Once the run has logged a step: the processes below the launcher (torchrun, the ranks)."""
    deadline = time.time() + 240
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.time() < deadline, Path(f"{run}.log").read_text()[-3000:]
        time.sleep(0.2)
    below = descendants(proc.pid)
    assert len(below) >= 3, below  # torchrun and two ranks
    return below


def wait_gone(pids: list[int], within: float) -> None:
    deadline = time.time() + within
    while alive(pids) and time.time() < deadline:
        time.sleep(0.2)
    left = alive(pids)
    for pid in left:  # leave no stray processes behind a failed test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {within:g} s later: {left}"


@pytest.mark.slow  # ~40 s; make test keeps test_a_stopped_or_killed_launcher_leaves_no_rank_behind
def test_sigterm_to_the_launcher_stops_every_rank_with_a_checkpoint(root):
    """Issue 23: SIGTERM to `rlft train --nproc 2` killed torchrun and left both ranks training as
    orphans holding the run lock. Now it goes through torchrun to every rank, which saves a
    checkpoint and stops, as one process does (status 143, no torchrun traceback)."""
    proc, run = start_cli_run(root, "cli-sigterm"), root / "cli-sigterm"
    below = after_first_step(proc, run)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        wait_gone(below, within=10)
    out = Path(f"{run}.log").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", summary
    assert (run / "checkpoints" / f"step-{summary['step']:08d}" / "COMPLETE").is_file()


RANK = """
import os, sys, time
from rlft.training.torchrun import watch_parent

watch_parent(grace_s=5, poll_s=0.2)
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").close()
time.sleep(300)
"""


def test_a_stopped_or_killed_launcher_leaves_no_rank_behind(tmp_path):
    """Issue 23: a SIGKILLed launcher left torchrun and the ranks running. Now torchrun gets
    SIGTERM when the launcher dies (and passes it to the ranks); a rank whose torchrun is killed
    too ends itself (its parent watch); a SIGINT to the launcher (Ctrl-C) reaches every rank.
    Stand-in ranks that only sleep (this is about processes); the three launches run at once."""
    (tmp_path / "rank.py").write_text(RANK)
    cases = ["SIGINT", "SIGKILL launcher", "SIGKILL launcher and torchrun"]
    launchers = {}
    for case in cases:
        ready = tmp_path / case.replace(" ", "-")
        ready.mkdir()
        entry = [str(tmp_path / "rank.py"), str(ready)]
        launch = f"import sys; from rlft.cli.launch import run_torchrun; sys.exit(run_torchrun(2, {entry!r}, 30))"
        launchers[case] = subprocess.Popen([sys.executable, "-c", launch], env=ENV, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
    below: dict[str, list[int]] = {}
    try:
        deadline = time.time() + 120
        for case, launcher in launchers.items():
            ready = tmp_path / case.replace(" ", "-")
            while not ((ready / "0").exists() and (ready / "1").exists()):
                assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[0][-3000:]
                time.sleep(0.1)
            below[case] = descendants(launcher.pid)
            assert len(below[case]) == 3, below  # torchrun and two ranks
        launchers["SIGINT"].send_signal(signal.SIGINT)
        launchers["SIGKILL launcher"].kill()
        os.kill(children_of(launchers["SIGKILL launcher and torchrun"].pid)[0], signal.SIGKILL)
        launchers["SIGKILL launcher and torchrun"].kill()
        assert launchers["SIGINT"].wait(timeout=60) == 128 + signal.SIGINT
        for case in cases:
            launchers[case].wait(timeout=60)
            wait_gone(below[case], within=20)
    finally:  # a failed test leaves nothing running
        for launcher in launchers.values():
            if launcher.poll() is None:
                launcher.kill()
        for pid in alive([p for pids in below.values() for p in pids]):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def no_torchrun(monkeypatch) -> list:
    """Launches that got past the launcher's checks (recorded, not started)."""
    started = []
    monkeypatch.setattr("rlft.cli.launch.run_torchrun", lambda *args: started.append(args) or 0)
    return started


def test_the_launcher_checks_the_run_once_before_starting_ranks(root, monkeypatch, capsys, no_torchrun):
    """Issue 23: --nproc 64 on 2 cores started 64 ranks, and a missing config or data file under
    --nproc 8 printed its error once per rank, then torchrun's 60-line traceback. The launcher now
    checks first: one `error:` line, status 2, no rank started."""
    cfg = config(root, "sft", "checked")
    cores = len(os.sched_getaffinity(0))
    too_many = assert_clean_user_error(run_main(monkeypatch, capsys, "train", "--nproc", str(cores + 1), str(cfg)))
    assert f"--nproc {cores} or fewer" in too_many
    missing = assert_clean_user_error(run_main(monkeypatch, capsys, "train", "--nproc", "2",
                                               str(root / "nope.yaml")))
    assert "config file not found" in missing
    no_data = assert_clean_user_error(run_main(monkeypatch, capsys, "train", "--nproc", "2", str(cfg),
                                               f"data.eval={root / 'missing.jsonl'}"))
    assert "missing.jsonl" in no_data and "data.eval" in no_data
    no_model = assert_clean_user_error(run_main(monkeypatch, capsys, "train", "--nproc", "2", str(cfg),
                                                f"model.path={root / 'no-model'}"))
    assert "no-model" in no_model
    assert no_torchrun == []
    # a run that passes is started once
    ok = run_main(monkeypatch, capsys, "train", "--nproc", "2", str(cfg))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert len(no_torchrun) == 1 and no_torchrun[0][1] == ["-m", "rlft", "train", str(cfg)]
    # one whose plan cannot fit the RAM its 2 ranks share, even with every memory saver, stops here
    monkeypatch.setattr("rlft.plan.fit._meminfo_available", lambda: 1 << 20)  # 1 MiB of RAM left
    short = assert_clean_user_error(run_main(monkeypatch, capsys, "train", "--nproc", "2", str(cfg)))
    assert "split over 2 ranks" in short and "before loading" in short
    assert len(no_torchrun) == 1
