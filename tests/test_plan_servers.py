"""The memory plan of a run that samples on rollout servers (`rollout.servers`): the trainer without a
rollout engine, each server at its tensor-parallel size, and the layout on 8 x 80 GB for the two
configs of issue 41 (tests/data/plan: Qwen2.5-7B full fine-tune, Qwen2.5-32B LoRA; config.json only)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from rlft.plan.memory import GiB, ModelShape, PlanInput, device_capacity, plan_memory
from rlft.plan.servers import BLOCK_TOKENS, ServerInput, _weights_per_device, plan_server

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "plan"
QWEN7B_PARAMS = 7_615_616_512  # tests/test_plan.py counts them by hand
ENGINE_PARTS = {"rollout KV cache", "vLLM weights copy", "hf engine cache copies", "fast-decode fused weights",
                "prefill + sampling working set", "gathered weights for sampling", "sampler's copy of the policy"}


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs name their model folders from the repository root


def model_config(name: str) -> dict:
    from transformers import AutoConfig

    folder = ROOT / "tests" / "fixtures" / "qwen2.5-7b" if name == "7b" else DATA / "qwen2.5-32b"
    return AutoConfig.from_pretrained(folder).to_dict()


def load(name: str, *overrides: str):
    from rlft.config import load_config

    return load_config(DATA / name, list(overrides))


def rlft_plan(*args: str) -> str:
    from rlft.cli.plan import register

    app = typer.Typer()
    app.command("noop")(lambda: None)  # a second command keeps `plan` a subcommand
    register(app)
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 0, result.output
    return result.output


def by_name(plan) -> dict[str, object]:
    return {c.name: c for c in plan.components}


def test_7b_full_finetune_on_four_ranks_and_four_servers_fits_8x80gb():
    out = rlft_plan(str(DATA / "qwen7b_servers.yaml"), "--device", "h100", "--world-size", "4", "--devices", "8")
    assert "the trainer on 4 x H100 80GB, rollouts on 4 server(s) x TP1, planned apart" in out
    assert "trainer, per rank:" in out and "fits on H100 80GB" in out
    assert "rollout servers (rollout.servers): 4 x tensor parallel 1" in out
    assert "all 256 sequences of a step fit at once over 4 server(s)" in out
    assert "layout: trainer 4 x H100 80GB + 4 server(s) x TP1 = 8 devices of 8: fits" in out
    trainer = out.split("rollout servers (rollout.servers)")[0]
    assert not any(part in trainer for part in ENGINE_PARTS)
    # mixed precision keeps fp32 weights, so each rank's whole copy is fp32: 4 B x 7.62B twice at the sync
    mixed = rlft_plan(str(DATA / "qwen7b_servers.yaml"), "--device", "h100", "--world-size", "4", "--devices", "8",
                      "training.precision=bf16-mixed")
    assert "= 8 devices of 8: does NOT fit (the trainer)" in mixed
    assert "pure bf16 weights and states (training.precision=bf16)" in mixed


def test_32b_lora_on_one_rank_and_three_tp2_servers_fits_8x80gb():
    out = rlft_plan(str(DATA / "qwen32b_servers.yaml"), "--device", "H100-80GB", "--devices", "8")
    assert "layout: trainer 1 x H100 80GB + 3 server(s) x TP2 = 7 devices of 8: fits" in out
    assert "LoRA adapter slots" in out and "all 128 sequences of a step fit at once" in out
    # with two servers (5 devices) all of a step's sequences still fit at once
    two = rlft_plan(str(DATA / "qwen32b_servers.yaml"), "--device", "h100", "--devices", "8",
                    "rollout.servers=[http://10.0.0.2:8000,http://10.0.0.2:8001]")
    assert "trainer 1 x H100 80GB + 2 server(s) x TP2 = 5 devices of 8: fits" in two
    # too few devices for the layout: said so
    assert "= 7 devices of 6: does NOT fit (7 devices)" in rlft_plan(
        str(DATA / "qwen32b_servers.yaml"), "--device", "h100", "--devices", "6")


def test_32b_lora_does_not_fit_colocated_or_on_fsdp_ranks():
    """Colocated, one device holds the trainer's bf16 base and vLLM's own copy (2 x 61 GiB). On four
    FSDP ranks with servers each rank still keeps a whole copy of the policy (LoadedModel.mirror,
    what rank 0 sends to the servers) and gathers the whole state dict into it after every step
    (sync_mirror): sharding saves 46 GiB and those cost 123 GiB."""
    from rlft.plan.inputs import plan_input_from_config

    cfg32 = model_config("32b")
    colocated = plan_input_from_config(load("qwen32b_servers.yaml", "rollout.servers=[]"))
    assert colocated.engine == "vllm" and not colocated.servers
    plan = plan_memory(cfg32, colocated)
    assert "vLLM weights copy" in by_name(plan)
    usable = device_capacity("h100")[1]
    assert plan.total > usable
    one_rank = plan_memory(cfg32, plan_input_from_config(load("qwen32b_servers.yaml")))
    assert one_rank.total < usable * 0.9 < plan.total  # the servers took the engine's copy off the device

    fsdp = plan_memory(cfg32, plan_input_from_config(load("qwen32b_servers.yaml"), world_size=4))
    whole = 2 * ModelShape.from_config(cfg32).params() + 4 * ModelShape.from_config(cfg32).lora_params(16, "all-linear")
    assert by_name(fsdp)["whole copy of the policy (mirror)"].bytes == whole
    assert by_name(fsdp)["gathered state dict"].phases == ("sync",)
    assert fsdp.peak_phase == "sync" and fsdp.total > 2 * whole > usable
    out = rlft_plan(str(DATA / "qwen32b_servers.yaml"), "--device", "h100", "--world-size", "4", "--devices", "8",
                    "rollout.servers=[http://10.0.0.2:8000,http://10.0.0.2:8001]")
    assert "trainer 4 x H100 80GB + 2 server(s) x TP2 = 8 devices of 8: does NOT fit (the trainer)" in out
    assert "one trainer rank (no whole copy of the policy per rank)" in out


def test_the_trainer_holds_no_rollout_engine_with_servers():
    cfg7 = model_config("7b")
    s = PlanInput(method="online", precision="bf16", param_dtype="bf16", micro_batch_size=4, batch_size=32,
                  seq_len=1536, completion_len=1024, engine="vllm")
    colocated = {c.name for c in plan_memory(cfg7, s).components}
    assert {"rollout KV cache", "vLLM weights copy"} <= colocated
    served = plan_memory(cfg7, PlanInput(**{**s.__dict__, "servers": True}))
    assert not ENGINE_PARTS & set(by_name(served)) and "rollout" not in served.phases
    # one rank: nothing at all for the servers (it sends from its own weights)
    trainer_only = {c.name for c in plan_memory(cfg7, PlanInput(**{**s.__dict__, "engine": "hf"})).components}
    assert set(by_name(served)) == trainer_only - ENGINE_PARTS
    # two ranks: the whole bf16 copy, 2 B x 7,615,616,512, held throughout, gathered again at each sync
    two = by_name(plan_memory(cfg7, PlanInput(**{**s.__dict__, "servers": True, "world_size": 2})))
    assert two["whole copy of the policy (mirror)"].bytes == two["gathered state dict"].bytes == 2 * QWEN7B_PARAMS
    assert two["whole copy of the policy (mirror)"].phases == ("static",)
    # async: the sampler's copy the servers are pushed from stays in host memory, off the device
    k1 = plan_memory(cfg7, PlanInput(**{**s.__dict__, "servers": True, "async_steps": 1}))
    assert k1.total == served.total and "the sampler's copy of the policy (14.19 GiB)" in " ".join(k1.assumptions)
    # LoRA sending merged weights builds W + BA for every adapted linear on the sending rank
    merged = by_name(plan_memory(cfg7, PlanInput(**{**s.__dict__, "servers": True, "lora": True,
                                                    "server_lora_sync": "merged"})))
    assert merged["merged LoRA weights"].bytes == 2 * ModelShape.from_config(cfg7).quantized_params()
    assert merged["merged LoRA weights"].phases == ("push",)  # after sync_mirror's gathered dict is freed
    with pytest.raises(ValueError, match="vLLM servers"):
        PlanInput(method="online", servers=True)


def test_server_weights_and_kv_cache_hand_computed():
    cfg7, cfg32 = model_config("7b"), model_config("32b")
    m7, m32 = ModelShape.from_config(cfg7), ModelShape.from_config(cfg32)
    assert _weights_per_device(m7, 1) == m7.params() == QWEN7B_PARAMS
    # 32B at TP2: per layer q, o (2 x 5120 x 5120) + gate, up, down (3 x 5120 x 27648) halved = 238,551,040;
    # k, v (2 x 5120 x 1024, 8 KV heads -> 4 a device) halved = 5,242,880; q|k|v bias (5120 + 2048) / 2 = 3584;
    # the norms whole 10,240; embedding + head 2 x 152064 x 5120 / 2 = 778,567,680; the final norm 5120
    layer = 238_551_040 + 5_242_880 + 3_584 + 10_240
    assert _weights_per_device(m32, 2) == 64 * layer + 778_567_680 + 5_120
    # 7B at TP8: 4 KV heads cannot split 8 ways: each device keeps one, so k, v are a quarter each
    assert _weights_per_device(m7, 8) > m7.params() // 8

    plan = plan_server(cfg7, ServerInput(count=4, sequences=256, seq_len=1536), 80 * GiB, "80 GiB")
    # bf16 KV per token on one device: 2 x 28 layers x 4 KV heads x 128 x 2 B
    assert plan.kv_token_bytes == 57_344
    assert plan.kv_bytes == int(0.9 * 80 * GiB) - sum(c.bytes for c in plan.components)
    assert plan.concurrent_per_server == min((plan.kv_tokens // BLOCK_TOKENS) // (1536 // BLOCK_TOKENS), 1024)
    tp4 = plan_server(cfg32, ServerInput(count=1, tensor_parallel=4, sequences=256, seq_len=1536), 80 * GiB)
    assert tp4.kv_token_bytes == 2 * 64 * 2 * 128 * 2  # 8 KV heads over 4 devices


def test_a_small_server_says_how_many_run_at_once():
    cfg7 = model_config("7b")
    # 24 GiB at 0.9: 21.6 GiB less 14.19 GiB of weights and the runtime's ~2.5 GiB leaves ~4.7 GiB of KV
    small = plan_server(cfg7, ServerInput(count=2, sequences=256, seq_len=1536), 24 * GiB, "24 GiB")
    per = small.concurrent_per_server
    assert 0 < 2 * per < 256 and small.fits
    text = small.concurrency_text()
    assert f"{2 * per} of a step's 256 sequences run at once over 2 server(s)" in text
    assert f"about {math.ceil(256 / (2 * per))} rounds" in text
    # the model's 131072 positions do not fit one server's cache: vLLM would refuse to start
    assert "--max-model-len" in small.max_model_len_note()
    none = plan_server(cfg7, ServerInput(count=1, sequences=8, seq_len=1536), 16 * GiB, "16 GiB")
    assert not none.fits and "does NOT fit" in none.verdict("16 GiB")


def test_device_names():
    assert device_capacity("h100")[0] == "H100 80GB"
    assert device_capacity("A100-80GB")[0] == "A100 80GB"
    with pytest.raises(ValueError, match="could be A100 80GB or A100 40GB"):
        device_capacity("a100")
