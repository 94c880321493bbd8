"""Load the policy (optionally with LoRA), its tokenizer and the reference model; export results."""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from rlft.config import LoraConfig, ModelConfig
from rlft.errors import ConfigError, RlftError
from rlft.models.folder_checks import (check_causal_lm, check_lora_targets, check_model_folder, check_not_classifier,
                                       check_tokenizer, check_tokenizer_folder, saved_architectures)
from rlft.models.gguf import gguf_source, load_gguf_model, load_gguf_tokenizer
from rlft.models.hub import hub_source
from rlft.models.template import check_end_of_turn, check_template, set_chat_template, write_template_record
from rlft.paths import existing

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str, field: str = "model.device") -> torch.device:
    """`name` ('auto', 'cpu', 'cuda', 'cuda:N') as a torch device; a GPU that is not there is
    refused naming `field`, before anything is loaded onto it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RlftError(f"{field} is {name!r} but no CUDA GPU is visible; use {field}=cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RlftError(f"{field} is {name!r} but only {torch.cuda.device_count()} CUDA GPU(s) are visible "
                        f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
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


def load_tokenizer(cfg: ModelConfig, field: str = "model.path") -> Any:
    """AutoTokenizer, guarded against classes that rewrite a custom tokenizer.json. `field`: the
    config field `cfg.path` came from, named in errors (`teacher.path` for a teacher).

    With transformers 5.x, AutoTokenizer may pick an architecture's own tokenizer class for a
    custom `tokenizer.json` that replaces its pre-tokenizer (splitting digits or whitespace
    differently) or drops whitespace; comparing with tokenizer.json detects it and we fall back to
    the generic fast tokenizer that reads tokenizer.json as is.
    """
    gguf = None if cfg.tokenizer_path else _gguf_file(cfg)
    if gguf is not None:
        return _finish_tokenizer(_load_gguf_tokenizer(gguf), cfg)
    given = cfg.tokenizer_path or cfg.path
    field = "model.tokenizer_path" if cfg.tokenizer_path else field
    check_tokenizer_folder(given, field)
    # before importing transformers' tokenizers (seconds): an unusable hub id is known at once
    source = hub_source(given, cfg.revision, field)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise RlftError(f"could not load the tokenizer from {given!r}: {exc}\n"
                        f"Fix: point {field}{' (or model.tokenizer_path)' if field == 'model.path' else ''} at a "
                        "folder with tokenizer files, or a hub id reachable from this machine") from None
    check_tokenizer(tokenizer, given)
    if _rewrites_tokenizer_json(tokenizer, Path(source)):
        log.info("%s tokenizes differently from %s/tokenizer.json; using tokenizer.json as is",
                 type(tokenizer).__name__, source)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(source, **kwargs)
    return _finish_tokenizer(tokenizer, cfg)


def _finish_tokenizer(tokenizer: Any, cfg: ModelConfig) -> Any:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    set_chat_template(tokenizer, cfg.chat_template)
    check_end_of_turn(tokenizer)
    return tokenizer


def _gguf_file(cfg: ModelConfig) -> Path | None:
    """The .gguf file `cfg` names (model.path or model.gguf_file), or None for a folder / hub id."""
    return gguf_source(cfg.path, cfg.gguf_file)


def _load_gguf_tokenizer(file: Path) -> Any:
    """The tokenizer transformers builds from a GGUF's metadata; there is no tokenizer.json to
    compare it with, so the whitespace round trip is its check."""
    tokenizer = load_gguf_tokenizer(file)
    check_tokenizer(tokenizer, str(file))
    ids = tokenizer(_ROUND_TRIP_PROBE, add_special_tokens=False)["input_ids"]
    if tokenizer.decode(ids) != _ROUND_TRIP_PROBE:
        raise RlftError(f"the tokenizer built from {file} does not give back the text it encodes "
                        f"({_ROUND_TRIP_PROBE!r} -> {tokenizer.decode(ids)!r}), so prompts would not be what the "
                        "data says.\nFix: set model.tokenizer_path to a folder with the model's own tokenizer files")
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


@dataclass(frozen=True)
class QuantizedBase:
    """Where a quantised base came from: an export of its adapter records it (`ADAPTER_BASE_RECORD`),
    so the trained model can be rebuilt exactly: this base, loaded the same way, plus the adapter."""

    path: str
    revision: str | None
    quantization: str


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, or a peft PeftModel under LoRA
    tokenizer: Any
    device: torch.device
    is_lora: bool
    # A distributed run trains `model` sharded across ranks; `mirror` is a whole copy of it on each
    # rank, kept in sync, that samples rollouts and is saved (None in a single process).
    mirror: "LoadedModel | None" = None
    quantized_base: QuantizedBase | None = None  # model.quantization=4bit: the base stays quantised

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def unsharded(self) -> "LoadedModel":
        """The model with whole weights: the mirror of a sharded run, else this one."""
        return self.mirror if self.mirror is not None else self

    def make_mirror(self) -> None:
        """Keep a whole copy before the model is sharded (see `mirror`)."""
        self.mirror = LoadedModel(copy.deepcopy(self.model), self.tokenizer, self.device, self.is_lora,
                                  quantized_base=self.quantized_base)


BITSANDBYTES_MIN = "0.43"  # 4-bit layers that move between devices and serialise (transformers' own floor)


def check_4bit_support(device: torch.device) -> None:
    """One RlftError naming every missing piece when model.quantization=4bit cannot work here:
    bitsandbytes' NF4 layers need the package and a CUDA GPU. Checked before any weight loads."""
    import importlib.metadata
    import importlib.util

    problems = []
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append("bitsandbytes is not installed")
    else:
        version = importlib.metadata.version("bitsandbytes")
        if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < (0, 43):
            problems.append(f"bitsandbytes {version} is older than {BITSANDBYTES_MIN}")
    if device.type != "cuda":
        problems.append(f"model.device resolves to {device.type}, and bitsandbytes' 4-bit training runs on CUDA GPUs")
    if problems:
        raise RlftError("model.quantization=4bit needs bitsandbytes on a CUDA GPU: " + "; ".join(problems) + "\n"
                        "Fix: pip install 'rlft[qlora]' on a machine with a CUDA GPU, or set model.quantization=none")


def check_quantization(cfg: ModelConfig, lora: LoraConfig, device: torch.device) -> None:
    if cfg.quantization == "none":
        return
    if not lora.enabled:
        raise ConfigError("model.quantization=4bit: 4-bit weights cannot be trained directly; set lora.enabled: true")
    check_4bit_support(device)


def bnb_4bit_config() -> Any:
    """QLoRA's storage (Dettmers et al. 2023, arXiv:2305.14314): NF4 weights with double-quantised
    block constants, matmuls computed in bf16."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_use_double_quant=True)


def load_causal_lm(cfg: ModelConfig, device: torch.device, dtype: torch.dtype | None = None,
                   field: str = "model.path", folder_checked: bool = False) -> Any:
    """`field`: the config field `cfg.path` came from, named in errors (`teacher.path` for a teacher).
    `folder_checked`: the caller ran `check_model_folder` already (it reads every weight file's header)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                                  dtype=dtype or resolve_dtype(cfg.dtype, device))
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    gguf = _gguf_file(cfg)
    if gguf is not None:
        if cfg.quantization != "none":
            raise ConfigError(f"model.quantization={cfg.quantization} loads a model folder through bitsandbytes, and "
                              f"model.path {cfg.path!r} is a GGUF.\nFix: rlft import-model {cfg.path} FOLDER, then "
                              "model.path=FOLDER")

        model = load_gguf_model(gguf, kwargs["dtype"], device)
        check_causal_lm(model, {}, cfg.path, field)
        return model
    if cfg.quantization == "4bit":
        check_4bit_support(device)
        # bitsandbytes places the quantised weights as they load; a 4-bit model is not moved afterwards
        index = device.index if device.index is not None else torch.cuda.current_device()
        kwargs.update(quantization_config=bnb_4bit_config(), device_map={"": index})
    if not folder_checked:
        check_model_folder(cfg.path, field)
    source = hub_source(cfg.path, cfg.revision, field)
    check_not_classifier(saved_architectures(source), cfg.path, field)  # before its weights load
    try:
        model, info = AutoModelForCausalLM.from_pretrained(source, output_loading_info=True,
                                                           **kwargs)
    except RlftError:
        raise
    except Exception as exc:  # noqa: BLE001  (safetensors, torch.load and config errors have many types)
        raise RlftError(f"could not load a causal LM from {cfg.path!r}: {type(exc).__name__}: {exc}\n"
                        f"Fix: {field} must be a local checkpoint folder or a reachable hub id") from None
    if cfg.quantization == "none":
        model = model.to(device)
    check_causal_lm(model, info, cfg.path, field)
    return model


def load_policy(cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype | None = None,
                field: str = "model.path") -> LoadedModel:
    """`dtype`: the weights' dtype training resolved (models/precision.py); default model.dtype.
    `field`: the config field `cfg.path` came from, named in errors (a teacher loads through here)."""
    device = resolve_device(cfg.device)
    check_quantization(cfg, lora, device)
    if _gguf_file(cfg) is None:  # (a GGUF source is checked there)
        # before the tokenizer: a wrong folder is named as such, not as a tokenizer problem
        check_model_folder(cfg.path, field)
    tokenizer = load_tokenizer(cfg, field)
    check_template(cfg.path, tokenizer, cfg.allow_template_change)
    model = load_causal_lm(cfg, device, dtype, field, folder_checked=True)
    check_tokenizer(tokenizer, cfg.tokenizer_path or cfg.path, model.get_input_embeddings().num_embeddings)
    if cfg.quantization == "4bit":
        from peft import prepare_model_for_kbit_training

        # freezes the base and upcasts its unquantised weights (norms, embeddings, output head) to fp32
        # for stable training; with use_reentrant=False no input needs requires_grad for checkpointing
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora.enabled:
        model = apply_lora(model, lora)
    base = None if cfg.quantization == "none" else QuantizedBase(cfg.path, cfg.revision, cfg.quantization)
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, is_lora=lora.enabled, quantized_base=base)


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

    if cfg.quantization != "none":
        raise ConfigError(f"model.quantization={cfg.quantization} is for causal-LM policies (sft, dpo and the online "
                          "methods); reward-model training loads a sequence classifier, which rlft does not "
                          "quantise. Set model.quantization=none")
    device = resolve_device(cfg.device)
    if _gguf_file(cfg) is not None:
        raise RlftError(f"reward-model training reads a model folder, and model.path {cfg.path!r} is a GGUF.\n"
                        f"Fix: rlft import-model {cfg.path} FOLDER"
                        f"{f' --gguf-file {cfg.gguf_file}' if cfg.gguf_file else ''}, then model.path=FOLDER")
    check_model_folder(cfg.path)
    tokenizer = load_tokenizer(cfg)
    check_template(cfg.path, tokenizer, cfg.allow_template_change)
    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                                  dtype=dtype or resolve_dtype(cfg.dtype, device), num_labels=1)
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            hub_source(cfg.path, cfg.revision, "model.path"), **kwargs)
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


ADAPTER_BASE_RECORD = "adapter_base.json"


def export_model(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write a merged Hugging Face checkpoint (and the peft adapter under LoRA) with tokenizer,
    chat template and template record. Under LoRA the adapters are merged in place, so call this
    when training is over; `loaded` then holds the merged model.

    A quantised base (model.quantization=4bit) is not merged: see `export_adapter`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if loaded.quantized_base is not None:
        return export_adapter(loaded, out)
    model = loaded.model
    if loaded.is_lora:
        _absolute_adapter_base(model)
        model.save_pretrained(out / "adapter")
        loaded.tokenizer.save_pretrained(out / "adapter")
        model = model.merge_and_unload()
        loaded.model, loaded.is_lora = model, False
    model.config.use_cache = True  # gradient checkpointing turns it off for training
    model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    write_template_record(out, loaded.tokenizer)
    return out


def _absolute_adapter_base(model: Any) -> None:
    """adapter_config.json names its base model as it was loaded; a relative folder would make the
    adapter loadable only from the directory the run started in (a hub id stays an id)."""
    for peft_config in getattr(model, "peft_config", {}).values():
        if peft_config.base_model_name_or_path:
            peft_config.base_model_name_or_path = existing(peft_config.base_model_name_or_path)


def export_adapter(loaded: LoadedModel, out: Path) -> Path:
    """The export of LoRA on a 4-bit base: `out/adapter/` (peft), the tokenizer and template record
    in `out/`, and `out/adapter_base.json` naming the base and how it was loaded.

    Merging is refused on purpose. Merging into NF4 weights means dequantise, add, re-quantise, and
    NF4's step (16 levels spanning each 64-weight block: about an eighth of the block's largest
    weight) is far larger than a typical LoRA update, so most of the training would be rounded
    away. Merging into the original full-precision weights gives a model the adapter was not
    trained against (it learned on the quantised base). The adapter on the same 4-bit base is
    exactly the trained model; `load_adapter_export` (and so `rlft eval RUN`) rebuilds it."""
    import json

    base = loaded.quantized_base
    local = Path(base.path).expanduser()
    path = str(local.resolve()) if local.exists() else base.path  # a hub id stays an id
    _absolute_adapter_base(loaded.model)
    loaded.model.save_pretrained(out / "adapter")
    loaded.tokenizer.save_pretrained(out / "adapter")
    loaded.tokenizer.save_pretrained(out)
    write_template_record(out, loaded.tokenizer)
    (out / ADAPTER_BASE_RECORD).write_text(json.dumps(
        {"base": path, "revision": base.revision, "quantization": base.quantization,
         "note": "LoRA adapter trained on this base loaded in 4-bit (NF4); not merged. Load the base with "
                 "model.quantization=4bit and apply adapter/ with peft."}, indent=2))
    log.warning("model.quantization=%s: %s holds the LoRA adapter only (adapter/); its base stays %s, loaded in "
                "4-bit as in training. Merging into 4-bit weights would round most of the update away, so it is "
                "not done; `rlft eval` loads base + adapter from %s", base.quantization, out, path,
                ADAPTER_BASE_RECORD)
    return out


def is_adapter_export(folder: str | Path) -> bool:
    """An export of LoRA on a quantised base (`export_adapter`): no merged weights, an adapter."""
    folder = Path(folder)
    return (folder / ADAPTER_BASE_RECORD).is_file() and not (folder / "config.json").is_file()


def load_adapter_export(folder: str | Path, device: str = "auto") -> LoadedModel:
    """The trained model of an `export_adapter` folder, for generation: its recorded base, loaded as
    in training (4-bit), with the adapter applied; the tokenizer is the folder's own."""
    import json

    from peft import PeftModel

    folder = Path(folder)
    record = json.loads((folder / ADAPTER_BASE_RECORD).read_text())
    cfg = ModelConfig(path=record["base"], revision=record.get("revision"), tokenizer_path=str(folder),
                      quantization=record["quantization"], device=device)
    resolved = resolve_device(device)
    if cfg.quantization != "none":
        check_4bit_support(resolved)
    tokenizer = load_tokenizer(cfg)
    base = load_causal_lm(cfg, resolved)
    model = PeftModel.from_pretrained(base, str(folder / "adapter")).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, device=resolved, is_lora=True,
                       quantized_base=QuantizedBase(cfg.path, cfg.revision, cfg.quantization))
