"""GGUF checkpoints: a tiny Llama written as a GGUF with the `gguf` package (F32 tensors, the
tokenizer as llama.cpp metadata) comes back through `rlft import-model` with the same logits, the
same tokens and the same chat template, and trains; model.path may name the .gguf itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import arithmetic_rows, assert_clean_user_error, make_config, run_main, write_jsonl

from rlft.errors import RlftError

# rlft's whitespace probe, text with digit runs (llama.cpp's "smollm" rule splits each digit off),
# and the chat-template markers: all must tokenize as the original tokenizer does
PROBES = ["What is 5588 +  12?\n\tIt is 5600.", "x 2025 and 17+25=42", "<|im_start|>user\nhi<|im_end|>\n"]


def _to_gguf_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face stores each head's rotary dimensions as [first halves | second halves]; llama.cpp
    interleaves them in pairs, so row (half, i) of a head moves to row (i, half)."""
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, 2, rows, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, pre: str = "smollm", quant: str | None = None) -> Path:
    """An F32 GGUF of a tiny Llama folder: hyper-parameters, byte-level BPE tokenizer (tokens,
    types, merges, special ids, chat template) and every tensor under llama.cpp's names. `quant`
    (e.g. "Q8_0", "Q4_1") stores every matrix quantized with the `gguf` package, the vectors
    (norms) in F32, as llama.cpp's quantized files do."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(model_dir)
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{quant}") if quant else gguf.LlamaFileType.ALL_F32)

    vocab = sorted(tok_json["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok_json["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is absent from a GGUF; its loader ties it again
        w = tensor.float().numpy()
        if "q_proj" in name:
            w = _to_gguf_qk(w, config.num_attention_heads)
        elif "k_proj" in name:
            w = _to_gguf_qk(w, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, llama_path) -> Path:
    return write_gguf(llama_path, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


@pytest.fixture(scope="module")
def imported(tmp_path_factory, tiny_gguf) -> Path:
    from rlft.models.gguf import import_gguf

    return import_gguf(tiny_gguf, tmp_path_factory.mktemp("imported") / "model")


def test_import_keeps_logits_tokens_and_template(llama_path, imported):
    from transformers import AutoModelForCausalLM

    from rlft.config import ModelConfig
    from rlft.models.loading import load_tokenizer
    from rlft.models.template import end_of_turn_ids, template_record

    original = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    copy = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    ids = torch.randint(0, original.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = original(ids).logits, copy(ids).logits  # [2, 24, V]
    # F32 tensors, the q/k permutation undone exactly: any difference is float summation order only
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert float(expected.std()) > 0.01  # the comparison is not between two near-zero outputs

    tok_a = load_tokenizer(ModelConfig(path=str(llama_path)))
    tok_b = load_tokenizer(ModelConfig(path=str(imported)))
    for text in PROBES:
        a = tok_a(text, add_special_tokens=False)["input_ids"]
        assert tok_b(text, add_special_tokens=False)["input_ids"] == a, text
        assert tok_b.decode(a) == text
    assert template_record(tok_b) == template_record(tok_a)
    assert json.loads((imported / "rlft_template.json").read_text()) == template_record(tok_a)
    im_end = tok_a.convert_tokens_to_ids("<|im_end|>")
    assert im_end in end_of_turn_ids(tok_b)
    assert im_end in json.loads((imported / "generation_config.json").read_text())["eos_token_id"]
    assert "quantization_config" not in json.loads((imported / "config.json").read_text())


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_quantized_gguf_imports_the_dequantized_weights(tmp_path, llama_path, quant):
    """A GGUF whose matrices are quantized (Q8_0; Q4_1, the format of the SmolLM2 file the real
    demo ships) imports as exactly the values the `gguf` package dequantizes, and its logits stay
    near the original model's, within what the quantization moved the weights. (Before: F32 only.)"""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlft.models.gguf import import_gguf

    qtype = getattr(gguf.GGMLQuantizationType, quant)
    config = AutoConfig.from_pretrained(llama_path)
    file = write_gguf(llama_path, tmp_path / f"tiny-llama.{quant}.gguf", quant=quant)
    imported = load_file(str(import_gguf(file, tmp_path / "model") / "model.safetensors"))
    original = load_file(str(llama_path / "model.safetensors"))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    expected = {}
    for name, w in original.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = w.float().numpy()
        head = heads.get(next((k for k in heads if k in name), ""), None)
        if w.ndim == 2:  # the oracle: quantize + dequantize with the gguf package, in llama.cpp's row order
            stored = _to_gguf_qk(w, head) if head else w
            w = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(stored), qtype), qtype)
            if head:  # undo the pair interleaving: (i, half) back to (half, i)
                rows = w.shape[0] // head // 2
                w = w.reshape(head, rows, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        expected[name] = torch.from_numpy(np.ascontiguousarray(w))
    for name, w in expected.items():
        torch.testing.assert_close(imported[name], w, rtol=0, atol=0, msg=name)
    moved = max(float((expected[k] - original[k].float()).abs().max()) for k in expected)
    assert moved > 0  # the weights really were quantized

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits  # [2, 24, V]
        model.load_state_dict(imported, strict=False)
        after = model(ids).logits
    # to first order each matrix's relative error e moves the logits by ~e, independently of the
    # others, so n quantized matrices move them by ~sqrt(n) e (n = 29 here: 7 per layer x 4 + the
    # tied embedding; measured ~6 e for both types); we allow twice that
    weight_err = (sum(float((expected[k] - original[k].float()).norm() ** 2) for k in expected)
                  / sum(float(original[k].float().norm() ** 2) for k in expected)) ** 0.5
    logit_err = float((after - before).norm() / before.norm())
    n = sum(1 for w in expected.values() if w.ndim == 2)
    assert 0 < logit_err < 2 * n ** 0.5 * weight_err, (logit_err, weight_err, n)


def test_smollm_digit_rule_restored(tiny_gguf):
    """transformers has no pre-tokenizer for llama.cpp's 'smollm' vocabularies and would fall back to
    GPT-2's regex, which keeps ' 2025' as one piece; llama.cpp splits every digit off first."""
    from rlft.models.gguf import load_gguf_tokenizer

    pieces = load_gguf_tokenizer(tiny_gguf).backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 2025")
    assert [p for p, _ in pieces] == ["x", "Ġ", "2", "0", "2", "5"]


def test_training_starts_from_the_import_and_from_the_gguf(tmp_path, imported, tiny_gguf):
    from rlft.api import train
    from rlft.config import load_config

    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(16, seed=3))
    for name, model in (("from-import", {"path": str(imported)}),
                        ("from-gguf", {"path": str(tiny_gguf.parent), "gguf_file": tiny_gguf.name})):
        cfg = make_config(model["path"], data, tmp_path / name, model={**model, "device": "cpu"},
                          training={"max_steps": 3, "batch_size": 4, "learning_rate": 1e-2})
        summary = train(load_config(cfg))
        assert summary["status"] == "completed", summary
        losses = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                  if "loss" in json.loads(line)]
        assert len(losses) == 3 and losses[-1] < losses[0], losses  # lr 1e-2 on 4 repeated-format rows


def test_import_model_command(monkeypatch, capsys, tmp_path, tiny_gguf):
    result = run_main(monkeypatch, capsys, "import-model", str(tiny_gguf.parent), str(tmp_path / "m"),
                      "--gguf-file", tiny_gguf.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()
    again = run_main(monkeypatch, capsys, "import-model", str(tiny_gguf), str(tmp_path / "m"))
    assert "not empty" in assert_clean_user_error(again) + again.stdout


def test_gguf_source_errors(tmp_path, tiny_gguf):
    from rlft.models.gguf import gguf_source

    assert gguf_source(str(tmp_path)) is None  # an ordinary folder is not a GGUF source
    assert gguf_source(str(tiny_gguf)) == tiny_gguf
    with pytest.raises(RlftError, match="no such .gguf file"):
        gguf_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(RlftError, match=r"its \.gguf files: tiny-llama\.F32\.gguf"):
        gguf_source(str(tiny_gguf.parent), "other.gguf")
    html = tmp_path / "page.gguf"
    html.write_text("<html>404</html>")
    with pytest.raises(RlftError, match="not a GGUF file"):
        gguf_source(str(html))


def test_missing_gguf_package_is_one_clear_error(monkeypatch, tiny_gguf):
    from rlft.models.gguf import load_gguf_model

    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees when it is not installed
    with pytest.raises(RlftError, match=r"pip install 'rlft\[gguf\]'"):
        load_gguf_model(tiny_gguf)


def test_reward_model_from_gguf_asks_for_an_import(tiny_gguf):
    from rlft.config import LoraConfig, ModelConfig
    from rlft.models.loading import load_reward_model

    with pytest.raises(RlftError, match="rlft import-model"):
        load_reward_model(ModelConfig(path=str(tiny_gguf), device="cpu"), LoraConfig())


def test_4bit_from_gguf_asks_for_an_import(tiny_gguf):
    import torch

    from rlft.config import ModelConfig
    from rlft.errors import ConfigError
    from rlft.models.loading import load_causal_lm

    # bitsandbytes quantises a folder's weights as they load; a GGUF is dequantized by transformers
    with pytest.raises(ConfigError, match="rlft import-model"):
        load_causal_lm(ModelConfig(path=str(tiny_gguf), device="cpu", quantization="4bit"), torch.device("cpu"))
