"""Head-to-head win rate (`rlft eval TARGET --compare BASELINE`): verdicts and their statistics on
scripted answers, the judge's position randomisation and its mapping back, a known winner on real
tiny models, and the CLI's saved report and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_clean_user_error, run_main, write_jsonl
from rlft.config import EvalConfig, RewardSpec
from rlft.errors import ConfigError, RlftError
from rlft.eval import parts as eval_parts
from rlft.eval.compare import (FunctionJudge, build_judge, compare_models, judge_positions, parse_judgement,
                               score_verdicts, tally)
from rlft.rollout.contract import Completion

CFG = EvalConfig(max_new_tokens=8, batch_size=8, max_examples=None)

JUDGES = '''
def always_a(prompt, answer_a, answer_b, **row):
    return "a"

def prefers_good(prompt, answer_a, answer_b):
    if ("good" in answer_a) == ("good" in answer_b):
        return "tie"
    return "a" if "good" in answer_a else "b"

def longer(prompt, answer_a, answer_b, **row):
    return max(-1.0, min(1.0, (len(answer_a) - len(answer_b)) / 8))

def shouts(prompt, answer_a, answer_b, **row):
    return "A is better"

def too_few(prompt, answer):
    return "a"

def needs_topic(prompt, answer_a, answer_b, topic):
    return "tie"
'''

REWARDS = '''
def value(prompt, completion, **row):
    return float(completion) if completion.strip() else None

def length(prompt, completion, **row):
    return len(completion)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    (root / "judges.py").write_text(JUDGES)
    (root / "rewards.py").write_text(REWARDS)
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}
                                                   for i in range(6)])
    return root, prompts


@pytest.fixture(scope="module")
def mute_path(qwen_path, tmp_path_factory) -> Path:
    """The tiny model with its final norm zeroed: every logit is 0, greedy picks id 0
    (<|endoftext|>, a stop id), so it answers every prompt with "" and stops."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("mute") / "mute"
    shutil.copytree(qwen_path, out)
    model = AutoModelForCausalLM.from_pretrained(qwen_path)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(out)
    return out


class ScriptedEngine:
    """Answers prompt i with script[i] (one text per sample), whatever the model."""

    def __init__(self, script: list[list[str]]):
        self.script = script

    def generate(self, prompts, params):
        return [Completion(p, [1] * len(text), text, [0.0] * len(text), "stop", i)
                for i, p in enumerate(prompts) for text in self.script[i][:params.n]]

    def close(self):
        pass


def scripted(monkeypatch, scripts: dict[str, list[list[str]]]) -> None:
    """Each model folder's engine answers from its own script (keyed by folder name)."""
    monkeypatch.setattr(eval_parts, "build_engine",
                        lambda policy, *a, **k: ScriptedEngine(scripts[Path(policy.model.name_or_path).name]))


def two_folders(qwen_path: Path, tmp_path: Path) -> tuple[Path, Path]:
    target, baseline = tmp_path / "target", tmp_path / "baseline"
    shutil.copytree(qwen_path, target)
    shutil.copytree(qwen_path, baseline)
    return target, baseline


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_tally_counts_and_wilson_interval_by_hand():
    verdicts = score_verdicts([3.0, 1.0, 1.0, 0.0, 2.0, None], [1.0, 1.0 + 1e-12, 0.5, 1.0, 1.0, 2.0])
    assert verdicts == [1, 0, 1, -1, 1, None]  # 1e-12 apart is within the 1e-9 tie margin
    result, unscored = tally(verdicts)
    assert (result.wins, result.ties, result.losses, unscored) == (3, 1, 1, 1)
    # rate = (3 + 1/2) / 5 = 0.7. Wilson, z = 1.959964, z^2 = 3.841459, n = 5:
    # denom = 1 + z^2/n = 1.768292; centre = (0.7 + z^2/10) / denom = 1.084146 / 1.768292 = 0.613104
    # half = z * sqrt(0.7 * 0.3 / 5 + z^2 / 100) / denom = 1.959964 * 0.283575 / 1.768292 = 0.314312
    assert result.rate == pytest.approx(0.7)
    assert result.low == pytest.approx(0.613104 - 0.314312, abs=1e-5)
    assert result.high == pytest.approx(0.613104 + 0.314312, abs=1e-5)


def test_nothing_judged_is_a_clear_error():
    with pytest.raises(RlftError, match="all 2 were unscored"):
        tally([None, None])


def test_parse_judgement_accepts_the_contract_and_names_the_rest():
    assert [parse_judgement(v, "j", "f:1") for v in ("a", "B", " tie ", 0.25, -1, 0.0)] == [1, -1, 0, 1, -1, 0]
    for bad in ("A is better", 1.5, float("nan"), True, None, ["a"]):
        with pytest.raises(RlftError) as err:
            parse_judgement(bad, "judges.py:j", "prompts.jsonl:3")
        text = str(err.value)
        assert "judges.py:j" in text and "prompts.jsonl:3" in text and '"a", "b" or "tie"' in text


def test_positions_are_seeded_fair_coins():
    first = judge_positions(400, seed=3)
    assert first == judge_positions(400, seed=3)
    assert first != judge_positions(400, seed=4)
    assert 160 < sum(first) < 240  # Binomial(400, 1/2): mean 200, sd 10, so this is +-4 sd


# ---------------------------------------------------------------------------------------------
# compare_models on scripted answers (real tiny models loaded, engines scripted)


def test_reward_judged_counts_and_records(monkeypatch, qwen_path, files, tmp_path):
    root, prompts = files
    target, baseline = two_folders(qwen_path, tmp_path)
    # the `value` reward reads the answer as a number; "" is unverifiable (None)
    scripted(monkeypatch, {"target": [["2"], ["1"], ["1"], ["0"], ["3"], [""]],
                           "baseline": [["1"], ["1"], ["0"], ["1"], ["3"], ["5"]]})
    judge = build_judge([RewardSpec(fn=f"{root}/rewards.py:value")])
    c = compare_models(target, baseline, str(prompts), CFG, judge, device="cpu")
    # win, tie, win, loss, tie, unscored -> rate (2 + 2/2) / 5 = 0.6
    assert [r["verdict"] for r in c.records] == ["win", "tie", "win", "loss", "tie", "unscored"]
    assert (c.result.wins, c.result.ties, c.result.losses, c.unscored) == (2, 2, 1, 1)
    assert c.result.rate == pytest.approx(0.6)
    assert c.metrics["pairs"] == 5 and c.metrics["unscored"] == 1
    expected = {"prompt": "What is 3 + 3?", "target": "0", "baseline": "1", "target_reward": 0.0,
                "baseline_reward": 1.0}
    assert {k: c.records[3][k] for k in expected} == expected


def test_samples_are_paired_by_index(monkeypatch, qwen_path, files, tmp_path):
    root, prompts = files
    target, baseline = two_folders(qwen_path, tmp_path)
    cfg = CFG.model_copy(update={"num_samples": 2, "max_examples": 2})
    scripted(monkeypatch, {"target": [["3", "0"], ["1", "1"]], "baseline": [["1", "2"], ["1", "0"]]})
    c = compare_models(target, baseline, str(prompts), cfg, build_judge([RewardSpec(fn=f"{root}/rewards.py:value")]),
                       device="cpu")
    assert [r["verdict"] for r in c.records] == ["win", "loss", "tie", "win"]
    assert [r["where"].rsplit(":", 1)[1] for r in c.records] == ["1", "1", "2", "2"]


def test_judge_always_a_wins_exactly_where_target_was_shown_first(monkeypatch, qwen_path, files, tmp_path):
    root, prompts = files
    target, baseline = two_folders(qwen_path, tmp_path)
    scripted(monkeypatch, {"target": [["t"]] * 6, "baseline": [["b"]] * 6})
    judge = build_judge([], judge=f"{root}/judges.py:always_a")
    for seed in (0, 1):
        c = compare_models(target, baseline, str(prompts), CFG, judge, device="cpu", seed=seed)
        first = judge_positions(6, seed)
        assert c.result.wins == sum(first) and c.result.losses == 6 - sum(first) and c.result.ties == 0
        assert [r["shown_as_a"] == "target" for r in c.records] == first
        assert [r["verdict"] for r in c.records] == ["win" if f else "loss" for f in first]


def test_verdicts_follow_the_answers_not_the_positions(monkeypatch, qwen_path, files, tmp_path):
    """A judge preferring answers that say "good": TARGET says it on prompts 0-3, both on 4,
    neither on 5 -> 4 wins and 2 ties on every seed, whichever answer was shown first."""
    root, prompts = files
    target, baseline = two_folders(qwen_path, tmp_path)
    scripted(monkeypatch, {"target": [["good"]] * 5 + [["meh"]], "baseline": [["bad"]] * 4 + [["good"], ["meh"]]})
    judge = build_judge([], judge=f"{root}/judges.py:prefers_good")
    shown = set()
    for seed in range(2):
        c = compare_models(target, baseline, str(prompts), CFG, judge, device="cpu", seed=seed)
        assert [r["verdict"] for r in c.records] == ["win"] * 4 + ["tie", "tie"]
        shown |= {r["shown_as_a"] for r in c.records[:4]}
    assert shown == {"target", "baseline"}  # both orders occurred and both were mapped back
    # swapping the roles swaps the outcome: 4 losses
    c = compare_models(baseline, target, str(prompts), CFG, judge, device="cpu")
    assert (c.result.wins, c.result.ties, c.result.losses) == (0, 2, 4)


def test_numeric_judge_sign_decides(monkeypatch, qwen_path, files, tmp_path):
    root, prompts = files
    target, baseline = two_folders(qwen_path, tmp_path)
    scripted(monkeypatch, {"target": [["xxxx"], ["x"], ["xx"]] * 2, "baseline": [["x"], ["xxxx"], ["xx"]] * 2})
    c = compare_models(target, baseline, str(prompts), CFG, build_judge([], judge=f"{root}/judges.py:longer"),
                       device="cpu", seed=5)
    assert [r["verdict"] for r in c.records] == ["win", "loss", "tie"] * 2
    # the judge said +-3/8 (or 0) from where it saw TARGET's answer
    assert {abs(r["judge_said"]) for r in c.records} == {0.375, 0.0}


def test_bad_judge_return_and_signature(monkeypatch, qwen_path, files, tmp_path):
    root, prompts = files
    target, baseline = two_folders(qwen_path, tmp_path)
    scripted(monkeypatch, {"target": [["t"]] * 6, "baseline": [["b"]] * 6})
    with pytest.raises(RlftError) as err:
        compare_models(target, baseline, str(prompts), CFG, build_judge([], judge=f"{root}/judges.py:shouts"),
                       device="cpu")
    assert "shouts" in str(err.value) and "prompts.jsonl:1" in str(err.value) and "'A is better'" in str(err.value)
    with pytest.raises(ConfigError, match="takes 2 positional"):
        build_judge([], judge=f"{root}/judges.py:too_few")
    needs = build_judge([], judge=f"{root}/judges.py:needs_topic")
    assert isinstance(needs, FunctionJudge) and needs.required_fields == ("topic",)
    with pytest.raises(RlftError, match="topic"):  # the rows lack it: reported before generating
        compare_models(target, baseline, str(prompts), CFG, needs, device="cpu")


# ---------------------------------------------------------------------------------------------
# Real generation: a known winner, identical models, a reward model


def test_known_winner_against_a_mute_model(qwen_path, mute_path, files):
    """The mute model answers "" everywhere; by answer length the tiny model wins every prompt it
    answers with at least one character and ties the others; as BASELINE the roles reverse."""
    root, prompts = files
    judge = build_judge([RewardSpec(fn=f"{root}/rewards.py:length")])
    c = compare_models(qwen_path, mute_path, str(prompts), CFG, judge, device="cpu")
    assert all(r["baseline"] == "" and r["baseline_finish"] == "stop" for r in c.records)
    spoke = sum(r["target"] != "" for r in c.records)
    assert spoke >= 3 and c.result.wins == spoke and c.result.ties == 6 - spoke and c.result.losses == 0
    back = compare_models(mute_path, qwen_path, str(prompts), CFG, judge, device="cpu")
    assert (back.result.wins, back.result.losses) == (0, spoke)
    assert [r["baseline"] for r in back.records] == [r["target"] for r in c.records]  # same seed, same answers


def test_identical_models_tie_everywhere(qwen_path, files):
    root, prompts = files
    judge = build_judge([RewardSpec(fn=f"{root}/rewards.py:length")])
    c = compare_models(qwen_path, qwen_path, str(prompts), CFG.model_copy(update={"temperature": 1.0}), judge,
                       device="cpu", seed=7)
    # sampled at temperature 1 from one seed: both runs draw the same answers
    assert [r["target"] for r in c.records] == [r["baseline"] for r in c.records]
    assert (c.result.ties, c.result.rate) == (6, 0.5)


def test_reward_model_judge_scores_each_answer(qwen_path, mute_path, files, tmp_path):
    """Each answer's judge score equals the reward model's forward run by hand on the rendered
    conversation. (Before: the oracle was `rlft.rewards.reward_model`, the function the judge
    wraps, so a rendering or pooling bug in it would agree with itself.)"""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root, prompts = files
    rm_dir = tmp_path / "rm"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(qwen_path, num_labels=1).save_pretrained(rm_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(qwen_path / f, rm_dir / f)
    c = compare_models(qwen_path, mute_path, str(prompts), CFG, build_judge([], judge_model=str(rm_dir), device="cpu"),
                       device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()

    def score(prompt, answer):
        """The oracle, by hand: one unpadded sequence (the chat template's rendering of the user
        turn and the answer), the backbone's hidden state at its last token, times the score head."""
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            hidden = rm.model(input_ids=ids).last_hidden_state[0, -1]  # (H,)
            return float(hidden @ rm.score.weight[0])

    assert any(r["target"] for r in c.records)  # non-empty answers against the mute model's ""
    for r in c.records:
        t, b = score(r["prompt"], r["target"]), score(r["prompt"], r["baseline"])
        assert r["target_reward"] == pytest.approx(t, abs=1e-5) and r["baseline_reward"] == pytest.approx(b, abs=1e-5)
        assert r["verdict"] == ("tie" if abs(t - b) <= 1e-9 else "win" if t > b else "loss")


# ---------------------------------------------------------------------------------------------
# The CLI


def test_cli_compare_saves_report_for_a_run(monkeypatch, capsys, qwen_path, mute_path, files, tmp_path):
    """TARGET is a run directory: its rewards and eval settings are used and the report lands in
    RUN/evals/compare-<data>.json."""
    import yaml

    root, prompts = files
    run = tmp_path / "run"
    shutil.copytree(qwen_path, run / "final")
    (run / "config.yaml").write_text(yaml.safe_dump({
        "method": "grpo", "output_dir": str(run), "model": {"path": str(qwen_path), "device": "cpu"},
        "data": {"train": str(prompts)}, "rewards": [{"fn": f"{root}/rewards.py:length"}],
        "eval": {"max_new_tokens": 6, "batch_size": 8}}))
    result = run_main(monkeypatch, capsys, "eval", str(run), "--data", str(prompts), "--compare", str(mute_path))
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads((run / "evals" / "compare-prompts.json").read_text())
    m = saved["metrics"]
    assert saved["judge"] == "rewards length" and saved["settings"]["eval"]["max_new_tokens"] == 6
    assert m["wins"] + m["ties"] == 6 and m["losses"] == 0 and m["wins"] >= 3
    assert len(saved["records"]) == 6
    shown = result.stdout + result.stderr  # the console writes to stderr
    assert "wins / ties / losses" in shown and f"{int(m['wins'])} / {int(m['ties'])} / 0" in shown


def test_cli_compare_with_judge_writes_out(monkeypatch, capsys, qwen_path, files, tmp_path):
    root, prompts = files
    out = tmp_path / "cmp.json"
    result = run_main(monkeypatch, capsys, "eval", str(qwen_path), "--data", str(prompts), "--compare", str(qwen_path),
                      "--judge", f"{root}/judges.py:always_a", "--max-new-tokens", "4", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads(out.read_text())
    first = judge_positions(6, 0)
    assert saved["metrics"]["wins"] == sum(first) and saved["metrics"]["losses"] == 6 - sum(first)
    assert saved["settings"]["rewards"] == [] and saved["settings"]["eval"]["max_new_tokens"] == 4


@pytest.mark.parametrize("extra, message", [
    (["--compare", "{tmp}/no-such-model"], "no such folder"),
    (["--judge", "{root}/judges.py:always_a"], "add --compare BASELINE"),
    (["--compare", "{qwen}"], "needs a judge"),
    (["--compare", "{qwen}", "--reward", "{root}/rewards.py:length", "--judge", "{root}/judges.py:always_a"],
     "one way to judge"),
    (["--compare", "{qwen}", "--judge", "{root}/judges.py:shouts", "--max-new-tokens", "2"], "A is better"),
])
def test_cli_compare_clear_errors(monkeypatch, capsys, qwen_path, files, tmp_path, extra, message):
    root, prompts = files
    args = [a.format(tmp=tmp_path, root=root, qwen=qwen_path) for a in extra]
    result = run_main(monkeypatch, capsys, "eval", str(qwen_path), "--data", str(prompts), *args)
    assert message in assert_clean_user_error(result) + result.stdout


# ---------------------------------------------------------------------------------------------
# An LLM judge over HTTP (the stub server of tests/judge_stub.py)


@pytest.fixture
def judge_server():
    from judge_stub import JudgeStub

    server = JudgeStub()
    yield server
    server.close()


def _llm_spec(server, name="grader"):
    from judge_stub import MODEL, RUBRIC

    return RewardSpec(fn="llm_judge", name=name, args={"base_url": server.base_url, "model": MODEL, "rubric": RUBRIC,
                                                       "backoff_s": 0.01})


def test_llm_judge_compares_pairs_in_seeded_order(monkeypatch, qwen_path, files, tmp_path, judge_server):
    """The stub prefers the answer saying "good" more often: the verdicts follow the answers on
    every seed, whichever was shown as A; a pair it gives no verdict is unscored, its reply kept."""
    root, prompts = files
    target, baseline = two_folders(qwen_path, tmp_path)
    scripted(monkeypatch, {"target": [["good good"], ["good"], ["meh"], ["good"], ["garbage"], ["x"]],
                           "baseline": [["good"], ["meh"], ["good"], ["good"], ["good"], ["x"]]})
    judge = build_judge([RewardSpec(fn=f"{root}/rewards.py:length"), _llm_spec(judge_server)], judge="grader")
    shown = set()
    for seed in (0, 1):
        c = compare_models(target, baseline, str(prompts), CFG, judge, device="cpu", seed=seed)
        assert [r["verdict"] for r in c.records] == ["win", "win", "loss", "tie", "unscored", "tie"]
        assert (c.result.wins, c.result.ties, c.result.losses, c.unscored) == (2, 2, 1, 1)
        first = judge_positions(6, seed)
        assert [r["shown_as_a"] == "target" for r in c.records] == first
        # pair 0: TARGET's answer won, so the judge said "a" exactly where it was shown first
        assert c.records[0]["judge_said"] == ("a" if first[0] else "b")
        assert c.records[0]["judge_reply"] == f"Verdict: {'A' if first[0] else 'B'}"
        assert c.records[4]["judge_said"] is None and c.records[4]["judge_reply"] == "Both have merits."
        shown |= {r["shown_as_a"] for r in c.records}
    assert shown == {"target", "baseline"}
    assert judge.description.startswith("LLM judge grader (stub-judge at http://127.0.0.1:")


def test_llm_judge_must_be_among_the_rewards(judge_server):
    with pytest.raises(RlftError, match="have no llm_judge reward"):
        build_judge([RewardSpec(fn="exact_match")], judge="llm_judge")
    with pytest.raises(RlftError, match=r"several llm_judge rewards \(one, two\)"):
        build_judge([_llm_spec(judge_server, "one"), _llm_spec(judge_server, "two")], judge="llm_judge")
    with pytest.raises(RlftError, match=r"named 'three' \(they have: one\)"):
        build_judge([_llm_spec(judge_server, "one")], judge="three")
    assert "one" in build_judge([_llm_spec(judge_server, "one")], judge="llm_judge").description


def test_cli_compare_with_an_llm_judge_from_the_config(monkeypatch, capsys, qwen_path, files, tmp_path, judge_server):
    import yaml

    root, prompts = files
    config = tmp_path / "judge.yaml"
    config.write_text(yaml.safe_dump({
        "method": "grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(qwen_path), "device": "cpu"},
        "data": {"train": str(prompts)}, "rewards": [_llm_spec(judge_server, "llm_judge").model_dump(mode="json")]}))
    out = tmp_path / "cmp.json"
    result = run_main(monkeypatch, capsys, "eval", str(qwen_path), "--data", str(prompts), "--compare", str(qwen_path),
                      "--config", str(config), "--judge", "llm_judge", "--max-new-tokens", "4", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads(out.read_text())
    # the same model and seed on both sides: identical answers, and the stub counts "good" alike
    assert saved["metrics"]["ties"] == 6 and saved["judge"].startswith("LLM judge llm_judge")
    assert {r["judge_reply"] for r in saved["records"]} == {"Verdict: tie"}
    assert len(judge_server.requests) == 6


def test_cli_compare_of_an_agent_run_compares_episodes(monkeypatch, capsys, qwen_path, tmp_path):
    """TARGET is a run with an agent section (the calculator): both models answer with whole
    episodes through the turn driver, as `rlft eval` of the run does (before: single-turn answers,
    here the call itself on both sides: a tie everywhere). Each scripted engine is called once per
    turn; the judge (the run's reward) compares the final answers, and the records keep both
    episodes."""
    import yaml
    from conftest import ScriptedEngine, call_text

    target, baseline = two_folders(qwen_path, tmp_path)
    (tmp_path / "exact.py").write_text("def exact(prompt, completion, answer, **row):\n"
                                       "    return float(completion.strip() == answer)\n")
    prompts = write_jsonl(tmp_path / "sums.jsonl", [{"prompt": f"What is {a} + {5 - a}?", "answer": "5"}
                                                    for a in (1, 2, 3)])
    run = tmp_path / "run"
    shutil.copytree(target, run / "final")
    (run / "config.yaml").write_text(yaml.safe_dump({
        "method": "grpo", "output_dir": str(run), "model": {"path": str(qwen_path), "device": "cpu"},
        "data": {"train": str(prompts)}, "rewards": [{"fn": f"{tmp_path}/exact.py:exact"}],
        "eval": {"max_new_tokens": 96, "batch_size": 8},  # room for a call (70 tokens of the tiny vocabulary)
        "agent": {"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 800}}))
    # turn 1 asks the calculator, turn 2 answers: the target from its result, the baseline wrongly
    scripts = {"final": [call_text("calculator", {"expression": "2 + 3"}), "5"],
               "baseline": [call_text("calculator", {"expression": "2 + 2"}), "4"]}
    engines: dict[str, ScriptedEngine] = {}

    class Scripted(ScriptedEngine):
        def close(self) -> None:
            pass

    def build_engine(policy, *args, **kwargs):
        name = Path(policy.model.name_or_path).name
        engines[name] = Scripted(policy.tokenizer, scripts[name])
        return engines[name]

    monkeypatch.setattr(eval_parts, "build_engine", build_engine)
    result = run_main(monkeypatch, capsys, "eval", str(run), "--data", str(prompts), "--compare", str(baseline))
    assert result.returncode == 0, result.stdout + result.stderr
    assert {name: len(e.contexts) for name, e in engines.items()} == {"final": 2, "baseline": 2}  # one call a turn
    saved = json.loads((run / "evals" / "compare-sums.json").read_text())
    assert saved["settings"]["agent"]["tools"] == ["calculator"]
    assert (saved["metrics"]["wins"], saved["metrics"]["ties"], saved["metrics"]["losses"]) == (3, 0, 0)
    for r in saved["records"]:
        assert (r["target"], r["baseline"], r["target_reward"], r["baseline_reward"]) == ("5", "4", 1.0, 0.0)
        assert r["target_turns"] == r["baseline_turns"] == 2 and r["target_tool_calls"] == r["baseline_tool_calls"] == 1
        for side, value in (("target", "5"), ("baseline", "4")):
            tool = [m for m in r[f"{side}_transcript"] if m["role"] == "tool"]
            assert tool == [{"role": "tool", "name": "calculator", "content": value}], r[f"{side}_transcript"]
            assert r[f"{side}_transcript"][-1] == {"role": "assistant", "content": value}
