"""Model folders that load but are wrong, found before anything trains on them.

transformers is lenient on purpose: a folder without tokenizer files yields a one-token tokenizer,
an encoder loads into an LM-head class with random head weights, a truncated weights file fails
deep inside safetensors, and a mistyped local path becomes a hub id that is retried for a minute.
Each check here turns one of these into one message naming the folder and the fix.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

from rlft.errors import RlftError

log = logging.getLogger(__name__)

# Files a saved tokenizer consists of; a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "merges.txt", "tekken.json")
# No real tokenizer is this small (byte-level ones have 256 byte tokens alone); transformers
# builds a one-token tokenizer from a folder whose files do not describe one.
MIN_TOKENIZER_SIZE = 32


def looks_local(path: str) -> bool:
    """Whether `path` is meant as a local folder rather than a hub id ('name' or 'org/name'):
    it exists; or it starts with '/', '.', '~' or ends with a separator; or it has a backslash or
    more than one '/'; or its first part is a folder here (e.g. 'runs/sft' when ./runs exists)."""
    if os.path.exists(os.path.expanduser(path)):
        return True
    if path.startswith(("/", ".", "~")) or path.endswith(("/", os.sep)) or "\\" in path or path.count("/") > 1:
        return True
    head = path.split("/")[0]
    return "/" in path and os.path.isdir(head)


def check_model_folder(path: str, what: str = "model.path") -> None:
    """A local model folder exists, is a folder, holds a config.json and intact weight files.
    Hub ids pass unchecked (they are downloaded, and checked, by transformers)."""
    if not looks_local(path):
        return
    folder = Path(os.path.expanduser(path))
    if not folder.exists():
        raise RlftError(f"{what} {path!r}: no such folder{_nearest(folder)}\nFix: correct the path (a local folder "
                        "is never looked up on the hub)")
    if folder.is_file():
        raise RlftError(f"{what} {path!r} is a file; it must be the model folder (e.g. {str(folder.parent)!r}, "
                        "which holds config.json, the weights and the tokenizer)")
    if not (folder / "config.json").is_file():
        raise RlftError(f"{what} {path!r} is not a model folder: {_what_is_there(folder)}")
    _check_weight_files(folder, what)


def _nearest(folder: Path) -> str:
    """' (runs/sft exists; did you mean runs/sft/final?)', or the deepest existing parent's
    contents when nothing is close."""
    parent = folder
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent == folder or not parent.is_dir():
        return ""
    missing = folder.relative_to(parent).parts[0]
    siblings = sorted(p.name for p in parent.iterdir() if p.is_dir())
    guess = difflib.get_close_matches(missing, siblings, n=1, cutoff=0.6)
    if guess:
        return f" ({parent} exists; did you mean {str(parent / guess[0])!r}?)"
    shown = ", ".join(siblings[:8]) + (", ..." if len(siblings) > 8 else "")
    return f" ({parent} exists and holds: {shown or 'no folders'})"


def _what_is_there(folder: Path) -> str:
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return "it is empty"
    if (folder / "final" / "config.json").is_file():
        return f"it looks like an rlft run directory; its exported model is {str(folder / 'final')!r}"
    if (folder / "config.yaml").is_file():
        return ("it looks like an rlft run directory without a final export yet (finish or resume the run, or "
                "use a checkpoint's model/ folder)")
    shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "")
    return f"it has no config.json (it holds: {shown})"


def _check_weight_files(folder: Path, what: str) -> None:
    """Every weights shard the index names exists, and every .safetensors file is as long as its
    header says (a truncated copy fails later inside safetensors, or as a bus error on mmap)."""
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            raise RlftError(f"{what}: {index} is not a valid weights index; copy the model folder again") from None
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            raise RlftError(f"{what}: {folder} misses weight shard(s) {', '.join(absent[:4])} listed in {index.name}."
                            "\nFix: copy or download the model folder again, completely")
    for file in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem:
            raise RlftError(f"{what}: the weights file {file} is damaged: {problem}.\nFix: copy or download it again "
                            "(a transfer that stopped early leaves a file like this)")


def _safetensors_problem(file: Path) -> str | None:
    """The file format: 8 bytes little-endian header length, a JSON header of tensors with
    `data_offsets` into the data that follows; the data ends where the last tensor ends."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"{size:,} bytes, but its header alone needs {8 + n:,}"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "its header is not valid JSON"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        return f"{size:,} of {expected:,} bytes (it is cut off)"
    return None


def check_tokenizer_folder(path: str, what: str) -> None:
    """A local tokenizer source holds tokenizer files (the model folder itself, or tokenizer_path)."""
    if not looks_local(path):
        return
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        raise RlftError(f"{what} {path!r}: no such folder{_nearest(folder)}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise RlftError(f"{what} {path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...); "
                        "transformers would build a one-token tokenizer from it.\nFix: save the tokenizer into the "
                        "folder (tokenizer.save_pretrained(folder)) or set model.tokenizer_path to a folder that "
                        "has one")


def check_tokenizer(tokenizer: Any, source: str, embeddings: int | None = None) -> None:
    """A loaded tokenizer is a real one and fits the model's embedding table."""
    size = len(tokenizer)
    if size < MIN_TOKENIZER_SIZE:
        raise RlftError(f"the tokenizer loaded from {source!r} has {size} token(s): its files do not describe a "
                        "tokenizer.\nFix: save the model's tokenizer into the folder, or set model.tokenizer_path")
    if embeddings is not None and size > embeddings:
        raise RlftError(f"the tokenizer from {source!r} has {size} tokens but the model's embedding table has "
                        f"{embeddings} rows: ids past {embeddings - 1} would crash the first forward pass. It is "
                        "another model's tokenizer.\nFix: use the model's own tokenizer (model.tokenizer_path)")


# The endings of the class names transformers saves (config.json `architectures`) for models whose
# head scores text: a reward model (one logit per sequence) and a PPO critic (one per token).
REWARD_MODEL_ENDING = "ForSequenceClassification"
CLASSIFIER_ENDINGS = (REWARD_MODEL_ENDING, "ForTokenClassification")
REWARD_MODEL_FIX = ("train one with `method: reward_model` (from a causal LM such as an SFT export; that run's "
                    "final/ is the reward model), or point {field} at a reward model")


def saved_architectures(source: str) -> list[str]:
    """config.json's `architectures` of a local folder, read without loading anything ([] for a hub
    id, or a config that names none: then the loaded model's config is checked)."""
    file = Path(os.path.expanduser(source)) / "config.json"
    try:
        architectures = json.loads(file.read_text()).get("architectures") if file.is_file() else None
    except (ValueError, AttributeError):
        return []  # an unreadable config.json: transformers names the problem when it loads it
    return [a for a in architectures or [] if isinstance(a, str)]


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_not_classifier(architectures: list[str], path: str, field: str = "model.path") -> None:
    """A model saved as a classifier is refused where a causal LM is needed (the policy, a teacher).
    With tied embeddings (most small models) one loads into an LM class with no weight missing, so
    only its saved class tells: it would generate from a backbone trained to score."""
    arch = next((a for a in architectures if a.endswith(CLASSIFIER_ENDINGS)), None)
    if arch is None:
        return
    reward_model = arch.endswith(REWARD_MODEL_ENDING)
    what = "a reward model" if reward_model else "a token classifier (e.g. a PPO critic)"
    use = (f"; to score with it, name it in a reward instead: rewards: [{{fn: reward_model, args: {{path: {path}}}}}]"
           if reward_model else "")
    raise RlftError(f"{field} {path!r} holds {arch}, {what}: it has a score head, not a language-model head, so it "
                    f"gives no next-token probabilities to sample or train with.\nFix: point {field} at a causal "
                    f"language model (an ...ForCausalLM folder, e.g. an SFT run's final/){use}")


def check_reward_model_architecture(architectures: list[str], path: str, field: str) -> None:
    """Before its weights load: a reward model is saved as ...ForSequenceClassification. Anything else
    (a causal LM, an SFT export) loads into that class with a randomly initialised score head, and a
    run trained on its scores follows noise."""
    if not architectures or any(a.endswith(REWARD_MODEL_ENDING) for a in architectures):
        return
    raise RlftError(f"{field} {path!r} holds {', '.join(architectures)}, not a reward model (an "
                    f"...{REWARD_MODEL_ENDING} with a trained score head): loaded as one it would get a randomly "
                    "initialised score head, and training would follow noise.\nFix: "
                    + REWARD_MODEL_FIX.format(field=field))


def check_reward_model_weights(model: Any, loading_info: dict[str, Any], path: str, field: str) -> None:
    """After loading: the saved class (for a hub id, known only now) and every weight from the
    checkpoint; a classifier folder without its score weights would get a random head too."""
    check_reward_model_architecture(list(getattr(model.config, "architectures", None) or []), path, field)
    missing = sorted(loading_info.get("missing_keys") or [])
    if missing:
        raise RlftError(f"{field} {path!r} has no weights for {_shown(missing)}: transformers would initialise them "
                        "randomly, so its scores would be noise.\nFix: " + REWARD_MODEL_FIX.format(field=field))


def check_value_model_weights(model: Any, loading_info: dict[str, Any], path: str, field: str) -> None:
    """A separate PPO critic starts from its checkpoint's backbone; only the one-logit value head may
    be new (it is trained, see critic.warmup_steps). A backbone that is not in the checkpoint would
    start random, and no value it gives would mean anything."""
    prefix = f"{model.base_model_prefix}."
    missing = sorted(k for k in loading_info.get("missing_keys") or [] if k.startswith(prefix))
    if missing:
        raise RlftError(f"{field} {path!r} has no weights for {_shown(missing)}: the critic's backbone would start "
                        f"random.\nFix: point {field} at a complete model folder (the policy's causal LM, or a "
                        "reward model trained from it), or leave it unset to start from model.path")


def check_causal_lm(model: Any, loading_info: dict[str, Any], path: str, field: str = "model.path") -> None:
    """The saved class is not a classifier, every weight came from the checkpoint, and predictions
    at a position do not depend on later tokens (an encoder such as BERT loads into an LM-head class
    but sees the whole sequence, so it would train on the answers it is asked to predict)."""
    import torch

    check_not_classifier(list(getattr(model.config, "architectures", None) or []), path, field)
    arch = ", ".join(getattr(model.config, "architectures", None) or []) or type(model).__name__
    missing = list(loading_info.get("missing_keys") or [])
    if missing:
        raise RlftError(f"{field} {path!r} has no weights for {_shown(missing)}: they would start random. It was "
                        f"saved as {arch}, not as a causal LM with this head.\nFix: point {field} at a causal "
                        "language model (an ...ForCausalLM export, e.g. a previous run's final/)")
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    probe = torch.arange(1, 9, device=device).remainder(vocab)[None]  # [1, 8]
    changed = probe.clone()
    changed[0, 4:] = (changed[0, 4:] + vocab // 2).remainder(vocab)  # other tokens after position 3
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            mask = torch.ones_like(probe)
            a = model(input_ids=probe, attention_mask=mask).logits[0, :4].float()  # [4, V]
            b = model(input_ids=changed, attention_mask=mask).logits[0, :4].float()
    except Exception as exc:  # noqa: BLE001  (a custom model that cannot run this probe: not judged here)
        log.info("causality probe skipped for %s: %s: %s", path, type(exc).__name__, exc)
        return
    finally:
        model.train(was_training)
    exact = next(model.parameters()).dtype == torch.float32
    tolerance = (1e-5 if exact else 1e-2) * max(1.0, float(a.abs().max()))
    if float((a - b).abs().max()) > tolerance:
        raise RlftError(f"{field} {path!r} holds {arch}, which is not a causal (left-to-right) model: its "
                        "prediction for a position changes when later tokens change, so it cannot generate text or "
                        f"be trained with a next-token loss.\nFix: point {field} at a decoder-only causal LM "
                        "(e.g. a Qwen2, Llama or Mistral ...ForCausalLM)")


def check_lora_targets(model: Any, targets: list[str] | str) -> None:
    """Every name in lora.target_modules matches a module (peft's rule: the full name or its last
    dotted parts). peft refuses a list where nothing matches, but ignores a typo when another name
    matches, leaving that layer untrained."""
    if isinstance(targets, str):  # 'all-linear'
        return
    names = [n for n, _ in model.named_modules() if n]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not unmatched:
        return
    import torch

    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    hints = []
    for t in unmatched:
        guess = difflib.get_close_matches(t, linear, n=1)
        hints.append(f"{t!r}" + (f" (did you mean {guess[0]!r}?)" if guess else ""))
    raise RlftError(f"lora.target_modules: no module of this {type(model).__name__} is named {', '.join(hints)}. "
                    f"Its linear layers: {', '.join(linear)}.\nFix: correct the names, or use 'all-linear'")
