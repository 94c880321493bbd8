"""The memory planner's arithmetic on Qwen2.5-7B (config.json written by hand) and a tiny config,
its verdict and advice, and `rlft plan` on a config file."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from rlft.plan.advice import Verdict, advise
from rlft.plan.memory import GiB, ModelShape, PlanInput, device_capacity, layer_activation_bytes, plan_memory

QWEN7B = Path(__file__).parent / "fixtures" / "qwen2.5-7b"


@pytest.fixture(scope="module")
def qwen7b() -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(QWEN7B).to_dict()  # what `rlft plan` reads: config.json only


def by_name(plan) -> dict[str, int]:
    return {c.name: c.bytes for c in plan.components}


def test_qwen7b_parameter_counts(qwen7b):
    m = ModelShape.from_config(qwen7b)
    # per layer: q 3584*3584 + 3584 bias, k and v 3584*512 + 512 each, o 3584*3584,
    # MLP 3 * 3584*18944, two norms 2*3584
    layer = 12_845_056 + 3_584 + 2 * (1_835_008 + 512) + 12_845_056 + 203_685_888 + 7_168
    assert m.layer_params() == layer == 233_057_792
    # untied: embedding and lm_head 152064*3584 each, plus the final norm
    assert m.params() == 28 * layer + 2 * 544_997_376 + 3_584 == 7_615_616_512
    # LoRA r=16 on all 7 linears: 16 * (in + out) summed per layer = 1,441,792
    per_layer = 16 * (2 * 7168 + 2 * 4096 + 3 * 22528)
    assert per_layer == 1_441_792
    assert m.lora_params(16, "all-linear") == 28 * per_layer == 40_370_176
    assert m.lora_params(16, ("q_proj", "v_proj")) == 28 * 16 * (7168 + 4096)


def test_qwen7b_static_memory_matches_the_reference_figures(qwen7b):
    p = 7_615_616_512
    full = plan_memory(qwen7b, PlanInput(method="sft", precision="fp32", param_dtype="fp32"))
    parts = by_name(full)
    # weights 4 B + gradients 4 B + AdamW 2 x 4 B = 16 B per parameter: "~112 GB" for a 7B model
    assert parts["weights"] + parts["gradients"] + parts["AdamW states"] == 16 * p
    mixed = by_name(plan_memory(qwen7b, PlanInput(method="sft", precision="bf16-mixed", param_dtype="bf16")))
    assert mixed["weights (fp32 master)"] + mixed["gradients"] + mixed["AdamW states"] == 16 * p
    # autocast casts the decoder linears (weights + q/k/v biases, not the norms or the embedding; the
    # head's cast is the output head's): 28 x (233,057,792 - 2 x 3584) = 6,525,417,472 x 2 B
    assert mixed["weights (bf16/fp16 working copy)"] == 2 * 6_525_417_472
    lora = by_name(plan_memory(qwen7b, PlanInput(method="sft", lora=True)))
    static = lora["weights (frozen base)"] + lora["LoRA weights"] + lora["LoRA gradients"] + lora["LoRA AdamW states"]
    # bf16 base 2 B x 7.62B + fp32 adapters 16 B x 40.4M = 15.88e9 B: "~16 GB"
    assert static == 2 * p + 16 * 40_370_176 == 15_877_155_840


def test_kv_cache_and_phases(qwen7b):
    s = PlanInput(method="online", micro_batch_size=4, batch_size=32, seq_len=1536, completion_len=1024,
                  group_size=8, prompts_per_step=4, reference=True)
    plan = plan_memory(qwen7b, s)
    # 2 (K and V) x 28 layers x 4 kv heads x 128 head dim x 1536 tokens x 32 sequences x 2 B
    assert by_name(plan)["rollout KV cache"] == 2 * 28 * 4 * 128 * 1536 * 32 * 2 == 2_818_572_288
    phases = plan.phases
    assert set(phases) == {"update", "rollout", "optimizer"}
    assert plan.total == max(phases.values())
    # the peak is a max over phases, never the sum of everything
    assert plan.total < sum(c.bytes for c in plan.components)
    half = plan_memory(qwen7b, PlanInput(**{**s.__dict__, "rollout_batch_size": 16}))
    assert by_name(half)["rollout KV cache"] == by_name(plan)["rollout KV cache"] // 2


def test_async_rollouts_hold_the_sampler_while_training(qwen7b):
    """rollout.async_steps samples while the trainer updates: the update phase also holds the KV
    cache and the sampler's working set, plus the sampler's own copy of the policy (bf16 here:
    2 B x 7.62B); on CPU also k + 1 published versions of the weights."""
    s = PlanInput(method="online", micro_batch_size=4, batch_size=32, seq_len=1536, completion_len=1024,
                  group_size=8, prompts_per_step=4, reference=True)
    sync, k2 = plan_memory(qwen7b, s), plan_memory(qwen7b, PlanInput(**{**s.__dict__, "async_steps": 2}))
    copy = by_name(k2)["sampler's copy of the policy"]
    assert copy == 2 * 7_615_616_512
    sampling = sum(c.bytes for c in sync.components if c.phases == ("rollout",))
    assert k2.phases["update"] == sync.phases["update"] + copy + sampling
    assert "rollout" not in k2.phases and "host memory" in " ".join(k2.assumptions)  # GPU: versions in host memory
    cpu = plan_memory(qwen7b, PlanInput(**{**s.__dict__, "async_steps": 2, "device_type": "cpu"}))
    assert by_name(cpu)["3 published weight versions"] == 3 * 2 * 7_615_616_512
    # two ranks: the whole weights each rank gathers for sampling are held throughout, not only
    # while sampling (published from after every step while the sampler samples)
    ranks = {c.name: c.phases for c in plan_memory(qwen7b, PlanInput(**{**s.__dict__, "world_size": 2})).components}
    ranks_k2 = {c.name: c.phases for c in plan_memory(qwen7b, PlanInput(**{**s.__dict__, "async_steps": 2,
                                                                            "world_size": 2})).components}
    assert ranks["gathered weights for sampling"] == ("rollout",)
    assert ranks_k2["gathered weights for sampling"] == ("static",)
    # rollout.sampler_device on another GPU: the trainer's device holds none of the sampler's parts
    # (the plan names them, with sizes, for the other device); the published versions stay in host memory
    apart = plan_memory(qwen7b, PlanInput(**{**s.__dict__, "async_steps": 2, "sampler_elsewhere": True}))
    assert apart.phases == {phase: size for phase, size in sync.phases.items() if phase != "rollout"}
    assert apart.total == sync.phases["update"] < k2.total and "sampler's copy of the policy" not in by_name(apart)
    held = next(a for a in apart.assumptions if a.startswith("rollout.sampler_device holds"))
    assert "sampler's copy of the policy (14.19 GiB)" in held and "rollout KV cache" in held
    assert "host memory" in " ".join(apart.assumptions)


def test_the_plan_reads_the_sampler_device_from_the_config(tmp_path):
    from rlft.plan.inputs import plan_input_from_config
    from rlft.config import load_config

    def elsewhere(model_device, sampler_device):
        return plan_input_from_config(load_config({
            "method": "grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(QWEN7B), "device": model_device},
            "data": {"train": "prompts.jsonl"}, "rewards": [{"fn": "math"}],
            "rollout": {"async_steps": 1, "sampler_device": sampler_device},
            "algorithm": {"rollout_correction": "tis"}})).sampler_elsewhere

    assert elsewhere("cuda:0", "cuda:1") and elsewhere("cpu", "cuda:0")
    assert not elsewhere("cuda:1", "cuda:1") and not elsewhere("cuda:0", "auto") and not elsewhere("cpu", "cpu")


def test_layer_activations_hand_computed():
    tiny = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=512, model_type="qwen2")
    m = ModelShape.from_config(tiny)
    s = PlanInput(method="sft", precision="fp32", param_dtype="fp32", device_type="cpu")
    # fp32, sdpa, T = 64, per token: 2 norms x (4H input + 4 rsqrt + 4H normalised) = 2 x 1028
    # + q, k, v, out 4 x 4H = 2048 + lse 4 x 4 heads = 16 + mask 4T = 256
    # + gate, silu, up 3 x 4I = 4608 + linear inputs 4H + 4H + 4I = 2560  -> 11544 B
    # (the same figure LiveTensorTracker measures for one transformers Qwen2 layer on CPU)
    assert layer_activation_bytes(m, s, 64) == 2 * 1028 + 2048 + 16 + 256 + 4608 + 2560 == 11544
    eager = PlanInput(method="sft", precision="fp32", param_dtype="fp32", attention="eager")
    # eager: q, k, v 3 x 4H + [heads, T] fp32 softmax 4 x 4 x 64 + o_proj's contiguous input 4H
    assert layer_activation_bytes(m, eager, 64) == 2 * 1028 + 1536 + 1024 + 4608 + 2560 + 512 == 12296


def test_changes_move_the_plan_the_right_way(qwen7b):
    base = PlanInput(method="sft", micro_batch_size=4, batch_size=16, seq_len=2048, completion_len=1024)
    total = plan_memory(qwen7b, base).total
    for change in (dict(lora=True), dict(gradient_checkpointing=True), dict(micro_batch_size=2),
                   dict(world_size=2), dict(seq_len=1024, completion_len=512)):
        assert plan_memory(qwen7b, PlanInput(**{**base.__dict__, **change})).total < total, change
    sharded = by_name(plan_memory(qwen7b, PlanInput(**{**base.__dict__, "world_size": 4})))
    assert sharded["AdamW states"] == by_name(plan_memory(qwen7b, base))["AdamW states"] // 4
    # a reference model is free under LoRA (adapters disabled), a full copy otherwise
    assert "reference model" in by_name(plan_memory(qwen7b, PlanInput(method="dpo", reference=True)))
    assert "reference model" not in by_name(plan_memory(qwen7b, PlanInput(method="dpo", reference=True, lora=True)))


def test_verdict_and_advice(qwen7b):
    label, capacity = device_capacity("h100 80gb")
    assert label == "H100 80GB" and capacity == 81559 * 2**20
    s = PlanInput(method="sft", micro_batch_size=4, batch_size=16, seq_len=2048, completion_len=1024)
    plan = plan_memory(qwen7b, s)
    verdict = Verdict(label, capacity, plan.total)
    assert not verdict.fits and "does NOT fit" in verdict.text()
    advice = advise(qwen7b, s, capacity)
    totals = [a.total for a in advice]
    assert totals == sorted(totals) and all(t < plan.total for t in totals)
    assert {"gradient checkpointing", "LoRA (r=16, all linear layers)"} <= {a.change for a in advice}
    assert not any(a.fits for a in advice)  # a 7B full fine-tune needs more than one change on 80 GB
    lora = PlanInput(**{**s.__dict__, "lora": True})
    assert not Verdict(label, capacity, plan_memory(qwen7b, lora).total).fits
    assert any(a.fits and a.change == "gradient checkpointing" for a in advise(qwen7b, lora, capacity))
    assert Verdict("x", 200 * GiB, plan.total).fits
    assert device_capacity(None, 24)[1] == 24 * GiB
    with pytest.raises(ValueError, match="unknown device"):
        device_capacity("TPU v9")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="param_dtype"):
        PlanInput(precision="fp32", param_dtype="bf16")
    with pytest.raises(ValueError, match="completion_len"):
        PlanInput(seq_len=10, completion_len=20)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_config({"model_type": "gpt2", "n_embd": 768})
    with pytest.raises(ValueError, match="unknown LoRA target"):
        ModelShape.from_config(dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                    num_attention_heads=2, vocab_size=10)).lora_params(4, ("c_attn",))


def test_rlft_plan_command(tmp_path):
    from rlft.cli.plan import register
    from rlft.plan.inputs import plan_input_from_config
    from rlft.config import load_config

    cfg = {"method": "grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(QWEN7B), "dtype": "bf16"},
           "data": {"train": "prompts.jsonl", "max_prompt_length": 512},
           "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 1024},
           "algorithm": {"micro_batch_size": 4}, "rewards": [{"fn": "math"}], "lora": {"enabled": True}}
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    setting = plan_input_from_config(load_config(path))
    assert (setting.method, setting.seq_len, setting.completion_len, setting.micro_batch_size,
            setting.batch_size, setting.reference, setting.lora) == ("online", 1536, 1024, 4, 32, True, True)
    app = typer.Typer()
    app.command("noop")(lambda: None)  # a second command keeps `plan` a subcommand
    register(app)
    result = CliRunner().invoke(app, ["plan", str(path), "--device", "L4 24GB"])
    assert result.exit_code == 0, result.output
    assert "rollout KV cache" in result.output and "L4 24GB" in result.output
    assert "does NOT fit on L4 24GB" in result.output and "gradient checkpointing" in result.output


def test_plan_lengths_come_from_the_data(qwen_path, tmp_path):
    from conftest import write_jsonl
    from rlft.plan.inputs import plan_input_from_config, plan_report
    from rlft.config import ModelConfig, load_config
    from rlft.data.sft_examples import make_sft_encoder
    from rlft.data.readers import read_rows
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import encode_prompt, end_of_turn_ids
    from rlft.plan.lengths import data_lengths

    short, long = "Count to 5.", "Count to 5, then back to 1, and say each number twice."
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": short}, {"prompt": long}, {"prompt": short}])
    tok = load_tokenizer(ModelConfig(path=str(qwen_path)))
    longest = len(encode_prompt(tok, [{"role": "user", "content": long}]))  # the chat template's tokens too
    cfg = load_config({"method": "grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(qwen_path)},
                       "data": {"train": str(tmp_path / "prompts.jsonl"), "max_prompt_length": 512},
                       "rollout": {"max_new_tokens": 16}, "rewards": [{"fn": "math"}]})
    lengths = data_lengths(cfg)
    assert (lengths.prompt, lengths.sequence, lengths.scanned, lengths.total) == (longest, longest + 16, 3, 3)
    assert plan_input_from_config(cfg, lengths=lengths).seq_len == longest + 16
    assert plan_input_from_config(cfg).seq_len == 512 + 16  # no lengths: the worst case
    report = plan_report(cfg, memory_gb=1)
    assert f"longest templated prompt {longest} tokens (all 3 rows of prompts.jsonl)" in report
    assert "lengths: worst case, data.max_prompt_length 512" in plan_report(cfg, memory_gb=1, worst_case=True)

    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello " * n}]}
            for n in (1, 9, 3)]
    write_jsonl(tmp_path / "sft.jsonl", rows)
    sft = load_config({"method": "sft", "output_dir": str(tmp_path / "sft"), "model": {"path": str(qwen_path)},
                       "data": {"train": str(tmp_path / "sft.jsonl"), "max_length": 1024}})
    encoded = [make_sft_encoder(tok, end_of_turn_ids(tok), 1024)(r) for r in read_rows(str(tmp_path / "sft.jsonl"))]
    setting = plan_input_from_config(sft, lengths=data_lengths(sft))
    assert setting.seq_len == max(len(e.input_ids) for e in encoded) < 1024
    assert setting.completion_len == max(sum(e.target_mask) for e in encoded)


def test_shared_prefix_counts_each_prompt_once_per_segment():
    """training.shared_prefix in the plan: a micro-batch of 16 rows (two groups of 8), prompts of
    512 tokens and 128 completion tokens."""
    from rlft.plan.memory import shared_prefix_tokens

    tiny = ModelShape.from_config(dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=512))
    s = PlanInput(method="online", micro_batch_size=16, batch_size=16, seq_len=640, completion_len=128, group_size=8)
    assert shared_prefix_tokens(tiny, s, 16) == (16 * 640, 640)  # off: every row whole
    on = PlanInput(**{**s.__dict__, "shared_prefix": "on"})
    # 2 prompts x 512 + 16 x 128 = 3072 tokens; attention over a segment of 512 + 8 x 128 = 1536
    assert shared_prefix_tokens(tiny, on, 16) == (3072, 1536)
    # auto, 16-token prompts before 1024-token completions: a segment of 8 would attend over 8208
    # tokens; each row alone (the plain layout) is cheaper
    long = PlanInput(**{**s.__dict__, "shared_prefix": "auto", "seq_len": 1040, "completion_len": 1024})
    assert shared_prefix_tokens(tiny, long, 16) == (16 * 1040, 1040)
    plain, shared = (by_name(plan_memory(dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=4, vocab_size=512), x))
                     for x in (s, on))
    assert shared["activations"] < plain["activations"] / 2
    # the engine prefills each of the 4 x 8 rows' 4 distinct prompts once: 4 prompts x 512 tokens x
    # (4H + 3I = 1664) x 2 B + the [32, V] sampling tensors 5 x 32 x 512 x 4 B
    assert plain["prefill + sampling working set"] == 4 * 512 * 1664 * 2 + 5 * 32 * 512 * 4 == 7_143_424
