"""The HTML report from synthetic run directories: what it plots, marks, escapes and compares."""

from __future__ import annotations

import html
import json
import re

import pytest

from monitor.conftest import NASTY, online_config, online_metrics, write_run
from rlft.errors import RlftError
from rlft.monitor.report import choose_sample_steps, config_differences, group_metrics, write_report
from rlft.monitor.runlog import load_runs
from report_checks import shown_segments

LENGTH_EVENT = {"step": 12, "detector": "length_drift", "action": "warn",
                "message": "completion/length_mean 52 is 30% longer than at the start (40)",
                "values": {"completion/length_mean": 52.0, "start": 40.0}}


def _plots(page: str) -> dict[str, str]:
    """metric -> the HTML of its plot."""
    parts = re.split(r"<div class='plot' data-metric='([^']*)'>", page)
    return {html.unescape(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_one_online_run_plots_every_series_marks_events_and_escapes_text(make_online_run, tmp_path):
    run = make_online_run(events=[LENGTH_EVENT])
    out = write_report([run], tmp_path / "out" / "r.html")
    page = out.read_text()
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in metrics for k in r if k != "step"}
    plots = _plots(page)
    assert set(plots) == keys  # every numeric series, each once
    # offline-openable: plotly inlined, nothing loaded from elsewhere
    assert "<script src" not in page and "<link" not in page and len(page) > 1_000_000
    # the event is drawn on the curve of the metric that fired it, and only there
    assert "length_drift" in plots["completion/length_mean"]
    assert not any("length_drift" in p for k, p in plots.items() if k != "completion/length_mean")
    assert "completion/length_mean 52 is 30% longer" in page  # events table
    # sections in order, reward components with the total
    order = [page.index(f"<h2>{t}</h2>") for t in ("Reward", "Held-out", "KL and entropy", "Completions")]
    assert order == sorted(order)
    assert {"reward/mean", "reward/math", "reward/format"} <= set(plots)
    # header: status, method, model, steps, wall time from 30 steps of 2 s
    assert "completed" in page and "grpo" in page and "/models/tiny-sft" in page and "1m 00s" in page
    # the completion with markup is shown as text, never as markup
    assert NASTY not in page and "<script>window.__pwned" not in page
    assert html.escape(NASTY) in page
    assert "unverifiable (None)" in page  # the sample with reward None


def test_samples_first_middle_last_or_chosen(make_online_run, tmp_path):
    assert choose_sample_steps([30, 10, 20, 40, 50]) == [10, 30, 50]
    assert choose_sample_steps([5, 10]) == [5, 10]
    assert choose_sample_steps([10, 20, 30], [20, 25]) == [20]
    run = make_online_run()
    page = write_report([run], tmp_path / "r.html", sample_steps=[20]).read_text()
    assert "<h3>step 20</h3>" in page and "<h3>step 10</h3>" not in page


def test_a_multi_turn_sample_is_shown_whole_with_roles_and_its_trained_tokens_set_apart(tmp_path):
    segments = [{"role": "assistant", "text": '<tool_call>{"name": "calculator"}</tool_call><|im_end|>',
                 "trained": True},
                {"role": "tool", "text": "\n<|im_start|>tool\n" + NASTY + "<|im_end|>\n<|im_start|>assistant\n",
                 "trained": False},
                {"role": "assistant", "text": "The answer is 85.<|im_end|>", "trained": True}]
    samples = [{"step": 1, "where": "p.jsonl:1", "prompt": "What is 37 + 48?", "completion": "The answer is 85.",
                "reward": 1.0, "finish_reason": "stop", "components": {}, "turns": 2, "tool_calls": 1,
                "transcript": [], "segments": segments},
               {"step": 1, "where": "p.jsonl:2", "prompt": "Hi", "completion": "single-turn text", "reward": 0.0,
                "finish_reason": "stop", "components": {}}]
    run = write_run(tmp_path / "agent", online_config(tmp_path / "agent"), online_metrics(2), samples)
    page = write_report([run], tmp_path / "r.html").read_text()
    assert shown_segments(page) == segments  # every segment, in order, with its role and trained flag
    assert "episode &middot; turns 2 &middot; tool calls 1" in page and "not trained (inserted)" in page
    assert "<script>window.__pwned" not in page  # tool output is text, never markup
    assert "<pre>single-turn text</pre>" in page  # a sample without segments keeps its completion


def test_several_runs_overlay_and_list_the_config_fields_that_differ(make_online_run, tmp_path):
    a = make_online_run("a")
    b = make_online_run("b", training__learning_rate=3e-5, rollout__temperature=0.7,
                        events=[{"step": 25, "detector": "kl", "action": "stop", "message": "kl 0.6 > 0.5",
                                 "values": {"kl": 0.6}}])
    diffs = config_differences(load_runs([a, b]))
    assert diffs == {"rollout.temperature": [1.0, 0.7], "training.learning_rate": [1e-5, 3e-5]}  # not output_dir
    page = write_report([a, b], tmp_path / "r.html").read_text()
    assert "Config fields that differ" in page and "rollout.temperature" in page
    reward_plot = _plots(page)["reward/mean"]
    assert reward_plot.count('"mode":"lines+markers"') == 2  # one trace per run
    assert '"name":"a"' in reward_plot and '"name":"b"' in reward_plot
    assert "#1f77b4" in reward_plot and "#d62728" in reward_plot  # one colour each
    assert "kl (b)" in _plots(page)["kl"]  # events name their run when several are shown


def test_offline_run_gets_its_own_plots(sft_run_dir, tmp_path):
    page = write_report([sft_run_dir], tmp_path / "r.html").read_text()
    plots = _plots(page)
    assert set(plots) == {"loss", "lr", "grad_norm", "epoch", "step_time", "eval/loss", "eval/accuracy"}
    assert "<h2>Training</h2>" in page and "<h2>Held-out</h2>" in page and "Sample completions" not in page
    assert "0m 10s (sum of step times)" in page  # 20 steps x 0.5 s
    assert "No detector fired" in page


def test_group_metrics_puts_each_key_in_one_section():
    groups = dict(group_metrics(["reward/mean", "reward/infra_error_rate", "eval/accuracy", "kl", "loss",
                                 "rewards/accuracy", "time/step", "mystery"]))
    assert groups == {"Reward": ["reward/mean"], "Held-out": ["eval/accuracy"], "KL and entropy": ["kl"],
                      "Training": ["loss"], "Preference and reward-model scores": ["rewards/accuracy"],
                      "Throughput": ["time/step"], "Health": ["reward/infra_error_rate"], "Other": ["mystery"]}


def test_not_a_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(RlftError, match="run directory not found"):
        write_report([tmp_path / "nope"], tmp_path / "r.html")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RlftError, match="not a run directory"):
        write_report([tmp_path / "empty"], tmp_path / "r.html")


def test_a_partial_last_metrics_line_is_tolerated_but_damage_is_reported(make_online_run, tmp_path):
    run = make_online_run()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 31, "reward/me')  # killed mid-write
    assert write_report([run], tmp_path / "r.html").exists()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage"] + lines[1:]) + "\n")
    with pytest.raises(RlftError, match=r"metrics.jsonl:2: not valid JSON"):
        write_report([run], tmp_path / "r.html")


def test_a_real_short_run_gets_every_plot_its_metrics_and_samples(tmp_path, qwen_path):
    """The report of a real 3-step GRPO run on the tiny model (the other tests here use run
    folders written by hand): one plot per series in its metrics.jsonl drawing exactly the logged
    points, its header, and its saved completions, escaped."""
    from conftest import DIGITS_REWARD, write_jsonl
    from report_checks import assert_report_shows_runs
    from rlft.api import train

    (tmp_path / "rewards.py").write_text(DIGITS_REWARD)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Count to {i}."} for i in range(8)])
    run = tmp_path / "grpo-real"
    summary = train({"method": "grpo", "output_dir": str(run), "seed": 0,
                     "model": {"path": str(qwen_path), "device": "cpu"}, "data": {"train": str(prompts)},
                     "training": {"learning_rate": 1e-3, "max_steps": 3, "num_threads": 1},
                     "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8},
                     "rewards": [{"fn": f"{tmp_path / 'rewards.py'}:digits"}],
                     "logging": {"progress": False, "sample_every": 1}})
    assert summary["status"] == "completed"
    out = write_report([run], tmp_path / "report.html")
    plotted = assert_report_shows_runs(out, [run])
    assert {"reward/mean", "reward/digits", "kl", "entropy", "loss", "completion/length_mean"} <= set(plotted)
    page = out.read_text()
    assert "grpo" in page and str(qwen_path) in page and "completed" in page
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 3}
    for s in samples:  # first, middle and last step: all three here
        assert html.escape(s["completion"]) in page
    for step in (1, 2, 3):
        assert f"<h3>step {step}</h3>" in page
