"""Every `examples/*.yaml` runs as shipped, shortened by `a.b=value` overrides only.

The files are found by glob, so a new example is covered without touching this file. They run
the way examples/README.md says (from a folder holding `examples/` and the `runs/tiny-model`
that `rlft tiny-model runs/tiny-model` makes), with the schedule cut to 2 steps, batches and
generation to a few short samples, and the offline methods training on their held-out file (the
2,000-row training files are read and checked on their own). A model path that does not exist
there (an SFT export the README makes in an earlier step, or SmolLM2's imported folder) is
pointed at the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlft.api import train
from rlft.pipeline import run_pipeline

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ONLINE = {"grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo"}


def shortening(raw: dict, cwd: Path) -> list[str]:
    """The overrides that make one training config run in a few seconds."""
    data = raw.get("data") or {}
    out = []
    if raw.get("method") not in ONLINE and isinstance(data.get("train"), str) and data.get("eval"):
        # tokenizing 2,000 conversations or pairs takes 4-9 s here: offline examples train on their
        # held-out file (same format, 200 rows); the training files are read and checked below
        out.append(f"data.train={data['eval']}")
    out += ["training.max_steps=2", "training.num_threads=1", "logging.progress=false",
           "eval.max_examples=4", "eval.max_new_tokens=8"]
    if raw.get("method") not in ONLINE:
        out.append("training.batch_size=8")
    else:
        out += ["rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8"]
    if raw.get("method") == "dpo":
        out.append("dpo.precompute_ref=false")  # else every pair is scored with the reference first
    path = (raw.get("model") or {}).get("path")
    if path is not None and not (cwd / path).exists():
        out.append("model.path=runs/tiny-model")
    return out


def leaves(node, prefix=""):
    """{dotted key: value} of the nested dicts' scalar leaves."""
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        elif not isinstance(value, list):
            out[f"{prefix}{key}"] = value
    return out


def assert_ran_as_shipped(raw: dict, overrides: list[str], run: Path) -> None:
    """The run completed its 2 steps, exported a model, and its saved config keeps every value
    the example sets except those overridden (and output_dir, which a pipeline sets)."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 2, summary
    assert (run / "final" / "config.json").is_file()
    saved = leaves(yaml.safe_load((run / "config.yaml").read_text()))
    changed = {o.split("=", 1)[0] for o in overrides} | {"output_dir", "model.path"}
    for key, value in leaves(raw).items():
        if key not in changed:
            # a relative local path is saved absolute (resolved against the directory the run
            # started in, where these tests run), so a resume works from anywhere
            kept = saved.get(key) in (value, f"{Path.cwd()}/{value}" if isinstance(value, str) else value)
            assert kept, (run, key, saved.get(key), value)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, qwen_path):
    root = tmp_path_factory.mktemp("examples")
    (root / "examples").symlink_to(EXAMPLES)
    (root / "runs").mkdir()
    # what `rlft tiny-model runs/tiny-model` makes (build_tiny_model, qwen2, seed 0): the session's copy
    (root / "runs" / "tiny-model").symlink_to(qwen_path)
    return root


def test_the_examples_are_found():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {"sft.yaml", "grpo.yaml", "dpo.yaml", "pipeline.yaml"} <= names


@pytest.mark.parametrize("example", sorted(p for p in EXAMPLES.glob("*.yaml") if "stages" not in p.read_text()),
                         ids=lambda p: p.name)
def test_the_shipped_data_files_hold_what_their_method_reads(example):
    """Every row of every data file an example names parses and carries the fields its method
    needs (the runs above tokenize the held-out files only; this reads the training files too)."""
    from rlft.data.readers import read_rows

    raw = yaml.safe_load(example.read_text())
    need = {"sft": ("prompt", "completion"), "dpo": ("prompt", "chosen", "rejected"),
            "reward_model": ("prompt", "chosen", "rejected")}.get(raw["method"], ("prompt", "answer"))
    for key in ("train", "eval"):
        rows = read_rows(str(EXAMPLES.parent / raw["data"][key]))
        assert len(rows) >= 200, (example.name, key)
        bad = [r.where for r in rows if r.data is None or any(not r.data.get(f) for f in need)]
        assert not bad, (example.name, key, bad[:3])


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_runs_as_shipped(example, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    raw = yaml.safe_load(example.read_text())
    if "stages" not in raw:
        overrides = shortening(raw, workdir)
        train(f"examples/{example.name}", overrides)
        assert_ran_as_shipped(raw, overrides, workdir / raw["output_dir"])
        return
    # a pipeline: the same overrides appended to each stage's own, in a copy of the file
    stages = []
    for i, stage in enumerate(raw["stages"]):
        config = yaml.safe_load((workdir / stage["config"]).read_text())
        # after the first stage the pipeline sets model.path (to an earlier stage's export)
        short = [o for o in shortening(config, workdir) if i == 0 or not o.startswith("model.path=")]
        stages.append({**stage, "overrides": [*stage.get("overrides", []), *short]})
    copy = workdir / f"short-{example.name}"
    copy.write_text(yaml.safe_dump({**raw, "stages": stages}, sort_keys=False))
    results = run_pipeline(copy)
    assert list(results) == [s["name"] for s in raw["stages"]]
    for stage in stages:
        config = yaml.safe_load((workdir / stage["config"]).read_text())
        assert_ran_as_shipped(config, stage["overrides"], workdir / raw["output_dir"] / stage["name"])
