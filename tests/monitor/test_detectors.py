"""Each detector on synthetic histories: fires just above its threshold, stays silent just below,
with the arithmetic in the comments."""

from __future__ import annotations

import pytest

import random

from rlft.monitor.detectors import DETECTORS, History, series
from rlft.config.monitor import DETECTOR_NAMES, MonitorConfig
from rlft.monitor.text_stats import batch_repetition_rate


def hist(**columns: list[float | None]) -> list[dict]:
    """Records step 1..n; a None leaves the key out of that record."""
    n = max(len(v) for v in columns.values())
    rows = []
    for i in range(n):
        row = {"step": i + 1}
        for key, values in columns.items():
            if i < len(values) and values[i] is not None:
                row[key] = values[i]
        rows.append(row)
    return rows


def test_every_detector_has_a_settings_section_whose_fields_are_its_arguments():
    cfg = MonitorConfig()
    assert set(DETECTOR_NAMES) == set(DETECTORS)
    for name in DETECTOR_NAMES:
        assert DETECTORS[name]([], **cfg.thresholds(name)) is None  # empty history: silent, arguments accepted
        assert DETECTORS[name](hist(x=[1.0]), **cfg.thresholds(name)) is None


def test_series_skips_missing_nan_and_bools():
    rows = [{"step": 1, "a": 1.0}, {"step": 2}, {"step": 3, "a": float("nan")}, {"step": 4, "a": True},
            {"step": 5, "a": 2}]
    assert series(rows, "a") == [(1, 1.0), (5, 2.0)]


RH = dict(reward_metric="reward/mean", eval_metric="eval/accuracy", eval_mode="max", window=3,
          min_reward_rise=0.1, max_eval_gain=0.01)


def _hacking_history(reward_late: float, acc_last: float) -> list[dict]:
    # evals at steps 2, 4, 6. Train reward over the interval up to the first eval (steps 1-2): 0.3;
    # over the interval up to the last eval (steps 5-6): reward_late.
    return hist(**{"reward/mean": [0.3, 0.3, 0.4, 0.4, reward_late, reward_late],
                   "eval/accuracy": [None, 0.50, None, 0.50, None, acc_last]})


def test_reward_hacking_fires_when_reward_rises_and_eval_stays_flat():
    alert = DETECTORS["reward_hacking"](_hacking_history(0.41, 0.505), **RH)
    # rise 0.41 - 0.3 = 0.11 > 0.1; eval gain 0.505 - 0.50 = 0.005 <= 0.01
    assert alert is not None and alert.step == 6
    assert alert.values["reward_rise"] == pytest.approx(0.11)
    assert alert.values["eval/accuracy"] == 0.505
    assert "0.3 -> 0.41" in alert.message and "0.5 -> 0.505" in alert.message


@pytest.mark.parametrize("reward_late, acc_last", [(0.39, 0.50),   # rise 0.09 <= 0.1
                                                   (0.50, 0.52)])  # eval gained 0.02 > 0.01: genuine learning
def test_reward_hacking_silent_below_threshold_or_when_eval_improves(reward_late, acc_last):
    assert DETECTORS["reward_hacking"](_hacking_history(reward_late, acc_last), **RH) is None


def test_reward_hacking_needs_window_evals_and_honours_min_mode():
    rows = _hacking_history(0.6, 0.50)
    assert DETECTORS["reward_hacking"](rows[:4], **RH) is None  # two evals < window 3
    loss = hist(**{"reward/mean": [0.3, 0.3, 0.5, 0.5], "eval/loss": [None, 1.0, None, 0.98]})
    args = {**RH, "eval_metric": "eval/loss", "eval_mode": "min", "window": 2}
    # loss improved by 0.02 > 0.01: not hacking; had it risen (got worse), it is
    assert DETECTORS["reward_hacking"](loss, **args) is None
    loss[-1]["eval/loss"] = 1.05
    assert DETECTORS["reward_hacking"](loss, **args) is not None


LD = dict(metric="completion/length_mean", baseline=1, smooth=1, max_drift=0.15, growth_window=2, max_growth=0.5)


def test_length_drift_relative_to_the_first_record():
    key = "completion/length_mean"
    # 100 -> 116: +16% > 15%; 100 -> 114: +14%
    alert = DETECTORS["length_drift"](hist(**{key: [100, 105, 116]}), **LD)
    assert alert is not None and alert.values["drift"] == pytest.approx(0.16) and "16% longer" in alert.message
    assert DETECTORS["length_drift"](hist(**{key: [100, 105, 114]}), **LD) is None
    # shrinking counts too: 100 -> 84 is 16% shorter
    assert "shorter" in DETECTORS["length_drift"](hist(**{key: [100, 95, 84]}), **LD).message


def test_length_drift_smooths_and_catches_fast_growth():
    key = "completion/length_mean"
    # smooth=3: mean(110, 130, 116) = 118.67 -> 18.7% > 15%, though the last value alone is 116
    args = {**LD, "smooth": 3}
    assert DETECTORS["length_drift"](hist(**{key: [100, 110, 130, 116]}), **args) is not None
    # fast growth alone (a wide 30% drift budget): 76 vs the start 100 is -24%, inside it, but
    # 50 -> 76 over growth_window=2 steps is +52% > 50%
    wide = {**LD, "max_drift": 0.3}
    alert = DETECTORS["length_drift"](hist(**{key: [100, 50, 60, 76]}), **wide)
    assert alert is not None and "grew 52% in 2 steps" in alert.message
    assert DETECTORS["length_drift"](hist(**{key: [100, 50, 60, 74]}), **wide) is None  # +48%


REP = dict(metric="completion/repetition_rate", baseline=1, smooth=1, max_rate=0.3, max_rise=0.1)


def test_repetition_level_and_rise():
    key = "completion/repetition_rate"
    assert DETECTORS["repetition"](hist(**{key: [0.25, 0.31]}), **REP) is not None  # 0.31 > 0.3 (rise 0.06)
    assert DETECTORS["repetition"](hist(**{key: [0.0, 0.11]}), **REP) is not None  # rise 0.11 > 0.1
    assert DETECTORS["repetition"](hist(**{key: [0.0, 0.09]}), **REP) is None
    assert DETECTORS["repetition"](hist(**{key: [0.25, 0.29]}), **REP) is None


def test_batch_repetition_rate_by_hand():
    # "a b a b a b": 4 word bigrams? no: 6 words -> 5 bigrams (ab, ba, ab, ba, ab), 2 distinct -> 1 - 2/5 = 0.6
    # "x y z": 2 bigrams, both distinct -> 0; "hi": no bigram, left out -> (0.6 + 0) / 2
    assert batch_repetition_rate(["a b a b a b", "x y z", "hi"], n=2) == pytest.approx(0.3)
    # characters: "aaaa" has 3 char bigrams, 1 distinct -> 2/3
    assert batch_repetition_rate(["aaaa"], n=2, unit="char") == pytest.approx(2 / 3)
    assert batch_repetition_rate([], n=3) == 0.0
    assert batch_repetition_rate(["too short"], n=3) == 0.0


KL = dict(metric="kl", smooth=1, max_kl=0.5, growth_window=2, max_growth=3.0, min_kl=0.05)


def test_kl_ceiling_and_blow_up():
    assert DETECTORS["kl"](hist(kl=[0.1, 0.51]), **KL) is not None
    assert DETECTORS["kl"](hist(kl=[0.1, 0.49]), **KL) is None
    # windows of 2: before mean(0.02, 0.04) = 0.03, recent mean(0.08, 0.11) = 0.095 > 3 * 0.03 = 0.09
    alert = DETECTORS["kl"](hist(kl=[0.02, 0.04, 0.08, 0.11]), **KL)
    assert alert is not None and "blowing up" in alert.message
    assert DETECTORS["kl"](hist(kl=[0.02, 0.04, 0.08, 0.09]), **KL) is None  # 0.085 < 0.09
    # tripling near zero is normal early growth: recent 0.0095 < min_kl 0.05
    assert DETECTORS["kl"](hist(kl=[0.002, 0.004, 0.008, 0.011]), **KL) is None


ENT = dict(metric="entropy", baseline=1, smooth=1, min_entropy=0.05, max_drop=0.75)


def test_entropy_collapse_floor_and_drop():
    assert DETECTORS["entropy_collapse"](hist(entropy=[0.06, 0.049]), **ENT) is not None  # below the floor
    assert DETECTORS["entropy_collapse"](hist(entropy=[0.06, 0.051]), **ENT) is None
    # drop: 1 - 0.24 / 1.0 = 0.76 > 0.75; 1 - 0.26 = 0.74
    alert = DETECTORS["entropy_collapse"](hist(entropy=[1.0, 0.24]), **ENT)
    assert alert is not None and alert.values["drop"] == pytest.approx(0.76)
    assert DETECTORS["entropy_collapse"](hist(entropy=[1.0, 0.26]), **ENT) is None


RATIO = dict(metrics=["ratio/mean", "rollout/ratio_mean"], max_metric="ratio/max", smooth=1, max_mean=1.3,
             max_max=10.0)


def test_ratio_drift_mean_either_name_and_max():
    assert DETECTORS["ratio_drift"](hist(**{"ratio/mean": [1.0, 1.31]}), **RATIO) is not None
    assert DETECTORS["ratio_drift"](hist(**{"ratio/mean": [1.0, 1.29]}), **RATIO) is None
    assert DETECTORS["ratio_drift"](hist(**{"rollout/ratio_mean": [1.31]}), **RATIO) is not None
    alert = DETECTORS["ratio_drift"](hist(**{"ratio/mean": [1.0], "ratio/max": [10.5]}), **RATIO)
    assert alert is not None and alert.values["ratio/max"] == 10.5
    assert DETECTORS["ratio_drift"](hist(**{"ratio/mean": [1.0], "ratio/max": [9.5]}), **RATIO) is None


CLIP = dict(high_metric="clip/high_frac", low_metric="clip/low_frac", smooth=2, max_frac=0.3)


def test_clip_fraction_sums_high_and_low_and_smooths():
    # per step high + low: 0.2 + 0.05 = 0.25, 0.3 + 0.07 = 0.37; mean 0.31 > 0.3
    rows = hist(**{"clip/high_frac": [0.2, 0.3], "clip/low_frac": [0.05, 0.07]})
    alert = DETECTORS["clip_fraction"](rows, **CLIP)
    assert alert is not None and alert.values["clip_frac"] == pytest.approx(0.31)
    rows = hist(**{"clip/high_frac": [0.2, 0.3], "clip/low_frac": [0.05, 0.03]})  # mean 0.29
    assert DETECTORS["clip_fraction"](rows, **CLIP) is None


ZV = dict(metric="adv/zero_std_group_frac", smooth=3, max_frac=0.5, all_steps=2, reward_metric="reward/mean")


def test_zero_variance_needs_several_steps():
    key = "adv/zero_std_group_frac"
    assert DETECTORS["zero_variance"](hist(**{key: [0.9, 0.9]}), **ZV) is None  # 2 records < smooth 3
    assert DETECTORS["zero_variance"](hist(**{key: [0.5, 0.5, 0.53]}), **ZV) is not None  # mean 0.51
    assert DETECTORS["zero_variance"](hist(**{key: [0.5, 0.5, 0.47]}), **ZV) is None  # mean 0.49
    assert DETECTORS["zero_variance"](hist(**{key: [0.0, 0.0, 1.0]}), **ZV) is None  # one flat batch: 0.33


TR = dict(metric="completion/truncation_rate", baseline=1, smooth=1, max_rate=0.2, max_rise=0.1, all_steps=2)


def test_truncation_level_and_rise():
    key = "completion/truncation_rate"
    assert DETECTORS["truncation"](hist(**{key: [0.15, 0.21]}), **TR) is not None
    assert DETECTORS["truncation"](hist(**{key: [0.15, 0.19]}), **TR) is None
    assert DETECTORS["truncation"](hist(**{key: [0.0, 0.11]}), **TR) is not None  # creeping up by 0.11
    assert DETECTORS["truncation"](hist(**{key: [0.0, 0.09]}), **TR) is None


def test_infra_errors():
    args = dict(metric="reward/infra_error_rate", smooth=1, max_rate=0.05)
    alert = DETECTORS["infra_errors"](hist(**{"reward/infra_error_rate": [0.0, 0.06]}), **args)
    assert alert is not None and alert.step == 2 and "0.06" in alert.message
    assert DETECTORS["infra_errors"](hist(**{"reward/infra_error_rate": [0.0, 0.04]}), **args) is None


def test_history_gives_every_detector_the_same_answer_as_the_list_of_records():
    """The oracle for the incremental History the Monitor uses: on random histories (with gaps,
    NaNs and eval-only records), each detector returns the same alert, step by step, as when it
    rescans the plain list of records."""
    rng = random.Random(0)
    cfg = MonitorConfig()
    keys = sorted(cfg.watched_keys() - {"step"})
    fired = set()
    for trial in range(60):  # enough random histories that every detector fires (asserted below)
        records, history = [], History()
        for step in range(1, 41):
            record = {"step": step}
            for key in keys:
                if rng.random() < 0.8:
                    record[key] = rng.choice([float("nan"), rng.uniform(0, 2)]) if rng.random() < 0.05 \
                        else rng.uniform(0, 1.5) * (1 + step / 20)
            if step % 5:  # an eval every 5 steps
                record.pop("eval/accuracy", None)
            records.append(record)
            history.append(record)
            for name in DETECTORS:
                args = cfg.thresholds(name)
                from_list, from_history = DETECTORS[name](records, **args), DETECTORS[name](history, **args)
                assert from_list == from_history, (trial, step, name)
                if from_list is not None:
                    fired.add(name)
    assert fired == set(DETECTORS)  # every detector was exercised both ways


DIS = dict(metric="reward/disagreement", reward_metric="reward/mean", window=3, smooth=2, max_growth=0.5,
           min_reward_rise=0.0)


def test_reward_disagreement_fires_when_the_ensemble_disagrees_more_as_reward_rises():
    # 5 records = window 3 + smooth 2. Start: records 1-2, end: records 4-5.
    # disagreement 0.2, 0.2 -> 0.25, 0.35: (0.3 / 0.2) - 1 = +50%, not above the limit
    rows = hist(**{"reward/disagreement": [0.2, 0.2, 0.3, 0.25, 0.35], "reward/mean": [1, 1, 2, 2, 2]})
    assert DETECTORS["reward_disagreement"](rows, **DIS) is None
    # end 0.25, 0.37 -> 0.31: +55% while the reward went 1 -> 2
    rows = hist(**{"reward/disagreement": [0.2, 0.2, 0.3, 0.25, 0.37], "reward/mean": [1, 1, 2, 2, 2]})
    alert = DETECTORS["reward_disagreement"](rows, **DIS)
    assert alert is not None and alert.step == 5
    assert alert.values["growth"] == pytest.approx(0.55) and alert.values["reward_rise"] == pytest.approx(1.0)
    assert "0.2 -> 0.31" in alert.message
    # the same growth with a falling reward is an ensemble that got less sure everywhere, not hacking
    falling = hist(**{"reward/disagreement": [0.2, 0.2, 0.3, 0.25, 0.37], "reward/mean": [2, 2, 1, 1, 1]})
    assert DETECTORS["reward_disagreement"](falling, **DIS) is None
    assert DETECTORS["reward_disagreement"](rows[:4], **DIS) is None  # fewer than window + smooth records


def test_short_runs_compare_a_start_with_steps_after_it_and_say_which_limit_fired():
    """Round 4 of the misuse issue: on a 3-step run the start and the current window overlapped, so
    a random model's step-3 lengths read as drift; and an entropy below its floor that had risen was
    reported as having 'fallen -8%'."""
    key, defaults = "completion/length_mean", {**LD, "smooth": 3}
    assert DETECTORS["length_drift"](hist(**{key: [40, 52, 61]}), **defaults) is None  # now = mean(40, 52, 61)
    alert = DETECTORS["length_drift"](hist(**{key: [40, 52, 61, 55]}), **defaults)  # mean(52, 61, 55) = 56: +40%
    assert alert is not None and "40% longer" in alert.message
    ent = {**ENT, "smooth": 3}
    alert = DETECTORS["entropy_collapse"](hist(entropy=[0.02165, 0.0228, 0.0230, 0.02334]), **ent)
    assert alert is not None and "below the floor 0.05" in alert.message and "fallen" not in alert.message
    alert = DETECTORS["entropy_collapse"](hist(entropy=[1.0, 0.3, 0.2, 0.19]), **ent)  # mean(0.3, 0.2, 0.19) = 0.23
    assert alert is not None and "has fallen 77% from 1" in alert.message


TOOLS = dict(metric="agent/tool_error_rate", program_metric="agent/program_error_rate",
             metrics=["agent/errors/raised", "agent/errors/timeout", "agent/errors/program_raised",
                      "agent/errors/program_no_call"], smooth=2, min_rate=1.0)


def test_a_run_that_learns_nothing_is_said_at_its_second_step_naming_the_cause():
    """Round 4 of the misuse issue: a tool failing on every call, rewards equal in every group, every
    completion cut: said at once (two steps in a row), not after a smoothing window (or never: a rate
    of 1 is not above a limit of 1)."""
    flat = {**ZV, "smooth": 5}
    key = "adv/zero_std_group_frac"
    assert DETECTORS["zero_variance"](hist(**{key: [1.0]}), **flat) is None  # one flat step can be chance
    assert DETECTORS["zero_variance"](hist(**{key: [1.0, 0.75]}), **flat) is None
    alert = DETECTORS["zero_variance"](hist(**{key: [1.0, 1.0], "reward/mean": [0.0, 0.0]}), **flat)
    assert alert is not None and alert.step == 2
    assert "every group's completions got equal rewards in each of the last 2 steps" in alert.message
    assert "(reward/mean 0)" in alert.message and "learns nothing" in alert.message
    cut = {**TR, "smooth": 3, "baseline": 1}
    key = "completion/truncation_rate"
    assert DETECTORS["truncation"](hist(**{key: [1.0]}), **cut) is None
    alert = DETECTORS["truncation"](hist(**{key: [1.0, 1.0]}), **cut)
    assert alert is not None and "every completion hit the length limit" in alert.message
    assert "rollout.max_new_tokens" in alert.message
    rate, raised, timeout = "agent/tool_error_rate", "agent/errors/raised", "agent/errors/timeout"
    assert DETECTORS["tool_errors"](hist(**{rate: [1.0, 0.9], raised: [4, 3]}), **TOOLS) is None  # mean 0.95
    assert DETECTORS["tool_errors"](hist(**{rate: [1.0]}), **TOOLS) is None
    alert = DETECTORS["tool_errors"](hist(**{rate: [1.0, 1.0], raised: [1, 0], timeout: [3, 4]}), **TOOLS)
    assert alert is not None and alert.step == 2
    assert "every tool call failed in each of the last 2 steps (timeout: 7, raised: 1)" in alert.message
    assert "agent.tool_timeout_s" in alert.message  # the fix for the kind seen most
    assert alert.values == {rate: 1.0, "errors/timeout": 7.0, "errors/raised": 1.0}
    lower = DETECTORS["tool_errors"](hist(**{rate: [0.5, 0.7], raised: [1, 1]}), **{**TOOLS, "min_rate": 0.6})
    assert lower is not None and "agent/tool_error_rate 0.6 (mean of the last 2 steps)" in lower.message
    # an agent program's failed episodes: the same rule, its own kinds and fixes
    program, prog_raised, no_call = "agent/program_error_rate", "agent/errors/program_raised", \
        "agent/errors/program_no_call"
    assert DETECTORS["tool_errors"](hist(**{program: [1.0, 0.5], prog_raised: [8, 4]}), **TOOLS) is None
    alert = DETECTORS["tool_errors"](hist(**{program: [1.0, 1.0], prog_raised: [1, 0], no_call: [7, 8],
                                             rate: [0.0, 0.0]}), **TOOLS)
    assert alert is not None and alert.step == 2
    assert alert.message.startswith("every agent program episode failed in each of the last 2 steps "
                                    "(program_no_call: 15, program_raised: 1), so nothing is trained")
    assert "returns without calling the model" in alert.message
    assert alert.values == {program: 1.0, "errors/program_no_call": 15.0, "errors/program_raised": 1.0}
