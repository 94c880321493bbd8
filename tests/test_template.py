"""Chat templates: no double BOS, lossless whitespace, template-mismatch detection, and the
assistant-only SFT target mask checked against an independent character-span computation."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlft.config import LoraConfig, ModelConfig
from rlft.data.readers import Row
from rlft.data.sft_examples import collate_sft, encode_sft, make_sft_encoder
from rlft.errors import RlftError, TemplateMismatchError
from rlft.models.loading import load_policy, load_tokenizer
from rlft.models.template import (
    TEMPLATE_RECORD, check_template, encode_prompt, end_of_turn_ids, render, template_record,
    write_template_record,
)
from conftest import CHANGED_TEMPLATE
from rlft.models.tiny import CHATML_TEMPLATE

# The probe conversation rendered by hand with the ChatML template and a generation prompt.
PROBE_CHATML = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                "<|im_start|>assistant\nThe answer is 5.<|im_end|>\n"
                "<|im_start|>user\nAnd 4 * 6?\nShow the steps.<|im_end|>\n"
                "<|im_start|>assistant\n")

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "And  7\t+ 1?"},
    {"role": "assistant", "content": "It is 8.\nDone."},
]


@pytest.fixture(scope="module")
def qwen_tok(qwen_path):
    return load_tokenizer(ModelConfig(path=str(qwen_path)))


@pytest.fixture(scope="module")
def llama_tok(llama_path):
    return load_tokenizer(ModelConfig(path=str(llama_path)))


def test_changed_template_really_differs():
    # the tiny models' own template with exactly one "\n" added to the generation header
    assert CHANGED_TEMPLATE != CHATML_TEMPLATE
    assert CHANGED_TEMPLATE == CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n\\n'")


# -- BOS --------------------------------------------------------------------------------------

def test_llama_trap_is_real(llama_tok):
    # The template renders "<s>" and the post-processor prepends another one by default.
    text = render(llama_tok, CONVERSATION[:2], add_generation_prompt=True)
    assert text.startswith("<s><|im_start|>system\n")
    ids = llama_tok(text)["input_ids"]
    bos = llama_tok.bos_token_id
    assert bos is not None
    assert ids[:2] == [bos, bos]


def test_encode_prompt_has_exactly_one_bos(llama_tok):
    ids = encode_prompt(llama_tok, CONVERSATION[:2])
    bos = llama_tok.bos_token_id
    assert ids[0] == bos
    assert ids.count(bos) == 1
    assert llama_tok.decode(ids) == render(llama_tok, CONVERSATION[:2], add_generation_prompt=True)


def test_sft_encoding_has_exactly_one_bos(llama_tok):
    ids, mask = encode_sft(llama_tok, CONVERSATION, end_of_turn_ids(llama_tok))
    bos = llama_tok.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    assert mask[0] == 0
    assert llama_tok.decode(ids) == render(llama_tok, CONVERSATION)


def test_qwen_has_no_bos(qwen_tok):
    ids = encode_prompt(qwen_tok, CONVERSATION[:2])
    assert qwen_tok.decode(ids[:1]) == "<|im_start|>"


# -- whitespace ---------------------------------------------------------------------------------

TEXTS = ["a  b", "x\t\ty", "line1\n\nline2\n", "  leading and trailing  ", "tab\tthen  two\n\n\n three",
         "mixed \t \n \t end", "\r\nwindows\r\n", "12 + 3 = 15\n   indented", "unicode: héllo wörld ✓"]


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_tokenizer_round_trips_whitespace(arch, qwen_tok, llama_tok):
    tok = qwen_tok if arch == "qwen" else llama_tok
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text, f"{arch}: {text!r}"


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_rendered_conversation_round_trips(arch, qwen_tok, llama_tok):
    tok = qwen_tok if arch == "qwen" else llama_tok
    text = render(tok, CONVERSATION)
    ids = encode_sft(tok, CONVERSATION, end_of_turn_ids(tok))[0]
    assert tok.decode(ids) == text


def test_loaded_qwen_tokenizer_tokenizes_like_its_tokenizer_json(qwen_path, qwen_tok):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(qwen_path / "tokenizer.json"))
    text = "the  =  number  5588  city"  # two spaces before a digit
    assert qwen_tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids


# -- end of turn --------------------------------------------------------------------------------

def test_end_of_turn_is_im_end(qwen_tok, llama_tok):
    for tok in (qwen_tok, llama_tok):
        assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]


# -- template mismatch ------------------------------------------------------------------------

def test_probe_rendering_is_the_hand_written_one(qwen_tok):
    assert template_record(qwen_tok)["probe"] == PROBE_CHATML


def test_check_template_reports_first_difference(tmp_path, qwen_path, qwen_tok):
    write_template_record(tmp_path, qwen_tok)
    assert check_template(tmp_path, qwen_tok) is True
    changed = load_tokenizer(ModelConfig(path=str(qwen_path), chat_template=CHANGED_TEMPLATE))
    with pytest.raises(TemplateMismatchError) as info:
        check_template(tmp_path, changed)
    message = str(info.value)
    # The probe ends with the generation header; the changed template adds "\n" right after it,
    # so the first difference is at len(PROBE_CHATML):
    #   system turn    19 + 28 + 11 = 58   ("<|im_start|>system\n", text, "<|im_end|>\n")
    #   user turn      17 + 14 + 11 = 42
    #   assistant turn 22 + 16 + 11 = 49
    #   user turn      17 + 26 + 11 = 54
    #   header         22               -> 58 + 42 + 49 + 54 + 22 = 225
    n = len(PROBE_CHATML)
    assert n == 225
    assert f"first difference at character {n}:" in message
    assert f"checkpoint: {PROBE_CHATML[n - 24:]!r}" in message  # 24 characters of context
    assert f"this run:   {(PROBE_CHATML[n - 24:] + chr(10))!r}" in message
    assert "allow_template_change" in message
    assert check_template(tmp_path, changed, allow_change=True) is False


def test_no_record_means_no_check(tmp_path, qwen_tok):
    assert check_template(tmp_path, qwen_tok) is False


def test_template_from_a_jinja_file(tmp_path, qwen_path):
    path = tmp_path / "changed.jinja"
    path.write_text(CHANGED_TEMPLATE)
    tok = load_tokenizer(ModelConfig(path=str(qwen_path), chat_template=str(path)))
    assert template_record(tok)["probe"] == PROBE_CHATML + "\n"


def test_template_file_without_a_jinja_suffix_is_read(tmp_path, qwen_path):
    # Text without any "{" cannot be a useful Jinja template (it renders the same constant for
    # every conversation), so a path is a path whatever its suffix.
    path = tmp_path / "chatml_changed"
    path.write_text(CHANGED_TEMPLATE)
    tok = load_tokenizer(ModelConfig(path=str(qwen_path), chat_template=str(path)))
    assert template_record(tok)["probe"] == PROBE_CHATML + "\n"


def test_missing_template_file_is_an_error(tmp_path, qwen_path):
    for name in ("missing.jinja", "missing_template"):
        with pytest.raises(RlftError, match="model.chat_template: file not found"):
            load_tokenizer(ModelConfig(path=str(qwen_path), chat_template=str(tmp_path / name)))


def test_load_policy_stops_on_template_mismatch(tmp_path, qwen_path, qwen_tok):
    folder = tmp_path / "model"
    shutil.copytree(qwen_path, folder)
    write_template_record(folder, qwen_tok)
    assert (folder / TEMPLATE_RECORD).is_file()
    with pytest.raises(TemplateMismatchError, match="first difference at character 225"):
        load_policy(ModelConfig(path=str(folder), device="cpu", chat_template=CHANGED_TEMPLATE), LoraConfig())
    policy = load_policy(ModelConfig(path=str(folder), device="cpu", chat_template=CHANGED_TEMPLATE,
                                     allow_template_change=True), LoraConfig())
    assert render(policy.tokenizer, CONVERSATION[:1], add_generation_prompt=True).endswith("assistant\n\n")


# -- assistant-only masking -------------------------------------------------------------------

def _expected_targets(tok, messages, ids):
    """1 for tokens inside an assistant content + its `<|im_end|>`, found by character position in
    the rendered text (not by encode_sft's prefix-difference logic)."""
    text = render(tok, messages)
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == text  # ASCII only: every token decodes to whole characters
    spans, search_from = [], 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        header = "<|im_start|>assistant\n"
        start = text.index(header + m["content"] + "<|im_end|>", search_from) + len(header)
        end = start + len(m["content"]) + len("<|im_end|>")
        spans.append((start, end))
        search_from = end
    expected, pos = [], 0
    for piece in pieces:
        lo, hi = pos, pos + len(piece)
        inside = any(s <= lo and hi <= e for s, e in spans)
        straddles = any(lo < s < hi or lo < e < hi for s, e in spans)
        assert not straddles, f"token {piece!r} crosses a span boundary"
        expected.append(int(inside))
        pos = hi
    return expected, pieces


def test_assistant_only_mask_two_turns(qwen_tok):
    tok = qwen_tok
    ids, mask = encode_sft(tok, CONVERSATION, end_of_turn_ids(tok))
    expected, pieces = _expected_targets(tok, CONVERSATION, ids)
    assert mask == expected

    targets = "".join(p for p, m in zip(pieces, mask) if m)
    # exactly the two assistant texts, each with its end-of-turn token
    assert targets == "The answer is 42.<|im_end|>It is 8.\nDone.<|im_end|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ends = [i for i, t in enumerate(ids) if t == im_end]
    assert len(ends) == 5  # one per message
    # system and user end-of-turn tokens are not targets; both assistant ones are
    assert [mask[i] for i in ends] == [0, 0, 1, 0, 1]
    # the newline after an assistant <|im_end|> is not a target (the last one ends the sequence)
    assert pieces[ends[2] + 1] == "\n" and mask[ends[2] + 1] == 0
    assert pieces[ends[4] + 1] == "\n" and mask[ends[4] + 1] == 0
    # no header "<|im_start|>ROLE\n" token is a target: from each <|im_start|> up to and including
    # the first token ending in a newline
    starts = [i for i, t in enumerate(ids) if t == im_start]
    assert len(starts) == 5
    for s in starts:
        end = next(j for j in range(s + 1, len(ids)) if pieces[j].endswith("\n"))
        assert "".join(pieces[s:end + 1]) in {f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}
        assert sum(mask[s:end + 1]) == 0, "".join(pieces[s:end + 1])


def test_prompt_completion_row_mask(qwen_tok):
    encode = make_sft_encoder(qwen_tok, end_of_turn_ids(qwen_tok), max_length=128)
    ex = encode(Row("f.jsonl:1", {"prompt": "Add 2 and 2.", "completion": "4", "answer": "4"}))
    pieces = [qwen_tok.decode([i]) for i in ex.input_ids]
    assert "".join(p for p, m in zip(pieces, ex.target_mask) if m) == "4<|im_end|>"
    assert ex.prompt_messages == [{"role": "user", "content": "Add 2 and 2."}]
    assert ex.reference == "4" and ex.fields == {"answer": "4"}


def test_collate_pads_without_targets(qwen_tok):
    end_ids = end_of_turn_ids(qwen_tok)
    long_ids, long_mask = encode_sft(qwen_tok, CONVERSATION, end_ids)
    encode = make_sft_encoder(qwen_tok, end_ids, max_length=128)
    short = encode(Row("f:1", {"messages": CONVERSATION[1:3]}))
    long = encode(Row("f:2", {"messages": CONVERSATION}))
    assert long.input_ids == long_ids
    batch = collate_sft([short, long], pad_id=qwen_tok.pad_token_id)
    n, width = len(short.input_ids), len(long_ids)
    assert batch["input_ids"].shape == (2, width) and n < width
    assert batch["target_mask"].dtype == torch.bool
    assert batch["target_mask"][0, :n].tolist() == [bool(m) for m in short.target_mask]
    assert batch["target_mask"][1].tolist() == [bool(m) for m in long_mask]
    # padding: pad id, attention 0, never a target
    assert (batch["input_ids"][0, n:] == qwen_tok.pad_token_id).all()
    assert batch["attention_mask"][0, n:].sum() == 0 and batch["attention_mask"][0, :n].all()
    assert not batch["target_mask"][0, n:].any()
    assert batch["attention_mask"][1].all()


# A Llama-3-style template (headers and `<|eot_id|>`), written for this test.
LLAMA3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def test_a_template_of_another_family_is_refused_at_load(qwen_path, tmp_path, monkeypatch, capsys):
    """A Llama-3 template on the ChatML tokenizer used to be accepted silently: `<|eot_id|>` is no
    token there, so SFT taught the model to spell it out and generation never stopped on it."""
    import yaml

    from conftest import assert_clean_user_error, run_main, write_jsonl

    with pytest.raises(RlftError) as info:
        load_tokenizer(ModelConfig(path=str(qwen_path), chat_template=LLAMA3_STYLE_TEMPLATE))
    message = str(info.value)
    assert "ends an assistant turn with '<|eot_id|>', which is not a token of this tokenizer" in message
    assert "model.chat_template" in message and "'<|im_end|>'" in message  # the fix, and the tokenizer's own marker
    # and through `rlft train`: one clean error before anything trains
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c"}] * 4)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "method": "sft", "output_dir": str(tmp_path / "run"), "data": {"train": str(tmp_path / "sft.jsonl")},
        "model": {"path": str(qwen_path), "device": "cpu", "chat_template": LLAMA3_STYLE_TEMPLATE},
        "training": {"max_steps": 1, "batch_size": 4, "num_threads": 1}, "logging": {"progress": False}}))
    err = assert_clean_user_error(run_main(monkeypatch, capsys, "train", str(tmp_path / "c.yaml")))
    assert "'<|eot_id|>'" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_own_and_a_marker_free_template_pass_the_end_of_turn_check(qwen_tok):
    from rlft.models.template import check_end_of_turn

    check_end_of_turn(qwen_tok)  # ChatML on its own tokenizer: `<|im_end|>` is one special token
    plain = "{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
    tok = load_tokenizer(ModelConfig(path=str(qwen_tok.name_or_path), chat_template=plain))
    check_end_of_turn(tok)  # no marker: EOS ends a turn; nothing to judge
