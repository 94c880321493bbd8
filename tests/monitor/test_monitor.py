"""The Monitor: each episode of a condition is one event, actions per detector, early stopping,
and a resume that continues exactly where the saved state left off."""

from __future__ import annotations

import json

import pytest

from rlft.monitor.monitor import Monitor
from rlft.config.monitor import MonitorConfig


def _events(run_dir):
    path = run_dir / "events.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def _kl_only(**kw) -> MonitorConfig:
    return MonitorConfig(enabled=["kl"], kl={"smooth": 1, "max_kl": 0.5, "growth_window": 100}, **kw)


def test_an_alert_is_written_once_per_episode_and_re_arms_when_it_clears(tmp_path):
    monitor = Monitor(_kl_only(), tmp_path)
    fired = [monitor.observe({"step": s, "kl": v}) for s, v in enumerate([0.1, 0.6, 0.7, 0.8, 0.2, 0.3, 0.9], 1)]
    # above 0.5 at steps 2-4 (one episode), below at 5-6 (re-armed), above again at 7
    assert [len(f) for f in fired] == [0, 1, 0, 0, 0, 0, 1]
    events = _events(tmp_path)
    assert [(e["step"], e["detector"], e["action"]) for e in events] == [(2, "kl", "warn"), (7, "kl", "warn")]
    assert events[0]["values"]["kl"] == 0.6 and "0.6 is above 0.5" in events[0]["message"]
    assert fired[1][0].to_event() == events[0]


def test_records_without_the_metric_keep_the_episode_open(tmp_path):
    monitor = Monitor(_kl_only(), tmp_path)
    monitor.observe({"step": 1, "kl": 0.9})
    assert monitor.observe({"step": 1, "eval/accuracy": 0.3}) == []  # an eval-only line: still the same episode
    assert monitor.observe({"step": 2, "kl": 0.95}) == []
    assert len(_events(tmp_path)) == 1


def test_actions_per_detector_and_disabled_detectors(tmp_path):
    cfg = MonitorConfig(enabled=["kl", "infra_errors"], on_alert={"infra_errors": "stop"},
                        kl={"smooth": 1}, infra_errors={"max_rate": 0.05})
    monitor = Monitor(cfg, tmp_path)
    alerts = monitor.observe({"step": 1, "kl": 0.9, "reward/infra_error_rate": 0.5, "entropy": 0.0})
    assert {(a.detector, a.action) for a in alerts} == {("kl", "warn"), ("infra_errors", "stop")}
    # entropy 0.0 would collapse, but entropy_collapse is not enabled


def test_without_a_run_dir_nothing_is_written(tmp_path):
    monitor = Monitor(_kl_only())
    assert len(monitor.observe({"step": 1, "kl": 0.9})) == 1
    assert list(tmp_path.iterdir()) == []


def test_completion_metrics_uses_the_configured_ngrams():
    monitor = Monitor(MonitorConfig(repetition_ngram=2))
    # 6 words, 5 bigrams, 2 distinct: 1 - 2/5
    assert monitor.completion_metrics(["a b a b a b"]) == {"completion/repetition_rate": pytest.approx(0.6)}


def test_early_stop_on_a_plateau_with_patience_and_min_delta():
    cfg = MonitorConfig(early_stop={"metric": "eval/accuracy", "patience": 2, "min_delta": 0.01})
    monitor = Monitor(cfg)
    accs = [0.50, 0.52, 0.525, 0.529, 0.60, 0.605, 0.61]
    # best 0.50 -> 0.52 (+0.02 > 0.01); 0.525 and 0.529 are within min_delta of 0.52: 2 evals -> stop
    reasons = [monitor.should_stop_early({"step": 10 * (i + 1), "eval/accuracy": a}) for i, a in enumerate(accs[:4])]
    assert reasons[:3] == [None, None, None]
    assert reasons[3] is not None and "best 0.52 at step 20" in reasons[3] and "2 evals" in reasons[3]
    # training records without the metric do not count as evals
    monitor = Monitor(cfg)
    for i, a in enumerate(accs):
        assert monitor.should_stop_early({"step": 2 * i + 1, "reward/mean": 0.1}) is None
        reason = monitor.should_stop_early({"step": 2 * i + 2, "eval/accuracy": a})
        if reason:
            break
    assert i == 3


def test_early_stop_min_mode_and_kl_stop():
    monitor = Monitor(MonitorConfig(early_stop={"metric": "eval/loss", "mode": "min", "patience": 1}))
    assert monitor.should_stop_early({"step": 1, "eval/loss": 1.0}) is None
    assert monitor.should_stop_early({"step": 2, "eval/loss": 0.9}) is None  # lower is better
    assert monitor.should_stop_early({"step": 3, "eval/loss": 0.95}) is not None
    monitor = Monitor(MonitorConfig(early_stop={"kl_stop": 0.2}))
    assert monitor.should_stop_early({"step": 1, "kl": 0.19}) is None
    reason = monitor.should_stop_early({"step": 2, "kl": 0.21})
    assert reason is not None and "0.21" in reason and "kl_stop=0.2" in reason


def test_state_dict_round_trip_continues_like_an_uninterrupted_monitor(tmp_path):
    cfg = MonitorConfig(enabled=["kl", "length_drift"], kl={"smooth": 1},
                        length_drift={"smooth": 1}, early_stop={"metric": "eval/accuracy", "patience": 2})
    records = [{"step": s, "kl": kl, "completion/length_mean": ln, "eval/accuracy": acc}
               for s, kl, ln, acc in [(1, 0.1, 100, 0.5), (2, 0.6, 105, 0.5), (3, 0.7, 110, 0.5),
                                      (4, 0.2, 120, 0.5), (5, 0.8, 120, 0.4)]]
    whole = tmp_path / "whole"
    whole.mkdir()
    straight = Monitor(cfg, whole)
    expected = [(straight.observe(r), straight.should_stop_early(r)) for r in records]

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    first = Monitor(cfg, resumed_dir)
    for r in records[:3]:
        first.observe(r), first.should_stop_early(r)
    state = json.loads(json.dumps(first.state_dict()))  # must survive serialisation
    first.observe(records[3])  # the interrupted attempt went one step past the checkpoint
    first.observe(records[4])
    second = Monitor(cfg, resumed_dir)
    second.load_state_dict(state)
    got = [(second.observe(r), second.should_stop_early(r)) for r in records[3:]]
    assert got == expected[3:]
    assert _events(resumed_dir) == _events(whole)
    assert expected[4][1] is not None  # the plateau stop did fire: patience counters were restored


def test_state_keeps_only_watched_keys():
    monitor = Monitor(MonitorConfig(enabled=["kl"]))
    monitor.observe({"step": 1, "kl": 0.1, "lr": 1e-5, "loss": 2.0, "note": "text"})
    assert monitor.state_dict()["history"] == {"last_step": 1, "series": {"kl": [[1, 0.1]]}}


def test_monitor_config_validation():
    from rlft.config import CheckpointConfig

    with pytest.raises(ValueError, match="checkpoint.keep_best names no metric"):
        CheckpointConfig(final="best")
    assert CheckpointConfig(final="best", keep_best="eval/accuracy").final == "best"
    with pytest.raises(ValueError):
        MonitorConfig(enabled=["kl_blowup"])
    with pytest.raises(ValueError):
        MonitorConfig(on_alert={"kl": "panic"})


def test_section_is_strict_like_the_other_config_sections():
    # an unknown key is an error, as everywhere in rlft's config
    with pytest.raises(ValueError, match="extra"):
        MonitorConfig(kl={"max": 1.0})
