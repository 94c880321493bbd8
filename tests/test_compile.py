"""`training.compile`: compiled decoder layers compute what the eager ones do (log-probs and every
parameter's gradient, fp32, full and LoRA), new packed lengths do not recompile, a GRPO run with it
trains, and a missing C++ compiler is one clear error.

Tolerance: a compiled kernel sums in another order than the eager one. Reordering a float32 sum of
K terms moves it by about sqrt(K) * 1.2e-7 relative to its magnitude; here K <= 384 (the MLP width)
and about 8 such matmuls are chained between a weight and the loss (4 layers, forward and back),
so ~2e-5 at worst and ~2e-6 measured. So log-probs: rtol = atol = 1e-5; each gradient: rtol 1e-5
and atol 1e-5 x that tensor's largest entry (a tensor's small entries carry its large ones' error).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import take_grads
from rlft.errors import ConfigError
from rlft.models.compiled import check_compile_available, compiled_forwards
from rlft.models.forward import completion_logprobs

PROMPT = [5, 9, 31, 7, 12, 40, 3]
COMPLETIONS = [[44, 61, 2, 17, 90], [8, 11], [70, 71, 72, 73], [6, 6, 6]]


def group_batch(extra: int = 0):
    """One prompt and its completions as a rollout batch lays them out: `[prompt | right-padded
    completion]`; `extra` lengthens every completion (a new packed length)."""
    comps = [c + [9] * extra for c in COMPLETIONS]
    t = max(map(len, comps))
    ids = torch.zeros(len(comps), len(PROMPT) + t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(comps):
        ids[i, :len(PROMPT)], ids[i, len(PROMPT):len(PROMPT) + len(c)] = torch.tensor(PROMPT), torch.tensor(c)
        mask[i, :len(PROMPT) + len(c)] = 1
    return ids, mask, t


def logprobs_and_grads(model, compiled: bool, extra: int = 0, shared_prefix: str = "off"):
    ids, mask, tc = group_batch(extra)
    model.zero_grad(set_to_none=True)
    with compiled_forwards(compiled):
        lp, _ = completion_logprobs(model, ids, mask, tc, temperature=0.9, packing=True, shared_prefix=shared_prefix)
    weights = torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)  # every token weighs differently
    (weights * lp).sum().backward()
    return lp.detach(), take_grads(model)


def assert_same(compiled, eager):
    (lp_c, g_c), (lp_e, g_e) = compiled, eager
    torch.testing.assert_close(lp_c, lp_e, rtol=1e-5, atol=1e-5)
    assert g_c.keys() == g_e.keys() and g_c
    for name in g_e:
        scale = float(g_e[name].abs().max())
        torch.testing.assert_close(g_c[name], g_e[name], rtol=1e-5, atol=1e-5 * max(scale, 1e-6), msg=name)


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def fp32_model(qwen_path):
    return AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).train()


def test_layers_run_compiled_only_inside_compiled_forwards(fp32_model, monkeypatch):
    """The wiring, with a backend that builds no kernels (AOTAutograd's graphs run eagerly): the
    decoder's layers go through torch.compile inside `compiled_forwards()` and only there, give the
    eager numbers, and a new packed length reuses the graph. Inductor's numbers: the tests below."""
    import rlft.models.compiled as compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    layers = list(fp32_model.model.layers)
    before = graphs()
    assert_same(logprobs_and_grads(fp32_model, True), logprobs_and_grads(fp32_model, False))
    assert graphs() > before  # something was compiled ...
    assert all(layer._compiled_call_impl is None for layer in layers)  # ... and generation will not see it
    traced = graphs()
    logprobs_and_grads(fp32_model, True, extra=3)
    assert graphs() == traced


@pytest.mark.slow  # ~10 s with a warm inductor cache, 24-28 s on a cold one (the first run on a machine)
def test_compiled_forward_matches_eager_and_new_lengths_do_not_recompile(fp32_model):
    assert_same(logprobs_and_grads(fp32_model, True), logprobs_and_grads(fp32_model, False))
    before = graphs()
    assert_same(logprobs_and_grads(fp32_model, True, extra=3), logprobs_and_grads(fp32_model, False, extra=3))
    assert graphs() == before  # lengths are symbols: packed rows of a new length reuse the graph


@pytest.mark.slow  # 30-50 s with a cold inductor cache (the LoRA layer graph is its own compile), ~4-9 s warm
def test_compiled_lora_forward_matches_eager(fp32_model):
    from rlft.config import LoraConfig
    from rlft.models.loading import apply_lora

    model = apply_lora(fp32_model, LoraConfig(enabled=True, r=4, dropout=0.0))
    with torch.no_grad():  # B starts at 0: move it, so the adapter's own gradients are not trivially equal
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    eager = logprobs_and_grads(model, False)
    assert all("lora_" in name for name in eager[1])
    assert_same(logprobs_and_grads(model, True), eager)


@pytest.mark.slow  # ~40 s: compiles the 4D-mask variant (measured separately from the plain one)
def test_compiled_shared_prefix_forward_matches_eager(fp32_model):
    assert_same(logprobs_and_grads(fp32_model, True, shared_prefix="on"),
                logprobs_and_grads(fp32_model, False, shared_prefix="on"))


@pytest.mark.slow  # ~60 s: compiles the policy's training forward and the reference's no-grad one
def test_grpo_with_compile_trains(tmp_path):
    from safetensors.torch import load_file

    from rlft.api import train
    from rlft.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0)
    (tmp_path / "rewards.py").write_text("def digits(prompt, completion, **row):\n"
                                         "    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    train({"method": "grpo", "output_dir": str(out), "seed": 0, "model": {"path": str(model), "dtype": "fp32"},
           "data": {"train": str(tmp_path / "prompts.jsonl")},
           "training": {"learning_rate": 1e-2, "max_steps": 3, "num_threads": 1, "lr_scheduler": "constant",
                        "precision": "fp32", "compile": True},
           "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
           "rewards": [{"fn": f"{tmp_path / 'rewards.py'}:digits"}], "logging": {"progress": False}})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for key in ("loss", "kl", "grad_norm", "reward/mean"):
        assert all(isinstance(r[key], float) and r[key] == r[key] and abs(r[key]) < float("inf") for r in rows), key
    before, after = load_file(str(model / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_missing_cpp_compiler_is_one_config_error():
    import torch._inductor.config as inductor_config
    from torch._inductor.cpp_builder import cpp_compiler_search

    # inductor's own patch: monkeypatch's undo of a config proxy's attribute deleted the entry, and
    # every later inductor compile in the process (vLLM's) failed on "cpp.cxx does not exist"
    cpp_compiler_search.cache_clear()
    try:
        with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
            with pytest.raises(ConfigError, match=r"training\.compile.*C\+\+ compiler(.|\n)*Fix: install one"):
                check_compile_available(torch.device("cpu"))
    finally:
        cpp_compiler_search.cache_clear()
    assert inductor_config.cpp.cxx != (None, "/nonexistent/g++")  # restored


def test_compile_is_off_by_default_and_a_bool():
    from rlft.config import TrainingConfig

    assert TrainingConfig().compile is False
    assert TrainingConfig(compile="true").compile is True
    with pytest.raises(ValueError):
        TrainingConfig(compile="sometimes")


def test_compile_with_gradient_checkpointing_is_a_config_error(qwen_path, tmp_path):
    from rlft.config import load_config

    cfg = {"method": "sft", "output_dir": str(tmp_path / "run"), "model": {"path": str(qwen_path),
           "gradient_checkpointing": True}, "data": {"train": str(tmp_path / "x.jsonl")}, "training": {"compile": True}}
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(ConfigError, match=r"training\.compile with model\.gradient_checkpointing"):
        load_config(cfg)
