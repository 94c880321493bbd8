"""The `big-vocab` benchmark model: Qwen2-shaped with a real-size vocabulary (151,936 ids, as
Qwen2/2.5), hidden 512, 4 layers, tied embeddings, random weights.

    python benchmarks/big_vocab_model.py OUT_DIR [--seed 0]

The tokenizer and chat template are the tiny family's (rlft's `build_tokenizer`, 512 ids); only the
model's embedding/head has 151,936 rows. The extra ids are never produced by the tokenizer, but a
random model samples them (almost uniformly): both frameworks decode them to nothing, which makes
no difference to the timing of sampling, scoring and training, and an end-of-turn token is then
so rare that every completion runs to the token limit in both frameworks (equal work).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

VOCAB = 151_936
DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8)


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    from rlft.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(512, "qwen2", seed)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=im_end, rms_norm_eps=1e-6,
                         initializer_range=0.02, **DIMS)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, tokenizer.pad_token_id],
                                               pad_token_id=tokenizer.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    build(args.out, args.seed)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
