"""Asynchronous rollouts (rollout.async_steps = k): version-exact pacing against a sequential
oracle, k = 0 as the plain synchronous loop, exact resume after kills and stops, the sampler's
failure, and the settings refused with their reason."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import DIGITS_REWARD
from rlft.api import train
from rlft.config import load_config
from rlft.errors import ConfigError, RlftError, TrainingHalted
from rlft.models.tiny import build_tiny_model
from rlft.monitor.catalogue import metric_names
from test_resume import assert_same_run, final_weights, kill_at_random, metrics, run_cli, write_config


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    build_tiny_model(root / "model", seed=0)
    (root / "reward.py").write_text(DIGITS_REWARD)
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    return root


def grpo(root: Path, name: str, k: int, steps: int = 6, **sections) -> dict:
    cfg = {
        "method": "grpo", "output_dir": str(root / name), "seed": 3,
        "model": {"path": str(root / "model")}, "data": {"train": str(root / "prompts.jsonl")},
        "training": {"learning_rate": 1e-2, "max_steps": steps, "num_threads": 1, "precision": "fp32",
                     "lr_scheduler": "constant"},
        # the sampler thread: a child process's start-up costs seconds a run, and it samples what the
        # thread samples (tests/test_sampler_process.py compares the two bitwise)
        "rollout": {"group_size": 4, "prompts_per_step": 3, "max_new_tokens": 8, "async_steps": k,
                    "sampler": "thread"},
        # two epochs x two minibatches: a no-grad pi_old pass, and the update generator's state
        "algorithm": {"epochs": 2, "minibatches": 2, "rollout_correction": "tis"},
        "rewards": [{"fn": f"{root / 'reward.py'}:digits"}],
        "checkpoint": {"every": 1, "keep_last": 2}, "logging": {"progress": False, "sample_every": 2},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def sequential_oracle(cfg: dict, k: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run as one thread would do it, from primitives: batch b sampled (k = 0: by the engine on
    the live model, as the synchronous loop always did; k > 0: from a copy holding the full state
    dict of version max(0, b - k)), scored, then `online_step`. Returns (reward/mean per step, final
    weights: the adapter's under LoRA)."""
    from rlft.plan.fit import fit_memory
    from rlft.models.loading import Reference, disable_dropout, load_policy, resolve_device
    from rlft.rollout import rollout_engine
    from rlft.training.online.collect import collect_rollout
    from rlft.training.distributed import SINGLE
    from rlft.training.online.loop import build_online, online_step
    from rlft.training.session import open_run, run_precision, session_for

    config = load_config(cfg)
    config = fit_memory(config, SINGLE, resolve_device(config.model.device)).config
    with open_run(config) as run:
        precision = run_precision(config)
        policy = load_policy(config.model, config.lora, precision.weight_dtype)
        disable_dropout(policy.model)
        reference = Reference(policy)
        session = session_for(config, run, policy, precision=precision)
        o = build_online(config, session)  # data, rewards and the update's parts; not its rollouts
        maker = o.rollouts.maker
        session.start(o.total, [], "oracle", updates_per_step=4)  # no signal handlers: only running() installs them
        engine, lagged, history = o.engine, None, [copy.deepcopy(policy.model.state_dict())]
        if k:
            lagged = copy.deepcopy(policy)
            engine = rollout_engine(config.rollout, lagged, config.seed)
        rewards = []
        for b in range(o.total):
            if lagged is not None:
                lagged.model.load_state_dict(history[max(0, b - k)])
            rollout = collect_rollout(engine, maker.sampler, maker.prompts, maker.scorer, maker.params,
                                      maker.prompts_per_step)
            step = online_step(session, rollout, reference, o.kl_ctl, o.settings, o.update_gen)
            engine.sync_weights()
            history.append(copy.deepcopy(policy.model.state_dict()))
            rewards.append(step["reward/mean"])
        for built in o.engines:  # build_online made the run's engines (an async one: a sampler process)
            built.close()
        if policy.is_lora:  # the adapter, named as final/adapter/ names it
            from peft import get_peft_model_state_dict

            return rewards, {k_: v.clone() for k_, v in get_peft_model_state_dict(policy.model).items()}
        return rewards, {k_: v.clone() for k_, v in policy.model.state_dict().items()}


@pytest.mark.parametrize("k,lora", [(0, False), (1, False), (2, False), (1, True)])
def test_runs_equal_the_sequential_oracle_bitwise(root, k, lora):
    """k = 0 is the synchronous loop as it was; k > 0 samples batch b from exactly version b - k,
    whatever the threads' timing: same rewards at every step, same final weights, bit for bit.
    Under LoRA the sampler's copy takes the adapter's weights."""
    extra = {"lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1}} if lora else {}
    name = f"run-k{k}" + ("-lora" if lora else "")
    summary = train(grpo(root, name, k, **extra))
    assert summary["status"] == "completed"
    rows = metrics(root / name)
    rewards, weights = sequential_oracle(grpo(root, f"oracle-{name}", k, **extra), k)
    assert [r["reward/mean"] for r in rows] == rewards
    assert [r["rollout/staleness_max"] for r in rows] == [float(min(b, k)) for b in range(6)]
    # under LoRA final/ holds the merged model and the adapter: compare the adapter
    trained = {k_: v for k_, v in final_weights(root / name).items() if k_.startswith("adapter.") or not lora}
    assert trained and all(torch.equal(v, weights[k_.removeprefix("adapter.")]) for k_, v in trained.items())
    raw = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/rollout_wait"] >= 0 for r in raw) and ("time/sampler_wait" in raw[-1]) == bool(k)
    names, prefixes = metric_names(load_config(grpo(root, name, k)), ["digits"])
    assert [key for r in raw for key in r if key not in names and not key.startswith(prefixes)] == []
    # the mismatch and importance weights again under each step's staleness (async runs only)
    for r in raw:
        s = int(r["rollout/staleness_max"])
        split = {key: v for key, v in r.items() if key.startswith("rollout/staleness_") and "/" in key[18:]}
        assert split == ({f"rollout/staleness_{s}/{m}": r[f"rollout/{m}"] for m in
                          ("logprob_diff_mean", "logprob_diff_max", "ratio_mean", "tis_weight_mean",
                           "tis_capped_frac")} if k else {}), (r["step"], split)


def test_pacing_gives_every_batch_its_exact_version_whatever_the_timing():
    """The queue alone, with a stand-in sampler and trainer sleeping at random: batch b is always
    made from the weights published as version max(0, b - k), and the loop gets the batches in
    order; a drained state holds batches consumed .. consumed + k."""
    from rlft.training.distributed import SINGLE
    from rlft.training.online.rollouts import AsyncRollouts

    class Counter(torch.nn.Module):  # the "weights": version v holds v
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

    class Maker:
        world = SINGLE

        def __init__(self, model, rng):
            self.model, self.rng, self.engine = model, rng, self

        def reduce(self, rollout):
            pass

        def sync_weights(self):
            pass

        def make(self, version):
            time.sleep(self.rng.uniform(0, 0.004))
            return type("R", (), {"completions": [], "metrics": {}, "seen": float(self.model.w.detach()), "version": version})()

        def parts(self):
            return {}

    threads_before = threading.active_count()  # other tests may leave daemon threads behind
    for k in (1, 2, 3):
        rng = random.Random(k)
        trainer, sampler = Counter(), Counter()
        rollouts = AsyncRollouts(Maker(sampler, rng), k, trainer, sampler)
        rollouts.start(0)
        for b in range(25):
            r = rollouts.take()
            assert r.version == max(0, b - k) and r.seen == r.version
            time.sleep(rng.uniform(0, 0.004))
            with torch.no_grad():
                trainer.w += 1
            rollouts.trained()
            if b == 10:
                state = rollouts.state_dict()
                assert state["first"] == 11 and state["next"] == 11 + k + 1 and len(state["rollouts"]) == k + 1
        rollouts.close()
        assert threading.active_count() <= threads_before  # the sampler thread is gone after close()


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
# make test under 10 min: resume stays covered there by the stop/continue tests below; -m slow runs these
def test_sigkill_at_a_random_moment_then_resume_is_bitwise_identical(root, k):
    reference = root / f"run-k{k}"
    if not reference.exists():
        train(grpo(root, reference.name, k))
    killed = root / f"killed-k{k}"
    cfg_path = write_config(grpo(root, killed.name, k))
    kill_at_random(cfg_path, killed, random.Random(f"async-{k}"), 2, 4)
    resumed = run_cli("train", str(cfg_path))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr or not list((killed / "checkpoints").glob("step-*"))
    assert_same_run(reference, killed)


def test_stopping_and_continuing_at_several_points_is_exact(root):
    """k = 2, a run ended at steps 1, 3 and 4 (its queue then holds batches sampled from older
    weights than the checkpoint's) and continued to 6: the same as a run left alone."""
    reference = root / "run-k2"
    if not reference.exists():
        train(grpo(root, reference.name, 2))
    cfg = grpo(root, "stops-k2", 2)
    for steps in (1, 3, 4):
        assert train(cfg, [f"training.max_steps={steps}"])["status"] == "completed"
        state = torch.load(root / "stops-k2" / "checkpoints" / f"step-{steps:08d}" / "trainer_state.pt",
                           weights_only=False)["parts"]["rollouts"]
        assert state["first"] == steps and len(state["rollouts"]) == 3  # batches steps .. steps + 2
        assert [c.policy_version for r in state["rollouts"] for c in r.completions[:1]] == \
               [max(0, b - 2) for b in range(steps, steps + 3)]
    train(cfg)
    assert_same_run(reference, root / "stops-k2")


@pytest.mark.parametrize("where", ["generate", "push"])
def test_a_failing_sampler_stops_with_a_checkpoint_and_resumes_identically(root, monkeypatch, where):
    """The engine raises on its 4th batch (or the weight push before it fails), in the sampler
    thread: the loop trains what was sampled before it, then stops naming the error and what the
    sampler was doing, with the last completed step saved; after the fix the resumed run equals
    one that never failed."""
    from rlft.rollout.hf import HFEngine

    reference = root / "run-k1"
    if not reference.exists():
        train(grpo(root, reference.name, 1))
    real_generate, real_push = HFEngine.generate, HFEngine.sync_weights
    pushes = []

    def flaky(self, prompts, params, first_prompt=0):
        if self._stream == "train" and self._calls == 3:
            raise RuntimeError("boom in the engine")
        return real_generate(self, prompts, params, first_prompt)

    def failing_push(self):  # k = 1 pushes version 0 for batch 1, 1 for batch 3, 2 for batch 4: the 3rd fails
        pushes.append(1)
        if len(pushes) == 3:
            raise OSError("the push broke")

    monkeypatch.setattr(HFEngine, *(("generate", flaky) if where == "generate" else ("sync_weights", failing_push)))
    cfg = grpo(root, f"failing-{where}-k1", 1, rollout={"sampler": "thread"})  # the patch holds in this process
    with pytest.raises(TrainingHalted) as exc:
        train(cfg)
    message = str(exc.value)
    if where == "generate":
        assert "sampler failed while making batch 4" in message and "RuntimeError: boom in the engine" in message
    else:
        assert "sampler failed while loading the weights of version 2 into its engine (the push) for batch 4: " \
               "OSError: the push broke" in message, message
    assert "last completed step (3)" in message
    monkeypatch.setattr(HFEngine, "generate", real_generate)
    monkeypatch.setattr(HFEngine, "sync_weights", real_push)
    train(cfg)
    assert_same_run(reference, root / f"failing-{where}-k1")


@pytest.mark.parametrize("change,message", [
    ({"rollout": {"async_steps": -1}}, "greater than or equal to 0"),
    ({"algorithm": {"rollout_correction": "none"}}, "set algorithm.rollout_correction to tis"),
    ({"method": "dapo", "algorithm": {"rollout_correction": "bypass"}}, "dynamic_sampling"),
    ({"rollout": {"engine": "vllm", "sampler": "process"}}, "vLLM engine has its own worker processes"),
    ({"rollout": {"async_steps": 0, "sampler_device": "cuda:1"}}, "synchronous run .* samples from the trainer's"),
    ({"rollout": {"engine": "vllm", "sampler_device": "cuda:1"}}, "the vLLM engine places itself"),
    ({"rollout": {"sampler_device": "gpu1"}}, "unknown device 'gpu1'. Did you mean 'cuda:1'"),
])
def test_settings_async_cannot_run_with_are_refused_with_the_reason(root, change, message):
    cfg = grpo(root, "refused", 1)
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)


def test_a_sampler_device_is_one_process_only(root):
    from rlft.cli.launch import check_launch

    with pytest.raises(ConfigError, match="sampler_device=cuda:1 names one device, and under torchrun"):
        check_launch(load_config(grpo(root, "ranks", 1, rollout={"sampler_device": "cuda:1"})), 2)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="tests the refusal of a GPU that is not there")
def test_a_sampler_device_that_is_not_there_is_refused_before_the_model_loads(root, monkeypatch):
    import rlft.training.online.loop as online

    loaded = []
    monkeypatch.setattr(online, "load_policy", lambda *a, **k: loaded.append(a))
    with pytest.raises(RlftError, match=r"rollout.sampler_device is 'cuda:1' but (no CUDA GPU|only 1 CUDA GPU)"):
        train(grpo(root, "no-gpu", 1, rollout={"sampler_device": "cuda:1"}))
    assert not loaded and not (root / "no-gpu" / "checkpoints").exists()


def test_a_named_sampler_device_gets_the_copy_and_samples_what_auto_does(root, monkeypatch):
    """rollout.sampler_device places the sampler's copy (and so its engine's rows) on that device;
    named as the trainer's own (the only one on a CPU machine) the run is the auto run, bitwise.
    On CUDA, benchmarks/gpu_check.py runs it on a second GPU."""
    import rlft.training.online.loop as online

    placed = []
    real = online.sampler_copy
    monkeypatch.setattr(online, "sampler_copy", lambda policy, device=None, **kw: placed.append(device) or
                        real(policy, device, **kw))
    assert train(grpo(root, "device-auto", 1, steps=3))["status"] == "completed"
    assert train(grpo(root, "device-cpu", 1, steps=3, rollout={"sampler_device": "cpu"}))["status"] == "completed"
    assert placed == [None, torch.device("cpu")]
    assert [r["reward/mean"] for r in metrics(root / "device-auto")] == \
        [r["reward/mean"] for r in metrics(root / "device-cpu")]
    a, b = final_weights(root / "device-auto"), final_weights(root / "device-cpu")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bypass_uses_the_samplers_logprobs_as_pi_old(root):
    """k = 1 with bypass: the run trains (the final weights moved) and, from step 2 on, the first
    update's ratio against the one-step-old sampler is not 1 (staleness 1 is in the clipping);
    evaluations run on the loop's thread while the sampler samples."""
    cfg = grpo(root, "bypass-k1", 1, steps=3, algorithm={"rollout_correction": "bypass", "epochs": 1,
                                                         "minibatches": 1},
               # evaluations after every step: sampled and scored on the loop's thread beside the sampler's
               data={"eval": str(root / "prompts.jsonl")}, training={"eval_every": 1},
               eval={"max_examples": 4, "max_new_tokens": 8})
    assert train(cfg)["status"] == "completed"
    rows = metrics(root / "bypass-k1")
    assert all("eval/reward_mean" in r for r in rows)
    assert rows[0]["rollout/logprob_diff_mean"] < 1e-4  # version 0 sampled, version 0 trained
    assert rows[2]["rollout/logprob_diff_mean"] > 1e-3 and rows[2]["rollout/staleness_max"] == 1
    start, end = final_weights(root / "bypass-k1"), load_file_weights(root / "model")
    assert any(not torch.equal(start[n], end[n]) for n in end)


def load_file_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_an_async_run_splits_the_free_cores_between_sampler_and_trainer():
    """torch's thread count holds in every thread: two threads at torch's default of 2 on a 2-core
    machine would be 4 busy-waiting OpenMP threads (training/threads.py)."""
    from rlft.training.threads import choose_threads

    threads, line, warned = choose_threads(None, 2, 2, 0.1, workers=2)
    assert threads == 1 and not warned and "1 of 2 cores free per thread" in line
    assert choose_threads(None, 8, 8, 0.0, workers=2)[0] == 4
    assert choose_threads(2, 2, 2, 0.1, workers=2)[2]  # asked for 2 each: warned


def test_agent_episodes_run_on_the_sampler_thread_and_evaluations_on_the_loops(root):
    """k = 1 with the calculator tool: episodes are the sampler thread's (its driver on its
    engine), held-out episodes after each step the loop's (a second driver on the live weights)."""
    cfg = grpo(root, "agent-k1", 1, steps=2, agent={"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 32},
               data={"eval": str(root / "prompts.jsonl")}, training={"eval_every": 1},
               eval={"max_examples": 3, "max_new_tokens": 8})
    assert train(cfg)["status"] == "completed"
    rows = metrics(root / "agent-k1")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0]
    assert all("agent/turns_mean" in r and "eval/reward_mean" in r for r in rows)
