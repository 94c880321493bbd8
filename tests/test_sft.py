"""SFT: gradient accumulation invariance, learning on a tiny model, the run directory, data
validation errors."""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml

from conftest import arithmetic_rows, big_and_micro_batches, make_config, take_grads, write_jsonl
from rlft import api
from rlft.config import DataConfig, EvalConfig, ModelConfig, load_config
from rlft.data.readers import Row
from rlft.data.sft_examples import make_sft_encoder
from rlft.errors import DataError
from rlft.models.loading import load_policy, load_tokenizer
from rlft.models.template import end_of_turn_ids
from rlft.training.offline.loop import run_offline
from rlft.training.offline.sft import SftObjective


def varied_rows(n: int, seed: int) -> list[dict]:
    """Arithmetic chat rows whose prompts and answers differ in length, so batches carry padding."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 9)
        extra = " Please show only the result." * (i % 3)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?{extra}"},
                                  {"role": "assistant", "content": f"The answer is {a + b}." + " Done." * (i % 2)}]})
    return rows


# -- gradient accumulation --------------------------------------------------------------------

def test_micro_batches_give_the_big_batch_gradient(qwen_path):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    encode = make_sft_encoder(tok, end_of_turn_ids(tok), max_length=128)
    examples = [encode(Row(f"rows.jsonl:{i + 1}", r)) for i, r in enumerate(varied_rows(8, seed=3))]
    lengths = [len(e.input_ids) for e in examples]
    assert len(set(lengths)) >= 4  # micro-batches of 2 are padded differently from the batch of 8
    assert len({max(lengths[i:i + 2]) for i in range(0, 8, 2)}) >= 2

    model = AutoModelForCausalLM.from_pretrained(qwen_path).double().train()
    objective = SftObjective(DataConfig(train="unused.jsonl"), EvalConfig(), [])
    objective.pad_id = tok.pad_token_id
    norm = objective.normaliser(examples)
    # the normaliser is every target token of the step (position 0 is never one with ChatML)
    assert norm == sum(sum(e.target_mask) for e in examples)

    run = big_and_micro_batches(objective, model, examples, norm)
    big, micro = run.grads_big, run.grads_micro

    assert run.loss_micro == pytest.approx(run.loss_big, rel=1e-6)
    assert big.keys() == micro.keys() and len(big) > 0
    scale = max(float(g.abs().max()) for g in big.values())
    for name in big:
        torch.testing.assert_close(micro[name], big[name], rtol=1e-5, atol=1e-9 * scale, msg=name)

    # Control: normalising each micro-batch by its own token count (the classic mistake) gives a
    # different gradient, so the comparison above can fail.
    for i in range(0, 8, 2):
        chunk = examples[i:i + 2]
        loss, _ = objective.loss(model, chunk, objective.normaliser(chunk) * 4)
        loss.backward()
    wrong = take_grads(model)
    rel = max(float((wrong[n] - big[n]).norm() / big[n].norm()) for n in big if big[n].norm() > 0)
    assert rel > 1e-2


def _accumulation_run(qwen_path, train, out, micro):
    config = load_config(make_config(qwen_path, train, out, training={
        "batch_size": 8, "micro_batch_size": micro, "learning_rate": 1e-3, "epochs": 1,
        "precision": "fp32"}))  # compares float64 weights to 1e-5: no autocast
    policy = load_policy(config.model, config.lora)
    policy.model.double()
    initial = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    summary = run_offline(config, policy=policy)
    return summary, initial, dict(policy.model.named_parameters())


def test_accumulated_run_equals_unbatched_run(tmp_path, qwen_path):
    train = write_jsonl(tmp_path / "train.jsonl", varied_rows(24, seed=4))
    s_big, initial, big = _accumulation_run(qwen_path, train, tmp_path / "big", micro=None)
    s_micro, _, micro = _accumulation_run(qwen_path, train, tmp_path / "micro", micro=2)
    assert s_big["step"] == s_micro["step"] == 3  # 24 rows / 8 per step
    moved = max(float((big[n] - initial[n]).abs().max()) for n in big)
    assert moved > 1e-3  # three AdamW steps at lr 1e-3 move weights by about 3e-3
    for name in big:
        torch.testing.assert_close(micro[name].detach(), big[name].detach(), rtol=1e-5, atol=1e-7, msg=name)
    assert s_micro["train/loss"] == pytest.approx(s_big["train/loss"], rel=1e-6)


# -- learning ---------------------------------------------------------------------------------

def test_sft_lowers_eval_loss_and_learns_the_format(sft_run):
    before, after = sft_run.baseline, sft_run.summary
    # random init over a 512-token vocabulary: loss near ln(512) = 6.24
    assert before["eval/loss"] > 5.0
    assert before["eval/format_compliance"] <= 0.1
    assert after["eval/loss"] < 0.5 * before["eval/loss"]
    assert after["eval/format_compliance"] >= 0.9
    assert after["eval/num_prompts"] == 32
    assert after["eval/truncation_rate"] <= 0.1


# -- run directory ------------------------------------------------------------------------------

def test_run_directory_layout(sft_run):
    root, config = sft_run.root, sft_run.config
    # config.yaml: the resolved config, reloadable to an equal Config
    assert load_config(root / "config.yaml") == config
    assert yaml.safe_load((root / "config.yaml").read_text())["training"]["learning_rate"] == 3e-3

    records = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 41))
    for r in train:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    # 10% warmup of 40 steps = 4 steps: lr 3e-3 * 1/4 at step 1, the peak at step 5, then cosine
    # down to 3e-3 * 0.5 * (1 + cos(pi * 35/36)) = 5.7e-6 at step 40
    assert train[0]["lr"] == pytest.approx(7.5e-4, rel=1e-9)
    assert train[3]["lr"] == pytest.approx(3e-3, rel=1e-9)
    assert train[4]["lr"] == pytest.approx(3e-3, rel=1e-9)
    assert train[39]["lr"] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 35 / 36)), rel=1e-9)
    # the train loss fell
    assert train[-1]["loss"] < 0.3 * train[0]["loss"]
    # evaluations: at step 20 (eval_every) and at the end
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [20, 40]

    summary = json.loads((root / "summary.json").read_text())
    assert summary == sft_run.summary  # what api.train returns is what the file says
    assert summary["status"] == "completed" and summary["step"] == 40
    assert summary["train/loss"] == train[-1]["loss"]
    assert summary["train/grad_norm"] == train[-1]["grad_norm"]
    assert summary["eval/loss"] == evals[-1]["eval/loss"]
    assert "eval/format_compliance" in summary
    assert Path(summary["final_model"]) == root / "final"

    checkpoints = root / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step-00000020", "step-00000040"]
    assert (checkpoints / "latest").read_text().strip() == "step-00000040"
    for step in (20, 40):
        ckpt = checkpoints / f"step-{step:08d}"
        assert (ckpt / "COMPLETE").is_file()
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["step"] == step
        assert {"model/model.safetensors", "model/config.json", "trainer_state.pt", "rlft_template.json"} \
            <= set(manifest["files"])
        for rel, digest in manifest["files"].items():
            assert hashlib.sha256((ckpt / rel).read_bytes()).hexdigest() == digest, rel

    final = root / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "rlft_template.json"):
        assert (final / name).is_file(), name


def test_metrics_have_one_record_per_step(sft_run):
    records = [json.loads(line) for line in (sft_run.root / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps))


# -- data errors ------------------------------------------------------------------------------

def _bad_data(tmp_path) -> tuple[Path, int]:
    good = arithmetic_rows(12, seed=5)
    long_row = {"messages": [{"role": "user", "content": "Add these: " + " + ".join(["12345"] * 40)},
                             {"role": "assistant", "content": "The answer is 1."}]}
    lines = [good[0], good[1],
             '{"messages": [{"role": "user", "content": "hi"}',   # line 3: truncated JSON
             good[2],
             {"question": "What is 1 + 1?", "answer": "2"},       # line 5: neither messages nor prompt
             good[3],
             {"prompt": "What is 2 + 2?", "completion": ""},      # line 7: empty completion
             good[4],
             long_row,                                            # line 9: longer than max_length
             *good[5:]]
    return write_jsonl(tmp_path / "train.jsonl", lines), len(good)


def test_invalid_rows_are_reported_in_one_error(tmp_path, qwen_path):
    train, _ = _bad_data(tmp_path)
    config = make_config(qwen_path, train, tmp_path / "run", data={"max_length": 64})
    with pytest.raises(DataError) as info:
        api.train(config)
    message = str(info.value)
    assert f"{train}: 4 of 16 SFT rows are invalid" in message
    assert f"{train}:3" in message and "bad JSON" in message
    assert f"{train}:5" in message and "missing field 'messages' or 'prompt'/'completion'" in message
    assert f"{train}:7" in message and "empty 'completion'" in message
    assert f"{train}:9" in message and "longer than data.max_length (64 tokens)" in message
    assert "data.on_invalid=drop" in message  # the fix
    for line in (1, 2, 4, 6, 8):
        assert f"{train}:{line}\n" not in message and not message.rstrip().endswith(f"{train}:{line}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before training


def test_on_invalid_drop_trains_on_the_valid_rows(tmp_path, qwen_path):
    train, n_good = _bad_data(tmp_path)
    config = make_config(qwen_path, train, tmp_path / "run", data={"max_length": 64, "on_invalid": "drop"},
                         checkpoint={"every": 1, "keep_last": 2})
    summary = api.train(config)
    assert summary["status"] == "completed"
    # 12 valid rows / batch 4 = 3 steps (16 rows would have made 4)
    assert n_good == 12 and summary["step"] == 3
    checkpoints = tmp_path / "run" / "checkpoints"
    # checkpoints every step, keep_last 2: step 1 was pruned
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000003"]


def test_fixing_the_data_after_a_failed_start_can_reuse_the_output_dir(tmp_path, qwen_path):
    # The DataError says "set data.on_invalid=drop"; doing so with the same output_dir must work.
    # Nothing was trained (no checkpoint), so the earlier attempt's config.yaml is no run to protect.
    train, _ = _bad_data(tmp_path)
    config = make_config(qwen_path, train, tmp_path / "run", data={"max_length": 64})
    with pytest.raises(DataError):
        api.train(config)
    summary = api.train(config, ["data.on_invalid=drop"])
    assert summary["status"] == "completed" and summary["step"] == 3
    assert load_config(tmp_path / "run" / "config.yaml").data.on_invalid == "drop"


def test_jsonl_lines_are_split_on_newline_only(tmp_path):
    # json.dumps(..., ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw inside strings;
    # str.splitlines() would cut the row there and shift every later line number.
    from rlft.data.readers import read_rows

    content = "para\u2028graph\u2029next\x85line"
    rows = [{"prompt": content, "completion": "ok"}, {"prompt": "second", "completion": "ok"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    read = read_rows(str(path))
    assert [(r.where, r.error) for r in read] == [(f"{path}:1", None), (f"{path}:2", None)]
    assert read[0].data["prompt"] == content


def test_require_field_types():
    from rlft.data.validate import RowError, require_field

    # bool is an int subclass: True is refused where a number is expected...
    with pytest.raises(RowError, match="wrong type for 'n'"):
        require_field({"n": True}, "n", int, "a row")
    assert require_field({"n": 3}, "n", (int, float), "a row") == 3
    # ...but a field that may hold anything (what reward functions read) accepts a boolean
    assert require_field({"flag": False}, "flag", object, "the reward functions") is False
    with pytest.raises(RowError, match="missing field 'flag'"):
        require_field({}, "flag", object, "the reward functions")


def test_an_empty_dataset_is_an_error(tmp_path, qwen_path):
    train = tmp_path / "empty.jsonl"
    train.write_text("\n\n")
    with pytest.raises(DataError, match="no rows found"):
        api.train(make_config(qwen_path, train, tmp_path / "run"))


def test_eval_rows_need_the_fields_the_eval_rewards_read(tmp_path, qwen_path, sft_data):
    # SFT eval accuracy is scored by the rewards: a held-out row without `answer` is a data error
    rows = arithmetic_rows(4, seed=7)
    del rows[2]["answer"]
    heldout = write_jsonl(tmp_path / "heldout.jsonl", rows)
    config = make_config(qwen_path, sft_data["train"], tmp_path / "run", data={"eval": str(heldout)},
                         rewards=[{"fn": "math"}])
    with pytest.raises(DataError) as info:
        api.train(config)
    message = str(info.value)
    assert f"{heldout}: 1 of 4 SFT eval rows are invalid" in message
    assert f"{heldout}:3" in message and "missing field 'answer'" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
