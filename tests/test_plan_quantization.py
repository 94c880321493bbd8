"""The planner under model.quantization=4bit (QLoRA): NF4 storage per weight, which weights are
quantised, the fp32 upcast around them, and what `rlft plan` reads from a config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlft.plan.advice import advise
from rlft.plan.memory import NF4_BYTES_PER_PARAM, GiB, ModelShape, PlanInput, plan_memory

QWEN7B = Path(__file__).parent / "fixtures" / "qwen2.5-7b"
QLORA = dict(lora=True, quantization="4bit", param_dtype="fp32", precision="fp32")


@pytest.fixture(scope="module")
def qwen7b() -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(QWEN7B).to_dict()


def by_name(plan) -> dict[str, int]:
    return {c.name: c.bytes for c in plan.components}


def test_nf4_bytes_per_weight():
    # 4 bits + an 8-bit absmax per 64 weights (0.125 bit) + an fp32 absmax per 256 blocks
    # (32 / 16384 = 0.001953125 bit) = 4.126953125 bits = 0.515869140625 bytes
    assert NF4_BYTES_PER_PARAM == 0.515869140625


def test_qwen7b_4bit_base_weights(qwen7b):
    m = ModelShape.from_config(qwen7b)
    # per layer, the linears' weights only: q and o 3584*3584, k and v 3584*512, MLP 3 * 3584*18944
    assert m.quantized_params() == 28 * (2 * 12_845_056 + 2 * 1_835_008 + 203_685_888) == 6_525_288_448
    plan = plan_memory(qwen7b, PlanInput(method="sft", **QLORA))
    # NF4: 6,525,288,448 x 0.515869140625 = 3,366,194,944 B; the rest (embedding, lm_head, norms,
    # q/k/v biases) 7,615,616,512 - 6,525,288,448 = 1,090,328,064 weights in fp32 = 4,361,312,256 B
    assert by_name(plan)["weights (frozen base, 4-bit)"] == 3_366_194_944 + 4_361_312_256 == 7_727_507_200
    bf16 = by_name(plan_memory(qwen7b, PlanInput(method="sft", lora=True)))["weights (frozen base)"]
    assert bf16 == 2 * 7_615_616_512  # the same base in bf16: about twice the 4-bit one
    # the 4-bit matmul's transients: the largest linear (gate/up 3584 x 18944) and the widest input
    # (down_proj, 18944) in bf16 for 1 x 1024 tokens
    assert by_name(plan)["4-bit matmul temporaries"] == 2 * 3584 * 18944 + 2 * 1024 * 18944


def test_4bit_changes_only_what_it_should(qwen7b):
    online = dict(method="online", micro_batch_size=2, seq_len=1024, completion_len=512, group_size=4,
                  prompts_per_step=2, reference=True)
    fp32_lora = by_name(plan_memory(qwen7b, PlanInput(**online, lora=True, param_dtype="fp32", precision="fp32")))
    qlora = by_name(plan_memory(qwen7b, PlanInput(**online, **QLORA)))
    # same adapters, activations and KV cache; no reference copy (the base with adapters off) in either
    for name in ("LoRA weights", "LoRA AdamW states", "activations", "rollout KV cache"):
        assert qlora[name] == fp32_lora[name]
    assert "reference model" not in qlora
    # the hf engine cannot fuse packed 4-bit weights for its fast decode path
    assert "fast-decode fused weights" in fp32_lora and "fast-decode fused weights" not in qlora


def test_bad_4bit_settings_are_named():
    with pytest.raises(ValueError, match="set lora"):
        PlanInput(quantization="4bit", param_dtype="fp32", precision="fp32")
    with pytest.raises(ValueError, match="reward-model"):
        PlanInput(method="reward_model", **QLORA)
    with pytest.raises(ValueError, match="one GPU"):
        PlanInput(world_size=2, **QLORA)


def test_advice_offers_qlora_when_it_helps(qwen7b):
    s = PlanInput(method="sft", precision="bf16", param_dtype="bf16", micro_batch_size=1, seq_len=256,
                  completion_len=256)
    advice = {a.change: a.total for a in advise(qwen7b, s, 24 * GiB)}
    qlora = next(c for c in advice if "4-bit base" in c)
    assert advice[qlora] < advice["LoRA (r=16, all linear layers)"]  # smaller than a bf16 base at this length
    assert advice[qlora] == plan_memory(qwen7b, PlanInput(**{**s.__dict__, **QLORA})).total
    assert not any("4-bit" in a.change for a in advise(qwen7b, PlanInput(**QLORA), 24 * GiB))


def test_plan_input_from_a_4bit_config(tmp_path):
    from rlft.plan.inputs import plan_input_from_config, plan_report
    from rlft.config import load_config

    cfg = {"method": "sft", "output_dir": str(tmp_path / "run"),
           "model": {"path": str(QWEN7B), "dtype": "bf16", "quantization": "4bit"},
           "data": {"train": "rows.jsonl", "max_length": 512}, "lora": {"enabled": True}}
    config = load_config(cfg)
    setting = plan_input_from_config(config)
    # prepare_model_for_kbit_training upcasts the unquantised weights (so the hidden states) to fp32
    assert (setting.quantization, setting.param_dtype, setting.precision) == ("4bit", "fp32", "fp32")
    report = plan_report(config, "L4 24GB")
    assert "weights (frozen base, 4-bit)" in report and "4.127 bits" in report
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert load_config(path).model.quantization == "4bit"
