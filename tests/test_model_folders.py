"""Model folders that load but are wrong: each is one clear error at load time naming the folder
and the fix, never a crash after training started or a minute of hub retries."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest

from rlft.config import LoraConfig, ModelConfig
from rlft.errors import RlftError
from rlft.models.folder_checks import looks_local
from rlft.models.loading import load_policy

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _load(path, **model):
    return load_policy(ModelConfig(path=str(path), device="cpu", **model), LoraConfig())


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def _error(path, **model) -> str:
    with pytest.raises(RlftError) as info:
        _load(path, **model)
    return str(info.value)


def test_a_folder_without_tokenizer_files_is_named_before_loading(qwen_path, tmp_path):
    folder = _copy(qwen_path, tmp_path / "weights-only", skip=("tokenizer.json", "tokenizer_config.json"))
    message = _error(folder)
    assert f"model.path {str(folder)!r} holds no tokenizer files" in message
    assert "tokenizer.save_pretrained" in message and "model.tokenizer_path" in message


def test_tokenizer_files_that_describe_no_tokenizer_are_caught_after_loading(qwen_path, tmp_path):
    # tokenizer_config.json alone: transformers builds a tokenizer of a few special tokens
    folder = _copy(qwen_path, tmp_path / "config-only", skip=("tokenizer.json",))
    message = _error(folder)
    assert f"the tokenizer loaded from {str(folder)!r} has 3 token(s)" in message


def test_another_models_tokenizer_with_a_larger_vocabulary_is_refused(qwen_path, tmp_path):
    from rlft.models.tiny import build_tokenizer

    build_tokenizer(1024).save_pretrained(tmp_path / "big-tok")
    shutil.copy(qwen_path / "chat_template.jinja", tmp_path / "big-tok")
    message = _error(qwen_path, tokenizer_path=str(tmp_path / "big-tok"))
    assert "has 1024 tokens but the model's embedding table has 512 rows" in message


def _save_bert(folder: Path, tokenizer_from: Path, with_head: bool) -> Path:
    from transformers import BertConfig, BertLMHeadModel, BertModel

    config = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)  # is_decoder=False: an encoder, as BERT is saved
    (BertLMHeadModel if with_head else BertModel)(config).save_pretrained(folder)
    for name in TOKENIZER:
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def test_an_encoder_without_an_lm_head_is_refused(qwen_path, tmp_path):
    folder = _save_bert(tmp_path / "bert", qwen_path, with_head=False)
    message = _error(folder)
    assert f"model.path {str(folder)!r} has no weights for cls.predictions" in message
    assert "saved as BertModel" in message


def test_an_encoder_with_a_complete_lm_head_is_refused_as_not_causal(qwen_path, tmp_path):
    folder = _save_bert(tmp_path / "bert-lm", qwen_path, with_head=True)
    message = _error(folder)
    assert "holds BertLMHeadModel, which is not a causal (left-to-right) model" in message


def test_a_truncated_weights_file_is_named_with_its_size(qwen_path, tmp_path):
    folder = _copy(qwen_path, tmp_path / "cut")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    message = _error(folder)
    assert f"the weights file {weights} is damaged: {len(data) // 2:,} of {len(data):,} bytes" in message
    assert "download it again" in message


def test_a_shard_missing_from_a_sharded_checkpoint_is_named(qwen_path, tmp_path):
    folder = _copy(qwen_path, tmp_path / "sharded")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert "misses weight shard(s) model-00002-of-00002.safetensors" in _error(folder)


@pytest.mark.parametrize("make, expected", [
    (lambda root: root, "is not a model folder: it is empty"),
    (lambda root: root / "run", "looks like an rlft run directory; its exported model is"),
    (lambda root: root / "run" / "final" / "model.safetensors", "is a file; it must be the model folder"),
])
def test_folders_that_are_not_model_folders(qwen_path, tmp_path, make, expected):
    root = tmp_path / "empty"
    root.mkdir()
    if "run" in str(make(root)):
        (root / "run").mkdir()
        (root / "run" / "config.yaml").write_text("method: sft\n")
        shutil.copytree(qwen_path, root / "run" / "final")
    assert expected in _error(make(root))


def test_a_mistyped_local_path_fails_at_once_naming_the_nearest_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    connections = []  # every network connection attempted, refused

    def refuse(self, address, *rest):
        connections.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    (tmp_path / "runs" / "sft" / "final").mkdir(parents=True)
    for typo, nearest in (("runs/sft/fnial", "did you mean 'runs/sft/final'"),
                          ("runs/sfx", "did you mean 'runs/sft'"),
                          ("./model", "exists and holds: runs")):
        message = _error(typo)
        assert connections == []  # no hub look-up (so no retries either), counted rather than timed
        assert f"model.path {typo!r}: no such folder" in message and nearest in message, message


def test_what_counts_as_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for path in ("/abs/model", "./model", "../model", "~/model", "model/", "a/b/c", "runs/x", "C:\\models\\x"):
        assert looks_local(path), path
    for hub_id in ("gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.2-1B"):
        assert not looks_local(hub_id), hub_id


def test_lora_target_modules_that_match_nothing_are_named_even_when_others_match(qwen_path):
    with pytest.raises(RlftError) as info:
        load_policy(ModelConfig(path=str(qwen_path), device="cpu"),
                    LoraConfig(enabled=True, target_modules=["q_proj", "v_prj"]))
    message = str(info.value)
    assert "no module of this Qwen2ForCausalLM is named 'v_prj' (did you mean 'v_proj'?)" in message
    assert "'q_proj'" not in message.split("Its linear layers")[0]  # the matching name is not blamed


# -- hub ids on a machine that cannot reach the hub ------------------------------------------

def test_an_uncached_hub_id_without_the_hub_fails_in_seconds(no_hub, tmp_path, monkeypatch, capsys):
    """With no network a hub id that is not cached took ~75 s of retries (30 'Retrying in Ns'
    lines, ~70 warnings) before its error; now one probe of the hub decides. The bound is 20 s, far
    above the few seconds it takes even on a loaded 2-core machine and far below the retry time."""
    import yaml

    from conftest import assert_clean_user_error, run_main, write_jsonl

    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c"}] * 4)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "method": "sft", "output_dir": str(tmp_path / "run"), "data": {"train": str(tmp_path / "sft.jsonl")},
        "model": {"path": "rlft-test-org/no-such-model", "device": "cpu"},
        "training": {"max_steps": 1, "num_threads": 1}, "logging": {"progress": False}}))
    start = time.monotonic()
    result = run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml"))
    elapsed = time.monotonic() - start
    err = " ".join(assert_clean_user_error(result).split())
    assert elapsed < 20, f"{elapsed:.1f} s"
    assert "model.path 'rlft-test-org/no-such-model' is a hub id that is not in the local Hugging Face cache" in err
    assert f"{no_hub} cannot be reached" in err and "hf download rlft-test-org/no-such-model" in err
    assert "Retrying" not in result.stderr + result.stdout


def test_a_cached_hub_id_loads_from_the_cache_without_the_hub(no_hub, qwen_path, tmp_path, monkeypatch):
    """A cached model must still load with the hub unreachable, and without waiting for retries:
    transformers' own `local_files_only` misses its adapter_config.json look-up (which retried for
    ~30 s), so the cached snapshot folder is loaded as a folder."""
    from huggingface_hub import constants

    commit = "0" * 40
    entry = tmp_path / "hub" / "models--rlft-test-org--cached"
    shutil.copytree(qwen_path, entry / "snapshots" / commit)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    start = time.monotonic()
    policy = _load("rlft-test-org/cached")
    assert time.monotonic() - start < 20
    assert policy.model.get_input_embeddings().num_embeddings == 512
