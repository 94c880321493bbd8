"""Config loading: readable errors, overrides, presets, consistency checks, save/reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlft.config import Config, config_warnings, dump_config, load_config
from rlft.errors import ConfigError, RlftError
from rlft.monitor.rundir import RunDir


def minimal(**extra) -> dict:
    return {"output_dir": "runs/x", "model": {"path": "m"}, "data": {"train": "d.jsonl"}, **extra}


def online(method: str, **extra) -> dict:
    return minimal(method=method, rewards=[{"fn": "math"}], **extra)


def config_error(raw: dict, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw, overrides)
    return str(info.value)


# -- readable errors --------------------------------------------------------------------------

def test_unknown_key_suggests_nearest_valid_key():
    message = config_error(minimal(training={"learnin_rate": 1e-4}))
    assert "training.learnin_rate: unknown key" in message
    assert "Did you mean 'training.learning_rate'?" in message


def test_unknown_top_level_section_suggests_the_section():
    message = config_error(minimal(trainig={"epochs": 2}))
    assert "Did you mean 'training'?" in message


def test_unknown_key_far_from_any_name_lists_valid_keys_without_a_guess():
    message = config_error(minimal(lora={"zzzzzz": 1}))
    assert "lora.zzzzzz: unknown key" in message
    assert "Did you mean" not in message
    assert "Valid keys here: enabled, r, alpha, dropout, target_modules" in message


def test_wrong_type_names_field_path_and_expected_type():
    message = config_error(minimal(training={"learning_rate": "fast"}))
    assert "training.learning_rate: expected a number, got 'fast' (str)" in message


def test_wrong_type_integer_field():
    # 2.5 epochs is not an integer; pydantic refuses to truncate it.
    message = config_error(minimal(training={"epochs": 2.5}))
    assert "training.epochs: expected an integer" in message


def test_missing_required_field_and_bad_literal_are_both_reported():
    raw = minimal(model={"dtype": "fp8"})  # no model.path, and fp8 is not a choice
    message = config_error(raw)
    assert "model.path: required field is missing" in message
    assert "model.dtype:" in message and "'fp8'" in message


def test_config_error_is_an_rlft_error_and_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(minimal(training={"learnin_rate": 1e-4})))
    with pytest.raises(RlftError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_config_file_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


# -- overrides --------------------------------------------------------------------------------

@pytest.mark.parametrize("item", ["training.learning_rate", "=5", "training..epochs=2", ".epochs=2", " =1"])
def test_malformed_override_is_a_config_error_with_the_expected_form(item):
    message = config_error(minimal(), [item])
    assert f"bad override {item!r}" in message
    assert "section.key=value" in message


def test_override_through_a_value_is_reported():
    message = config_error(minimal(training={"epochs": 2}), ["training.epochs.x=1"])
    assert "training.epochs is a value, not a section" in message


def test_overrides_parse_yaml_values():
    cfg = load_config(minimal(), ["training.epochs=3", "rollout.stop=[a,b]", "training.max_grad_norm=null",
                                  "data.shuffle=false", "model.path=other/model", "seed=7"])
    assert cfg.training.epochs == 3 and isinstance(cfg.training.epochs, int)
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.training.max_grad_norm is None
    assert cfg.data.shuffle is False
    assert cfg.model.path == "other/model"
    assert cfg.seed == 7


def test_override_scientific_notation_without_dot_is_a_float():
    # YAML 1.1 reads "1e-5" as a string; the float field must still get 1e-5.
    cfg = load_config(minimal(), ["training.learning_rate=1e-5"])
    assert cfg.training.learning_rate == pytest.approx(1e-5, rel=1e-12)


def test_override_creates_missing_sections_and_wins_over_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(minimal(training={"epochs": 2})))
    cfg = load_config(path, ["training.epochs=5", "lora.enabled=true"])
    assert cfg.training.epochs == 5
    assert cfg.lora.enabled is True


def test_overrides_do_not_change_the_callers_dict():
    # A script sweeping settings with api.train(base, [...]) must not carry one run's override
    # into the next.
    raw = minimal(training={"epochs": 2})
    cfg = load_config(raw, ["training.epochs=5", "lora.enabled=true"])
    assert cfg.training.epochs == 5 and cfg.lora.enabled
    assert raw == minimal(training={"epochs": 2})
    again = load_config(raw)
    assert again.training.epochs == 2 and not again.lora.enabled


def test_override_with_a_wrong_type_is_reported_with_its_path():
    message = config_error(minimal(), ["training.batch_size=many"])
    assert "training.batch_size: expected an integer, got 'many' (str)" in message


# -- presets and consistency --------------------------------------------------------------------

def test_dapo_preset_fills_the_algorithm_section():
    cfg = load_config(online("dapo"))
    a = cfg.algorithm
    assert a.clip_high == 0.28 and a.clip_low == 0.2
    assert a.dynamic_sampling is True
    assert a.kl_coef == 0.0
    assert a.loss_agg == "token_mean"
    # base values the preset does not mention still come through
    assert a.advantage == "group_norm" and a.std_floor == 1e-4


def test_explicit_values_win_over_the_preset():
    cfg = load_config(online("dapo", algorithm={"clip_high": 0.3, "dynamic_sampling": False}))
    assert cfg.algorithm.clip_high == 0.3
    assert cfg.algorithm.dynamic_sampling is False
    assert cfg.algorithm.kl_coef == 0.0  # untouched preset value


def test_override_wins_over_the_preset():
    cfg = load_config(online("dapo"), ["algorithm.clip_high=0.35"])
    assert cfg.algorithm.clip_high == 0.35


def test_dr_grpo_constant_normaliser_defaults_to_max_new_tokens():
    cfg = load_config(online("dr_grpo", rollout={"max_new_tokens": 100}))
    assert cfg.algorithm.loss_agg == "constant"
    assert cfg.algorithm.loss_constant == 100
    assert cfg.algorithm.advantage == "group_mean"


def test_sft_leaves_the_algorithm_section_unset():
    cfg = load_config(minimal())
    assert cfg.algorithm.clip_high is None and cfg.algorithm.advantage is None


def test_group_size_one_with_an_online_method_is_an_error():
    message = config_error(online("grpo", rollout={"group_size": 1}))
    assert "rollout.group_size is 1" in message and "at least 2" in message


def test_group_size_one_is_fine_offline():
    assert load_config(minimal(rollout={"group_size": 1})).rollout.group_size == 1


def test_online_method_without_rewards_is_an_error():
    message = config_error(minimal(method="grpo"))
    assert "rewards:" in message and "at least one reward" in message


def test_dual_clip_must_exceed_one():
    message = config_error(online("grpo", algorithm={"dual_clip": 0.5}))
    assert "algorithm.dual_clip must be > 1" in message


def test_sequence_and_weight_losses_as_parts_of_any_preset():
    """policy_loss is a part like the others: a preset's choice, and any preset's to override."""
    assert load_config(online("gspo")).algorithm.policy_loss == "gspo"
    a = load_config(online("dapo", algorithm={"policy_loss": "cispo", "clip_low": 1.0})).algorithm
    assert (a.policy_loss, a.clip_low, a.clip_high, a.dynamic_sampling) == ("cispo", 1.0, 0.28, True)
    assert load_config(online("grpo")).algorithm.policy_loss == "clipped"
    message = config_error(online("gspo", algorithm={"dual_clip": 3.0}))
    assert "policy_loss gspo has no such term" in message
    # cispo's wide upper bound is its design, not the wide-clip warning's concern
    assert not [w for w in config_warnings(load_config(online("cispo"))) if "clip_high" in w]


# -- saved config -----------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    minimal(training={"learning_rate": 3e-4, "epochs": 2}, lora={"enabled": True, "target_modules": ["q_proj"]}),
    online("dapo", rollout={"stop": ["###"]}, algorithm={"clip_high": 0.3}),
    online("dr_grpo"),
], ids=["sft", "dapo", "dr_grpo"])
def test_resolved_config_saved_in_run_dir_reloads_equal(tmp_path, raw):
    cfg = load_config({**raw, "output_dir": str(tmp_path / "run")})
    RunDir(cfg.output_dir).create(cfg)
    saved = Path(cfg.output_dir) / "config.yaml"
    assert saved.is_file()
    again = load_config(saved)
    assert again == cfg
    # the file states resolved values, not just what the user wrote
    text = yaml.safe_load(saved.read_text())
    if cfg.is_online:
        assert text["algorithm"]["clip_low"] == 0.2 and text["algorithm"]["kl_estimator"] == "k3"


def test_dump_config_is_plain_yaml(tmp_path):
    cfg = load_config(minimal())
    dump_config(cfg, tmp_path / "c.yaml")
    data = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert data["training"]["learning_rate"] == 1e-5
    assert Config.model_validate(data) == cfg


# -- method-dependent defaults and advice -------------------------------------------------------

@pytest.mark.parametrize("method", ["dapo", "dr_grpo"])
def test_adaptive_kl_from_a_zero_beta_preset_is_refused(method):
    # beta starts at the preset's 0 and the controller multiplies it: it would stay 0 forever
    message = config_error(online(method, algorithm={"kl_target": 0.05}))
    assert "algorithm.kl_target=0.05" in message and "algorithm.kl_coef=0.0" in message
    assert "e.g. algorithm.kl_coef=0.01" in message
    cfg = load_config(online(method, algorithm={"kl_target": 0.05, "kl_coef": 0.01}))
    assert cfg.needs_reference


def test_kl_controller_choice_and_its_checks():
    # defaults: the dead band (PPO paper) and Ziegler et al.'s horizon, for every preset
    for method in ("grpo", "rloo", "reinforce_pp", "ppo"):
        a = load_config(online(method)).algorithm
        assert (a.kl_controller, a.kl_horizon) == ("deadband", 10_000)
    a = load_config(online("grpo", algorithm={"kl_target": 0.05, "kl_controller": "proportional",
                                              "kl_horizon": 500})).algorithm
    assert (a.kl_controller, a.kl_horizon, a.kl_target) == ("proportional", 500, 0.05)
    # the proportional controller steers toward kl_target: without one it would never act
    message = config_error(online("grpo", algorithm={"kl_controller": "proportional"}))
    assert "algorithm.kl_controller=proportional" in message and "algorithm.kl_target" in message
    for bad in (0, -10):
        assert "kl_horizon" in config_error(online("grpo", algorithm={"kl_horizon": bad}))
    assert "kl_controller" in config_error(online("grpo", algorithm={"kl_controller": "pid"}))


def test_a_setting_of_an_unused_kl_controller_is_warned_about():
    from rlft.config import config_warnings

    # a horizon with fixed beta (no kl_target), or with the dead band
    fixed = config_warnings(load_config(online("grpo", algorithm={"kl_horizon": 500})))
    assert len(fixed) == 1 and "algorithm.kl_horizon=500 has no effect" in fixed[0] and "kl_target" in fixed[0]
    band = config_warnings(load_config(online("grpo", algorithm={"kl_horizon": 500, "kl_target": 0.1})))
    assert len(band) == 1 and "kl_controller is deadband" in band[0]
    # the dead band's factor with the proportional controller
    prop = config_warnings(load_config(online("grpo", algorithm={"kl_adapt_factor": 2.0, "kl_target": 0.1,
                                                                 "kl_controller": "proportional"})))
    assert len(prop) == 1 and "algorithm.kl_adapt_factor=2 has no effect" in prop[0]
    # each with the controller that uses it: nothing to say
    assert config_warnings(load_config(online("grpo", algorithm={"kl_horizon": 500, "kl_target": 0.1,
                                                                 "kl_controller": "proportional"}))) == []
    assert config_warnings(load_config(online("grpo", algorithm={"kl_adapt_factor": 2.0, "kl_target": 0.1}))) == []


def test_a_reference_is_needed_only_when_a_kl_term_uses_it():
    assert not load_config(online("dapo")).needs_reference  # beta 0
    assert load_config(online("grpo")).needs_reference
    assert not load_config(online("grpo", algorithm={"kl_coef": 0.0})).needs_reference
    assert not load_config(minimal()).needs_reference  # SFT
    assert load_config(minimal(method="dpo")).needs_reference


def test_learning_rate_defaults_by_method_and_an_explicit_one_wins():
    assert load_config(minimal()).training.learning_rate == 1e-5
    assert load_config(minimal(method="reward_model")).training.learning_rate == 1e-5
    assert load_config(minimal(method="dpo")).training.learning_rate == 1e-6
    for method in ("grpo", "dapo", "rloo", "ppo"):
        assert load_config(online(method)).training.learning_rate == 1e-6
    assert load_config(online("grpo", training={"learning_rate": 3e-6})).training.learning_rate == 3e-6
    assert load_config(online("grpo"), ["training.learning_rate=2e-6"]).training.learning_rate == 2e-6


def test_warnings_for_a_far_off_online_learning_rate_and_a_wide_clip():
    from rlft.config import config_warnings

    assert config_warnings(load_config(online("grpo"))) == []
    assert config_warnings(load_config(online("grpo", training={"learning_rate": 4e-5}))) == []  # within 10x
    lr = config_warnings(load_config(online("grpo", training={"learning_rate": 1e-4})))
    assert len(lr) == 1 and "training.learning_rate=0.0001 is far outside the 5e-07..5e-06" in lr[0]
    clip = config_warnings(load_config(online("dapo", algorithm={"clip_high": 0.35})))
    assert len(clip) == 1 and "algorithm.clip_high=0.35 is above 0.3" in clip[0]
    assert config_warnings(load_config(online("dapo"))) == []  # clip-higher 0.28 is fine
    assert config_warnings(load_config(minimal(training={"learning_rate": 1e-3}))) == []  # SFT: no advice


def test_reward_model_margin_default_is_in_the_usual_range():
    assert load_config(minimal(method="reward_model")).reward_model.margin == 0.5
