"""Load the policy (optionally with LoRA), its tokenizer and the reference model; export results."""

from __future__ import annotations

import copy
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from rlft.config import LoraConfig, ModelConfig
from rlft.errors import RlftError
from rlft.models.folder_checks import (check_causal_lm, check_lora_targets, check_model_folder, check_tokenizer,
                                       check_tokenizer_folder)
from rlft.models.template import check_template, set_chat_template, write_template_record

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RlftError(f"model.device is {name!r} but no CUDA GPU is visible; use model.device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """model.dtype for loading a model outside training (training resolves it with the
    precision, see models/precision.py); 'auto' is fp32."""
    if name == "auto":
        return torch.float32
    if device.type == "cpu" and name == "fp16":
        raise RlftError("model.dtype=fp16 needs a CUDA GPU (fp16 training on CPU is unsupported/slow); "
                        "use model.dtype=bf16 or fp32 on CPU")
    if device.type == "cuda" and name == "bf16" and not torch.cuda.is_bf16_supported():
        raise RlftError(f"model.dtype=bf16 is not supported by {torch.cuda.get_device_name(device)}; "
                        "use model.dtype=fp16 or fp32")
    return DTYPES[name]


_ROUND_TRIP_PROBE = "What is 5588 +  12?\n\tIt is 5600.\n\n  x = 'y'"


def load_tokenizer(cfg: ModelConfig) -> Any:
    """AutoTokenizer, guarded against classes that rewrite a custom tokenizer.json.

    With transformers 5.x, AutoTokenizer may pick an architecture's own tokenizer class for a
    custom `tokenizer.json` that replaces its pre-tokenizer (splitting digits or whitespace
    differently) or drops whitespace; comparing with tokenizer.json detects it and we fall back to
    the generic fast tokenizer that reads tokenizer.json as is.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    given = cfg.tokenizer_path or cfg.path
    check_tokenizer_folder(given, "model.tokenizer_path" if cfg.tokenizer_path else "model.path")
    source = os.path.expanduser(given)
    kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise RlftError(f"could not load the tokenizer from {given!r}: {exc}\n"
                        "Fix: point model.path (or model.tokenizer_path) at a folder with tokenizer files, "
                        "or a hub id reachable from this machine") from None
    check_tokenizer(tokenizer, given)
    if _rewrites_tokenizer_json(tokenizer, Path(source)):
        log.info("%s tokenizes differently from %s/tokenizer.json; using tokenizer.json as is",
                 type(tokenizer).__name__, source)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(source, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    set_chat_template(tokenizer, cfg.chat_template)
    return tokenizer


def _rewrites_tokenizer_json(tokenizer: Any, folder: Path) -> bool:
    """True when the loaded class splits text differently from the folder's own tokenizer.json
    (it replaced the pre-tokenizer) or loses whitespace. The checkpoint's tokenizer.json is what
    the model was trained with, so it wins."""
    ids = tokenizer(_ROUND_TRIP_PROBE, add_special_tokens=False)["input_ids"]
    if not (folder / "tokenizer.json").is_file():
        return False
    if tokenizer.decode(ids) != _ROUND_TRIP_PROBE:
        return True
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return raw.encode(_ROUND_TRIP_PROBE, add_special_tokens=False).ids != ids


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, or a peft PeftModel under LoRA
    tokenizer: Any
    device: torch.device
    is_lora: bool
    # A distributed run trains `model` sharded across ranks; `mirror` is a whole copy of it on each
    # rank, kept in sync, that samples rollouts and is saved (None in a single process).
    mirror: "LoadedModel | None" = None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def unsharded(self) -> "LoadedModel":
        """The model with whole weights: the mirror of a sharded run, else this one."""
        return self.mirror if self.mirror is not None else self

    def make_mirror(self) -> None:
        """Keep a whole copy before the model is sharded (see `mirror`)."""
        self.mirror = LoadedModel(copy.deepcopy(self.model), self.tokenizer, self.device, self.is_lora)


def load_causal_lm(cfg: ModelConfig, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                                  dtype=dtype or resolve_dtype(cfg.dtype, device))
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    check_model_folder(cfg.path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(os.path.expanduser(cfg.path), output_loading_info=True,
                                                           **kwargs)
    except RlftError:
        raise
    except Exception as exc:  # noqa: BLE001  (safetensors, torch.load and config errors have many types)
        raise RlftError(f"could not load a causal LM from {cfg.path!r}: {type(exc).__name__}: {exc}\n"
                        "Fix: model.path must be a local checkpoint folder or a reachable hub id") from None
    model = model.to(device)
    check_causal_lm(model, info, cfg.path)
    return model


def load_policy(cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype | None = None) -> LoadedModel:
    """`dtype`: the weights' dtype training resolved (models/precision.py); default model.dtype."""
    device = resolve_device(cfg.device)
    check_model_folder(cfg.path)  # before the tokenizer: a wrong folder is named as such, not as a tokenizer problem
    tokenizer = load_tokenizer(cfg)
    check_template(cfg.path, tokenizer, cfg.allow_template_change)
    model = load_causal_lm(cfg, device, dtype)
    check_tokenizer(tokenizer, cfg.tokenizer_path or cfg.path, model.get_input_embeddings().num_embeddings)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora.enabled:
        model = apply_lora(model, lora)
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, is_lora=lora.enabled)


def disable_dropout(model: torch.nn.Module) -> None:
    """Turn every dropout off (LoRA's included) while keeping train mode (gradient checkpointing
    needs it). Methods that compare the trained policy with itself need this: online RL's
    importance ratio pi / pi_old is 1 on-policy only if both forwards are deterministic, and so
    are DPO's policy-vs-reference log-ratios at step 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):  # functional dropout rates some attention modules keep
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def apply_lora(model: Any, lora: LoraConfig, task_type: str = "CAUSAL_LM") -> Any:
    """peft LoRA; with task_type SEQ_CLS peft also trains and saves the new score head in full."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_lora_targets(model, lora.target_modules)
    peft_cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                              target_modules=lora.target_modules, task_type=task_type)
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as exc:
        raise RlftError(f"lora.target_modules: {exc}\nFix: use 'all-linear' or module names of this "
                        "model (e.g. q_proj, v_proj)") from None


def load_reward_model(cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype | None = None) -> LoadedModel:
    """A one-logit sequence classifier for reward-model training, from a causal-LM checkpoint (a new
    score head, seeded by the caller) or from an earlier reward model.

    The head reads the last token that is not `config.pad_token_id`, so that id must be the one
    the tokenizer pads with; it is set here and saved with the export, where the `reward_model`
    reward finds it.
    """
    from transformers import AutoModelForSequenceClassification

    device = resolve_device(cfg.device)
    check_model_folder(cfg.path)
    tokenizer = load_tokenizer(cfg)
    check_template(cfg.path, tokenizer, cfg.allow_template_change)
    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                                  dtype=dtype or resolve_dtype(cfg.dtype, device), num_labels=1)
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = AutoModelForSequenceClassification.from_pretrained(os.path.expanduser(cfg.path), **kwargs)
    except Exception as exc:  # noqa: BLE001  (safetensors, torch.load and config errors have many types)
        raise RlftError(f"could not load {cfg.path!r} as a one-logit sequence classifier: {exc}\n"
                        "Fix: model.path must be a causal-LM checkpoint (a score head is added) or a "
                        "reward model with one label") from None
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora.enabled:
        model = apply_lora(model, lora, task_type="SEQ_CLS")
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, is_lora=lora.enabled)


class Reference:
    """The frozen reference policy for KL terms.

    Under LoRA it is the policy itself with adapters disabled, so it costs no memory; otherwise a
    frozen copy made when training starts (the SFT snapshot the run began from).
    """

    def __init__(self, policy: LoadedModel):
        self._policy = policy
        if policy.is_lora:
            self._frozen = None
        else:
            self._frozen = copy.deepcopy(policy.model).eval()
            self._frozen.requires_grad_(False)

    @property
    def frozen_copy(self) -> Any:
        """The separate frozen model of a full fine-tune (None under LoRA): what a distributed run
        shards like the policy."""
        return self._frozen

    @contextmanager
    def model(self) -> Iterator[Any]:
        if self._frozen is not None:
            yield self._frozen
            return
        peft_model = self._policy.model
        was_training = peft_model.training
        peft_model.eval()
        try:
            with peft_model.disable_adapter():
                yield peft_model
        finally:
            peft_model.train(was_training)

    def state_dict(self) -> dict[str, Any] | None:
        return None if self._frozen is None else self._frozen.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None and self._frozen is not None:
            self._frozen.load_state_dict(state)


def export_model(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write a merged Hugging Face checkpoint (and the peft adapter under LoRA) with tokenizer,
    chat template and template record. Under LoRA the adapters are merged in place, so call this
    when training is over; `loaded` then holds the merged model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = loaded.model
    if loaded.is_lora:
        model.save_pretrained(out / "adapter")
        loaded.tokenizer.save_pretrained(out / "adapter")
        model = model.merge_and_unload()
        loaded.model, loaded.is_lora = model, False
    model.config.use_cache = True  # gradient checkpointing turns it off for training
    model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    write_template_record(out, loaded.tokenizer)
    return out
