"""Inter-annotator agreement: percent agreement and Krippendorff's alpha computed by hand."""

from __future__ import annotations

import math

import pytest

from rlft.data.agreement import agreement, krippendorff_alpha_nominal, percent_agreement, read_labels
from rlft.data.readers import Row
from rlft.errors import DataError

UNITS = [
    ["chosen", "chosen", "chosen"],
    ["chosen", "chosen", "rejected"],
    ["rejected", "rejected"],
    ["chosen", "tie"],
    ["chosen"],  # one label: no pairs, left out of both agreement measures
]


def test_percent_agreement_by_hand():
    # agreeing pairs / all pairs per unit: 3/3, 1/3, 1/1, 0/1 -> mean (1 + 1/3 + 1 + 0) / 4
    assert percent_agreement(UNITS) == pytest.approx((1 + 1 / 3 + 1 + 0) / 4)


def test_krippendorff_alpha_by_hand():
    # Coincidences o_ck, each unit's ordered pairs weighted 1 / (m - 1):
    #   unit 1 (m=3): 3 chosen -> o_cc += 3*2/2 = 3
    #   unit 2 (m=3): 2 chosen, 1 rejected -> o_cc += 2*1/2 = 1, o_cr = o_rc += 2*1/2 = 1
    #   unit 3 (m=2): 2 rejected -> o_rr += 2
    #   unit 4 (m=2): chosen, tie -> o_ct = o_tc += 1
    # n_c = 3 + 1 + 1 + 1 = 6, n_r = 1 + 2 = 3, n_t = 1; n = 10
    # observed disagreement sum_{c!=k} o_ck = 2 (c,r / r,c) + 2 (c,t / t,c) = 4
    # expected sum_{c!=k} n_c n_k = 2 * (6*3 + 6*1 + 3*1) = 54
    # alpha = 1 - (n - 1) * 4 / 54 = 1 - 36/54 = 1/3
    assert krippendorff_alpha_nominal(UNITS) == pytest.approx(1 / 3)


def test_alpha_limits():
    assert krippendorff_alpha_nominal([["chosen", "chosen"], ["rejected", "rejected"]]) == 1.0
    # systematic disagreement: every unit split -> alpha below 0
    assert krippendorff_alpha_nominal([["chosen", "rejected"], ["rejected", "chosen"]]) < 0
    assert math.isnan(krippendorff_alpha_nominal([["chosen", "chosen"]]))  # one value: undefined


def test_agreement_summary_and_labels_format():
    rows = [Row(f"pairs.jsonl:{i + 1}", {"prompt": "p", "chosen": "a", "rejected": "b", "labels": labels})
            for i, labels in enumerate(UNITS)]
    rows[0].data["labels"] = ["Chosen", " chosen", "CHOSEN"]  # case and spaces are ignored
    result = agreement(read_labels(rows))
    assert (result.rows, result.rated_rows) == (5, 4)
    assert result.alpha == pytest.approx(1 / 3)
    # majority is "chosen" in units 1, 2 and 5; unit 4 is a 1-1 tie, unit 3 prefers rejected
    assert result.majority_support == pytest.approx(3 / 5)
    assert result.metrics()["agreement/krippendorff_alpha"] == pytest.approx(1 / 3)
    with pytest.raises(DataError, match="pairs.jsonl:1: labels \\['maybe'\\]"):
        read_labels([Row("pairs.jsonl:1", {"labels": ["chosen", "maybe"]})])
    with pytest.raises(DataError, match="no 'labels' list"):
        read_labels([Row("pairs.jsonl:2", {"prompt": "p"})])


def test_rlft_data_agreement_command(tmp_path):
    import json

    import typer
    from typer.testing import CliRunner

    from rlft.cli.data import register

    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b", "labels": u}) + "\n"
                            for u in UNITS))
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["data", "agreement", str(path)])
    assert result.exit_code == 0, result.output
    assert "agreement/krippendorff_alpha: 0.3333" in result.output
