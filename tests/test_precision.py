"""training.precision: which dtypes a run keeps and computes in, resolved per device, and that a
mixed-precision run really computes in bf16 while its master weights and updates stay fp32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_config, write_jsonl
from rlft.api import train
from rlft.errors import ConfigError
from rlft.models import precision as precision_mod
from rlft.models.precision import Precision, resolve_precision
from rlft.rollout import rollout_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("bf16_cpu, expected", [(True, "bf16-mixed"), (False, "fp32")])
def test_auto_picks_bf16_mixed_only_where_the_cpu_computes_in_bf16(monkeypatch, bf16_cpu, expected):
    monkeypatch.setattr(precision_mod, "cpu_has_bf16", lambda: bf16_cpu)
    p = resolve_precision("auto", "auto", CPU)
    assert p.name == expected
    assert p.reason.startswith("auto:")
    assert p.weight_dtype == torch.float32


@pytest.mark.parametrize("value, expected", [("1", "bf16-mixed"), ("0", "fp32")])
def test_the_switch_makes_auto_resolve_as_the_other_kind_of_cpu(monkeypatch, value, expected):
    """RLFT_CPU_BF16 lets an AVX2 machine run the bf16 paths and an AMX one the fp32 paths, whatever
    /proc/cpuinfo says."""
    monkeypatch.setenv("RLFT_CPU_BF16", value)
    p = resolve_precision("auto", "auto", CPU)
    assert p.name == expected and "RLFT_CPU_BF16" in p.reason
    monkeypatch.setenv("RLFT_CPU_BF16", "yes")
    with pytest.raises(ConfigError, match="RLFT_CPU_BF16='yes'"):
        resolve_precision("auto", "auto", CPU)


def test_explicit_choices_and_pure_bf16():
    assert resolve_precision("bf16-mixed", "auto", CPU).compute_dtype == torch.bfloat16
    assert resolve_precision("fp32", "fp32", CPU).compute_dtype is None
    pure = resolve_precision("auto", "bf16", CPU)  # model.dtype=bf16 alone: pure bf16 training
    assert (pure.name, pure.weight_dtype, pure.compute_dtype) == ("bf16", torch.bfloat16, None)
    assert resolve_precision("bf16", "auto", CPU).weight_dtype == torch.bfloat16


@pytest.mark.parametrize("precision, dtype, fix", [
    ("fp16-mixed", "auto", "needs a CUDA GPU"),
    ("fp32", "bf16", "drop model.dtype"),
    ("bf16-mixed", "bf16", "drop model.dtype"),
    ("auto", "fp16", "fp16-mixed"),
])
def test_impossible_or_contradictory_choices_are_refused(precision, dtype, fix):
    with pytest.raises(ConfigError, match=fix):
        resolve_precision(precision, dtype, CPU)


def test_rollout_dtype_follows_the_compute_dtype():
    mixed, fp32, pure = Precision("bf16-mixed", ""), Precision("fp32", ""), Precision("bf16", "")
    assert rollout_dtype("auto", mixed, CPU) == torch.bfloat16
    assert rollout_dtype("auto", fp32, CPU) is None
    assert rollout_dtype("fp32", mixed, CPU) is None  # the fp32 weights, no autocast
    assert rollout_dtype("auto", pure, CPU) is None
    with pytest.raises(ConfigError, match="CUDA"):
        rollout_dtype("fp16", fp32, CPU)
    with pytest.raises(ConfigError, match="bf16 weights"):
        rollout_dtype("fp32", pure, CPU)


class _LinearDtypes:
    """Records the output dtype of every nn.Linear forward with gradients on (training forwards)."""

    def __init__(self, monkeypatch):
        self.seen: set[torch.dtype] = set()
        original = torch.nn.Linear.forward

        def forward(module, x):
            out = original(module, x)
            if torch.is_grad_enabled():
                self.seen.add(out.dtype)
            return out

        monkeypatch.setattr(torch.nn.Linear, "forward", forward)


def test_sft_in_bf16_mixed_computes_in_bf16_and_keeps_fp32_master_weights(tmp_path, qwen_path, sft_data,
                                                                          monkeypatch, capsys):
    dtypes = _LinearDtypes(monkeypatch)
    cfg = make_config(qwen_path, sft_data["train"], tmp_path / "run",
                      training={"precision": "bf16-mixed", "max_steps": 3, "learning_rate": 3e-3})
    train(cfg)
    assert dtypes.seen == {torch.bfloat16}
    assert "precision: bf16-mixed (training.precision=bf16-mixed)" in capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "bf16-mixed"
    before, after = load_file(str(qwen_path / "model.safetensors")), load_file(str(tmp_path / "run" / "final" /
                                                                                  "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in after.values())
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed
    # fp32 master weights keep updates far below bf16's resolution (8 bits of mantissa): a bf16
    # copy of the trained weights would lose them
    k = changed[0]
    assert not torch.equal(after[k], after[k].bfloat16().float())
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert len(losses) == 3 and all(map(lambda v: v == v, losses))


def test_grpo_in_bf16_mixed_samples_and_trains_in_bf16(tmp_path, qwen_path, monkeypatch):
    """The sampling forward itself (no gradients, inside the rollout engine) computes in bf16, as
    do the training forwards, and the sampling and trainer log-probs agree to what bf16 rounding
    allows. (Before: dtypes were recorded only where gradients were on, and any gap below 1.0
    nats passed.)

    The bound: bf16 keeps 8 significant bits, so one rounding moves a value by at most
    u = 2^-8 ~ 0.0039 of itself. A log-prob z_y - logsumexp(z) moves by at most 2 max_j |dz_j|.
    The two forwards (KV-cached decoding vs one full pass) round differently along the way; we
    allow each logit one rounding per layer of the path, on each side: |dz| <= 2 (L + 1) u max|z|
    (L = 4 layers, +1 for the head), so |d logp| <= 4 (L + 1) u max|z| (~0.1 for this model, whose
    logits stay below ~1.3; measured: ~0.004)."""
    from transformers import AutoConfig

    from rlft.rollout.hf import HFEngine

    model_config = AutoConfig.from_pretrained(qwen_path)
    dtypes = _LinearDtypes(monkeypatch)
    sampling_dtypes: set[tuple[torch.dtype, bool]] = set()
    max_logit = [0.0]
    generate, linear = HFEngine.generate, torch.nn.Linear.forward  # (the latter patched by _LinearDtypes)

    def sampling_linear(module, x):
        out = linear(module, x)
        sampling_dtypes.add((out.dtype, torch.is_grad_enabled()))
        if out.shape[-1] == model_config.vocab_size:  # the head: logits
            max_logit[0] = max(max_logit[0], float(out.abs().max()))
        return out

    def recording_generate(self, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(torch.nn.Linear, "forward", sampling_linear)
            return generate(self, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", recording_generate)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Count to {i}."} for i in range(8)])
    (tmp_path / "rewards.py").write_text(
        "def digits(prompt, completion, **row):\n"
        "    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n")
    cfg = {"method": "grpo", "output_dir": str(tmp_path / "run"), "seed": 0,
           "model": {"path": str(qwen_path), "device": "cpu"}, "data": {"train": str(prompts)},
           "training": {"precision": "bf16-mixed", "learning_rate": 1e-2, "max_steps": 2, "num_threads": 1},
           "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
           "rewards": [{"fn": f"{tmp_path / 'rewards.py'}:digits"}], "logging": {"progress": False}}
    train(cfg)
    assert dtypes.seen == {torch.bfloat16}  # training forwards
    assert sampling_dtypes == {(torch.bfloat16, False)}  # the sampling forward, under no_grad
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    u, layers = 2.0 ** -8, model_config.num_hidden_layers  # 4
    assert 0.0 < max_logit[0] < 10.0
    bound = 4 * (layers + 1) * u * max_logit[0]
    assert all(0 < r["rollout/logprob_diff_max"] <= bound for r in steps), (bound, steps)
    after = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in after.values())