"""The registered `code` reward through the scorer, and the `rlft sandbox run` command."""

import json

import pytest
import typer
from typer.testing import CliRunner

from rlft.cli.sandbox import app as sandbox_app
from rlft.config import RewardSpec
from rlft.rewards import RewardScorer
from rlft.rewards.scoring import BUILTIN_REWARDS
from rlft.rewards.code import judge_completion

TESTS = {"fn_name": "square", "cases": [{"input": [2], "output": 4}, {"input": [3], "output": 9}]}
RIGHT = "Here you go:\n```python\ndef square(x):\n    return x * x\n```\n"
HALF = "```python\ndef square(x):\n    return 4\n```"


def test_scorer_logs_each_part_and_keeps_unverifiable_rows_out():
    scorer = RewardScorer([RewardSpec(fn="code", args={"timeout": 10})], max_workers=4)
    completions = [RIGHT, HALF, "def square(x): return x * x  # no fence", RIGHT]
    rows = [{"tests": TESTS}, {"tests": json.dumps(TESTS)}, {"tests": TESTS}, {"tests": {"cases": "broken"}}]
    scores = scorer.score(["q"] * 4, completions, rows)
    # right: 0.2 + 0.4 + 0.4 ; half: 0.2 + 0.4 + 0.4 × 1/2 ; no fence: 0 ; malformed tests: None
    assert scores.total == pytest.approx([1.0, 0.8, 0.0, None])
    assert scores.components["code/tests"] == pytest.approx([0.4, 0.2, 0.0, None])
    assert scores.components["code/parse"][:3] == pytest.approx([0.2, 0.2, 0.0])
    assert scores.metrics()["reward/unverifiable_frac"] == 0.25


def test_weights_are_factory_args():
    fn = BUILTIN_REWARDS["code"](parse=0.0, run=0.0, tests=1.0)
    assert fn("q", HALF, tests=TESTS) == pytest.approx({"parse": 0.0, "run": 0.0, "tests": 0.5})
    assert fn("q", "no code", tests=TESTS) == {"parse": 0.0, "run": 0.0, "tests": 0.0}
    assert fn("q", HALF) is None  # no tests in the row: unverifiable
    with pytest.raises(ValueError, match="not supported"):
        BUILTIN_REWARDS["code"](language="rust")


def test_no_code_verdict():
    v = judge_completion("I would write a function.", TESTS)
    assert (v.status, v.score, v.total) == ("no_code", 0.0, 2)
    unfenced = judge_completion("def square(x):\n    return x * x\n", TESTS, allow_unfenced=True)
    assert unfenced.status == "ok"


@pytest.fixture
def cli():
    main = typer.Typer()
    main.add_typer(sandbox_app, name="sandbox")  # mounted as the main CLI does

    def invoke(*args):
        return CliRunner().invoke(main, ["sandbox", "run", *args])

    return invoke


def test_cli_prints_a_table_or_json(tmp_path, cli):
    code, tests = tmp_path / "sol.py", tmp_path / "tests.json"
    code.write_text("def square(x):\n    return x * x if x < 3 else 0\n")
    tests.write_text(json.dumps(TESTS))
    table = cli("--code", str(code), "--tests", str(tests))
    assert table.exit_code == 0, table.output
    assert "wrong_answer" in table.output and "passed: 1/2" in table.output and "isolation:" in table.output
    out = cli("--code", str(code), "--tests", str(tests), "--json", "--timeout", "5")
    verdict = json.loads(out.output)
    assert (verdict["status"], verdict["passed"], verdict["total"]) == ("wrong_answer", 1, 2)
    assert [c["passed"] for c in verdict["cases"]] == [True, False]
    assert verdict["layers"]["working"] is True
    completion = tmp_path / "completion.txt"
    completion.write_text(RIGHT)
    extracted = cli("--code", str(completion), "--tests", str(tests), "--extract", "--json")
    assert json.loads(extracted.output)["status"] == "ok"


def test_cli_bad_files_give_one_line_and_exit_2(tmp_path, cli):
    code, tests = tmp_path / "sol.py", tmp_path / "tests.json"
    code.write_text("print(1)\n")
    tests.write_text("{not json")
    for args, words in [(["--code", str(tmp_path / "nope.py"), "--tests", str(tests)], "code file not found"),
                        (["--code", str(code), "--tests", str(tests)], "not valid JSON"),
                        (["--code", str(code), "--tests", str(tmp_path)], "is a folder, not a JSON tests file")]:
        result = cli(*args)
        assert result.exit_code == 2
        assert words in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1
