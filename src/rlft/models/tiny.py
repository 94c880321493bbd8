"""Tiny random-weight models for tests, examples and the demo.

Nothing can be downloaded here, so we build a real Hugging Face checkpoint locally: a byte-level
BPE tokenizer trained with `tokenizers` (digits split one per token, so arithmetic is learnable),
a ChatML-style chat template, and a Qwen2 or Llama model with random weights, all written with
`save_pretrained` so every later step takes the path a downloaded checkpoint takes.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Literal

import torch

from rlft.errors import RlftError

SIZES = {
    # ~1M parameters: the default for tests and the demo.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512),
    # ~30M parameters: the larger benchmark workload.
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=1024),
}

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-style checkpoints put the BOS token in the template *and* in the tokenizer's post-processor,
# the classic double-BOS trap that rlft's rendering must avoid.
LLAMA_TEMPLATE = "{{- bos_token }}" + CHATML_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]

_WORDS = """what is the answer of a an and or to in on for with by from as at be this that it you your
question solve compute find number sum product difference plus minus times divided equals result
final please give only step think first then so therefore because if else def return print import
true false none value list string int float json name age city user assistant system hello world
yes no good bad correct wrong reason explain write code function test input output carry write digit answer is""".split()


def _corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    punct = list(".,:;!?()[]{}<>=+-*/%#'\"_\\^$&|~`@")
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(3, 12)):
            r = rng.random()
            if r < 0.55:
                word = rng.choice(_WORDS)
                parts.append(word.capitalize() if rng.random() < 0.15 else word)
            elif r < 0.75:
                parts.append(str(rng.randint(0, 9999)))
            elif r < 0.9:
                parts.append(rng.choice(punct))
            else:
                parts.append("".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 6))))
        sep = rng.choice([" ", " ", " ", "\n", "  ", "\t"])
        out.append(sep.join(parts))
    return out


def build_tokenizer(vocab_size: int = 512, arch: Literal["qwen2", "llama"] = "qwen2", seed: int = 0):
    """A byte-level BPE tokenizer (lossless on any text) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if arch == "llama":
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>" if arch == "llama" else None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = LLAMA_TEMPLATE if arch == "llama" else CHATML_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    arch: Literal["qwen2", "llama"] = "qwen2",
    size: str = "tiny",
    seed: int = 0,
    overwrite: bool = False,
    init_std: float = 0.02,
) -> Path:
    """Write a random-weight causal LM with tokenizer and chat template to `out_dir`. A folder
    that already holds files (a trained model, a run) is refused unless `overwrite`.

    `init_std`: the weights' initial standard deviation (config.initializer_range). At 0.02 the
    attention logits start near zero and the model attends almost uniformly for a long while: SFT
    to copy "a + b" from "What is a + b?" stayed at the no-copy loss for 400 steps (batch 16, lr
    3e-3); at 0.08 it copied within ~50 (the tool demo's tiny variant copies numbers into calls)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    dims = dict(SIZES[size])
    out = Path(out_dir)
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not overwrite):
        what = "a file" if out.is_file() else "not empty" + (" (it holds a model)" if (out / "config.json").exists()
                                                             else "")
        raise RlftError(f"{out} is {what}: writing random weights there would replace what it holds.\n"
                        "Fix: choose a new folder, or pass --force (overwrite=True) to replace it")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(dims.pop("vocab_size"), arch, seed)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(
        vocab_size=len(tokenizer), max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=im_end, rms_norm_eps=1e-6,
        initializer_range=init_std, **dims,
    )
    if arch == "llama":
        config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, **common)
    else:
        config = Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
