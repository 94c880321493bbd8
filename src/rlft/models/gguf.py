"""GGUF checkpoints (llama.cpp's one-file format) as a model source, and their import to a normal folder.

A GGUF holds the weights (often quantized: Q4_1, Q8_0, ...), the config and the tokenizer (its
vocabulary, merges, special ids and chat template) as metadata. transformers reads all of it
(`from_pretrained(folder, gguf_file=name)`, which needs the `gguf` package) and unpacks the
weights into dense float tensors. What this module adds:

- the model transformers returns still carries its GGUF quantizer: `save_pretrained` refuses it and
  training code sees a quantized model. Its weights are copied into a fresh model of the same class,
  which is a plain model in every respect.
- transformers has no pre-tokenizer for some llama.cpp vocabularies (SmolLM's among them) and falls
  back to GPT-2's, which keeps digit runs together; the rule llama.cpp applies is restored.
- reading the metadata is slow Python (~30 s for a 135M model), so `import_gguf` writes a normal
  Hugging Face folder once (config, fp32 safetensors, tokenizer, chat template, generation config);
  later runs and vLLM load that folder in seconds.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from rlft.errors import RlftError
from rlft.models.template import end_of_turn_ids, write_template_record

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install 'rlft[gguf]'  (or: pip install gguf)"

# llama.cpp vocabularies (`tokenizer.ggml.pre`) that split every digit off before GPT-2's regex
# (llama.cpp src/llama-vocab.cpp: the STARCODER/REFACT/COMMAND_R/SMOLLM/CODESHELL/EXAONE case);
# transformers' GGUF loader knows none of them and would keep "2025" as one pre-token.
DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})


def gguf_source(path: str, gguf_file: str | None = None) -> Path | None:
    """The .gguf file a model source names, or None for an ordinary folder / hub id.

    `path` may be the file itself, or a folder with `gguf_file` naming a file in it. A source that
    names a GGUF is checked here: it exists and starts with the GGUF magic bytes.
    """
    if gguf_file is None and not path.lower().endswith(".gguf"):
        return None
    base = Path(os.path.expanduser(path))
    if gguf_file is not None:
        if not base.is_dir():
            raise RlftError(f"model.gguf_file is set, so model.path {path!r} must be the folder holding it; "
                            f"{'it is a file' if base.is_file() else 'no such folder'}.\nFix: model.path=FOLDER "
                            "model.gguf_file=NAME.gguf, or model.path=FILE.gguf without model.gguf_file")
        file = base / gguf_file
        if not file.is_file():
            present = sorted(p.name for p in base.glob("*.gguf"))
            raise RlftError(f"model.gguf_file {gguf_file!r}: no such file in {base} (its .gguf files: "
                            f"{', '.join(present) or 'none'})")
    else:
        file = base
        if not file.is_file():
            raise RlftError(f"model.path {path!r}: no such .gguf file" + (
                f" ({file.parent} holds: {', '.join(sorted(p.name for p in file.parent.glob('*.gguf'))) or 'no .gguf files'})"
                if file.parent.is_dir() else ""))
    with file.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise RlftError(f"{file} is not a GGUF file (it does not start with the bytes 'GGUF'); a GGUF download "
                            "that stopped early or an HTML error page looks like this.\nFix: download the file again")
    return file


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RlftError(f"loading a .gguf checkpoint needs the `gguf` package: {INSTALL_HINT}") from None


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers unpacks GGUF tensors under its own tqdm bar, which its progress-bar switch
    (`rlft` turns it off for a clean console) does not reach; it is replaced for the duration."""
    try:
        import transformers.modeling_gguf_pytorch_utils as unpacking
    except ImportError:  # a transformers without that module has no such bar
        yield
        return
    saved = getattr(unpacking, "tqdm", None)
    if saved is not None:
        unpacking.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if saved is not None:
            unpacking.tqdm = saved


def gguf_metadata(file: Path, *keys: str) -> dict[str, Any]:
    """Scalar and string metadata fields of a GGUF (arrays are skipped: the vocabulary is large)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    out: dict[str, Any] = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is not None and len(field.data) == 1:
            out[key] = field.contents()
    return out


def load_gguf_tokenizer(file: Path) -> Any:
    """The tokenizer a GGUF describes, as transformers builds it, with llama.cpp's digit split
    restored where transformers lacks it (see DIGIT_SPLIT_PRES)."""
    require_gguf()
    from transformers import AutoTokenizer

    try:
        with _quiet_progress():
            tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as exc:  # noqa: BLE001  (the GGUF tokenizer builders raise ValueError, KeyError, ...)
        raise RlftError(f"could not build a tokenizer from {file}: {type(exc).__name__}: {exc}\n"
                        "Fix: set model.tokenizer_path to a folder with the model's own tokenizer files") from None
    meta = gguf_metadata(file, "tokenizer.ggml.model", "tokenizer.ggml.pre")
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") in DIGIT_SPLIT_PRES:
        from tokenizers import Regex, pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),  # GPT-2's regex
        ])
    return tokenizer


def load_gguf_model(file: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Any:
    """The GGUF's causal LM with dense weights in `dtype`, as a plain transformers model."""
    require_gguf()
    from transformers import AutoModelForCausalLM

    try:
        with _quiet_progress():
            # fp32 first: the weights are unpacked to float anyway, and a lower dtype is a cast below
            loaded = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001  (unsupported architectures raise ValueError; bad files many types)
        raise RlftError(f"could not load a causal LM from {file}: {type(exc).__name__}: {exc}\n"
                        "Fix: transformers reads GGUF files of the architectures listed in its GGUF docs (llama, "
                        "mistral, qwen2, ...); convert other models with their own tools") from None
    config = loaded.config
    for name in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, name):
            delattr(config, name)
    config.name_or_path = str(file)
    model = type_of(config)(config)  # random init, overwritten next: the cost of a clean model
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model.generation_config.update(**_generation_ids(config))
    return model.to(device=device, dtype=dtype)


def type_of(config: Any) -> type:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def _generation_ids(config: Any) -> dict[str, Any]:
    return {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(config, k, None) is not None}


def import_gguf(src: str | Path, dst: str | Path, gguf_file: str | None = None, overwrite: bool = False) -> Path:
    """Write the GGUF checkpoint `src` (a .gguf file, or a folder plus `gguf_file`) as a normal
    Hugging Face folder at `dst`: config, fp32 safetensors, tokenizer with its chat template, a
    generation config that stops at the end of an assistant turn, and rlft's template record."""
    file = gguf_source(str(src), gguf_file)
    if file is None:
        raise RlftError(f"{src} is not a .gguf file; give the file, or its folder with --gguf-file NAME")
    out = Path(dst)
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not overwrite):
        raise RlftError(f"{out} is {'a file' if out.is_file() else 'not empty'}: importing there would mix two "
                        "models.\nFix: choose a new folder, or pass --force to replace what it holds")
    tokenizer = load_gguf_tokenizer(file)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = load_gguf_model(file, torch.float32)
    stops = [i for i in [model.config.eos_token_id, *end_of_turn_ids(tokenizer)] if i is not None]
    ids = _generation_ids(model.config)
    ids["eos_token_id"] = sorted({i for s in stops for i in (s if isinstance(s, list) else [s])})
    ids["pad_token_id"] = tokenizer.pad_token_id
    model.generation_config.update(**ids)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_template_record(out, tokenizer)
    return out
