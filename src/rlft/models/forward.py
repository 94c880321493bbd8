"""Forward passes that return only what the losses need: per-token log-probs (and entropy, and the
hidden state a value head reads) of the target tokens, never a `[B, T, V]` float32 tensor.

How: the decoder without its head (`model.model`, through peft's base model under LoRA) gives the
last hidden states; the states that predict target tokens are picked (so prompt and padding
positions never reach the head), and `head_logprobs.token_logprobs_and_entropy` computes log-probs
from them in chunks of tokens, recomputing each chunk's logits in backward. A head that is not a
plain `nn.Linear` (LoRA on lm_head) gets its logits from the module itself and a plain chunked
log-softmax. A model whose own logits are not head(last hidden state) as understood here is
detected once (a probe on 8 tokens) and served by its full forward instead.

With `packing`, the rows go through the decoder padding-free (`packing.pack_rows`): same numbers,
no pad token computed. Packing is used only where a probe confirmed that packed rows do not
attend to each other in this model. With `shared_prefix` ('auto' or 'on'), rows that share a
prompt are computed with one copy of it (`shared_prefix.share_prefixes`), where a probe confirmed
that the model honours the layout's 4D attention mask. Inside `compiled.compiled_forwards()`
(`training.compile`) the decoder's layers run compiled; the probes always run eagerly.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from rlft.models.compiled import compiled_layers, note_not_compiled
from rlft.models.head_logprobs import plain_token_logprobs_and_entropy, token_logprobs_and_entropy
from rlft.models.packing import MULTI_ROW, pack_rows
from rlft.models.shared_prefix import AttentionCost, SharedRows, mask_kind, share_prefixes, window_allows

log = logging.getLogger(__name__)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding, so a padded row computes what the unpadded row would."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int = 0,
                   hidden: bool = False):
    """Logits `[B, keep, V]` for the last `keep` positions (all positions when keep == 0); with
    `hidden`, also the last hidden state of those positions `[B, keep, H]`. The plain path."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask),
                use_cache=False, logits_to_keep=keep, output_hidden_states=hidden)
    if not hidden:
        return out.logits
    last = out.hidden_states[-1]
    return out.logits, (last[:, -keep:] if keep else last)


def selected_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position: `[B, T, V], [B, T] -> [B, T]` float32."""
    flat = logits.reshape(-1, logits.shape[-1])
    return plain_token_logprobs_and_entropy(flat, targets.reshape(-1), temperature=temperature)[0].view(targets.shape)


# ---------------------------------------------------------------------------------------------
# The model's head, found and checked once per model object


@dataclass(frozen=True)
class LmHead:
    decoder: Any  # the model without its head: forward(...).last_hidden_state  # [B, T, H]
    module: nn.Module  # the output projection, as the model calls it
    softcap: float | None  # Gemma-2 final_logit_softcapping
    scale: float  # multiplies the logits (Cohere logit_scale, Granite 1 / logits_scaling)
    packing: str | None  # 'multi' (bins of rows), 'single' (one sequence) or None (not supported)

    @property
    def fused(self) -> bool:
        return type(self.module) is nn.Linear  # a peft LoRA layer or other wrapper is not

    def logprobs(self, states: Tensor, targets: Tensor, temperature: float, entropy: str) -> tuple[Tensor, Tensor | None]:
        """`[n, H], [n] -> [n], [n] | None` float32"""
        if self.fused:
            return token_logprobs_and_entropy(states, self.module.weight, targets, bias=self.module.bias,
                                              temperature=temperature, softcap=self.softcap, scale=self.scale,
                                              entropy=entropy)
        return plain_token_logprobs_and_entropy(self.post(self.module(states).float()), targets,
                                                temperature=temperature, entropy=entropy)

    def post(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


_HEADS: "weakref.WeakKeyDictionary[Any, LmHead | None]" = weakref.WeakKeyDictionary()


def lm_head(model: Any) -> LmHead | None:
    """The decoder/head split of `model` (a transformers causal LM, or a peft model around one),
    checked against the model's own forward on first use; None when the split is unknown or wrong
    (the full-forward path is then used)."""
    if model not in _HEADS:
        _HEADS[model] = _find_head(model)
    return _HEADS[model]


def _find_head(model: Any) -> LmHead | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if _is_sharded(base):
        # FSDP2 gathers the root's parameters (the embedding, the head) in the root module's forward
        # hook; calling the decoder and the head separately would skip it
        log.info("%s is sharded (FSDP): log-probs use the model's full logits", type(base).__name__)
        return None
    try:
        module, decoder = base.get_output_embeddings(), base.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        module = decoder = None
    if not isinstance(module, nn.Module) or decoder is None or decoder is base:
        log.info("%s: no separate decoder and lm_head found; log-probs use the model's full logits",
                 type(base).__name__)
        return None
    cfg = base.config
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    head = LmHead(decoder, module, getattr(cfg, "final_logit_softcapping", None) or None, scale, None)
    with _probing(model):
        if not _head_matches(model, head):
            log.warning("%s: its logits are not lm_head(last hidden state) as rlft computes them (an unknown "
                        "logit scaling?); log-probs use the model's full logits (more memory)", type(base).__name__)
            return None
        mode = _packing_mode(model, decoder)
    return LmHead(head.decoder, head.module, head.softcap, head.scale, mode)


def _is_sharded(model: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _packing_mode(model: Any, decoder: Any) -> str | None:
    """How `decoder` takes packed rows ('multi', 'single'), or None where a probe shows that packed
    rows would attend to each other (call inside `_probing`)."""
    impl = getattr(decoder.config, "_attn_implementation", None) or "eager"
    mode = "multi" if impl in MULTI_ROW else "single" if "flash" in str(impl) else None
    if mode and not _packing_isolates_rows(model, decoder, mode):
        log.warning("%s (attention %s): packed rows attend to each other; padding-free forwards are off for this "
                    "model", type(decoder).__name__, impl)
        mode = None
    return mode


class _probing:
    """no_grad, eval mode (no dropout), autocast off; every module's training flag restored after."""

    def __init__(self, model: Any):
        self.model = model

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        self.stack = [torch.no_grad(), torch.autocast(_device(self.model).type, enabled=False)]
        for ctx in self.stack:
            ctx.__enter__()

    def __exit__(self, *exc):
        for ctx in reversed(self.stack):
            ctx.__exit__(*exc)
        for m, flag in self.flags:
            m.training = flag


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal up to the rounding of the model's dtype (1e-3 relative in float32: a missing softcap or
    scale on a real model's logits is off by far more)."""
    tol = 1e-3 if a.dtype in (torch.float32, torch.float64) else 5e-2
    a, b = a.float(), b.float()
    return bool((a - b).abs().max() <= tol * max(1.0, float(b.abs().max())))


def _probe_ids(model: Any, n: int) -> Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    return (torch.arange(n, device=_device(model)) * 7 + 3)[None] % vocab  # [1, n]


def _head_matches(model: Any, head: LmHead) -> bool:
    ids = _probe_ids(model, 8)
    full = model(input_ids=ids, use_cache=False).logits  # [1, 8, V]
    mine = head.post(head.module(head.decoder(input_ids=ids, use_cache=False).last_hidden_state).float())
    return mine.shape == full.shape and _close(mine, full)


def _packing_isolates_rows(model: Any, decoder: Any, mode: str) -> bool:
    """Rows of 3, 2 and 6 tokens packed give what each gives alone. In bins ('multi') the 6-token
    row fills one bin and the other two share the second with a 1-token dummy tail."""
    ids = _probe_ids(model, 11)[0]
    rows = [ids[:3], ids[3:5], ids[5:]]
    batch = torch.zeros(3, 6, dtype=torch.long, device=ids.device)
    mask = torch.zeros_like(batch)
    for i, r in enumerate(rows):
        batch[i, :len(r)], mask[i, :len(r)] = r, 1
    packed = pack_rows(batch, mask, multi_row=mode == "multi")
    try:
        out = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).last_hidden_state
    except Exception as exc:  # an architecture that refuses position ids without a mask
        log.info("packed forward failed: %s", exc)
        return False
    flat = out.reshape(-1, out.shape[-1])
    for i, r in enumerate(rows):
        alone = decoder(input_ids=r[None], use_cache=False).last_hidden_state[0]
        if not _close(flat[packed.flat_index[i, :len(r)]], alone):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Per-token outputs


class TokenOutputs(NamedTuple):
    logprobs: Tensor  # [B, T] float32: log p(token t | tokens < t) where target_mask[:, t], else 0
    entropy: Tensor | None  # [B, T] float32: entropy of that distribution, else 0
    hidden: Tensor | None  # [B, T, H]: the last hidden state that predicted token t, else 0


def token_outputs(model: Any, input_ids: Tensor, attention_mask: Tensor, target_mask: Tensor, *,
                  temperature: float = 1.0, entropy: str = "none", hidden: bool = False,
                  packing: bool = False, shared_prefix: str = "off", prompt_width: int = 0) -> TokenOutputs:
    """Log-probs (and entropy, hidden states) of the tokens marked in `target_mask` `[B, T]`; a
    token is predicted from the position before it, so column 0 is never a target. `packing`:
    run the decoder padding-free where the model supports it (same numbers). `shared_prefix`
    ('auto', 'on', 'off'): rows whose first `prompt_width` columns (a left-padded prompt) hold the
    same prompt compute it once (same numbers)."""
    targets_at = target_mask.bool().clone()
    targets_at[:, 0] = False
    predict_at = torch.zeros_like(targets_at)
    predict_at[:, :-1] = targets_at[:, 1:]  # [B, T]: positions whose next token is a target
    targets = input_ids[targets_at]  # [n], row-major like predict_at's positions
    head = lm_head(model)
    shared = None
    if shared_prefix != "off":
        module = model if head is None else head.decoder
        shared = shared_layout(model, module, _decoder_run(module) if head else logits_run(model), input_ids,
                               attention_mask, prompt_width, shared_prefix)
    if head is None:
        note_not_compiled(model, "log-probs come from the model's own full forward (see the log above)")
        full = _full_forward_outputs if shared is None else _full_forward_shared
        lp, ent, states = full(model, input_ids if shared is None else shared, attention_mask, predict_at, targets,
                               temperature, entropy, hidden)
    else:
        if shared is not None:
            layout, mask = shared
            out = _decoder_states(head.decoder, input_ids=layout.input_ids, attention_mask=mask,
                                  position_ids=layout.position_ids)  # [bins, L, H]
            states = _gather(out, layout.flat_index[predict_at])  # [n, H]
        else:
            states = _states_at(head, input_ids, attention_mask, predict_at, packing)  # [n, H]
        lp, ent = head.logprobs(states, targets, temperature, entropy)
    shape = tuple(target_mask.shape)
    out_lp = lp.new_zeros(shape).masked_scatter(targets_at, lp)
    out_ent = None if ent is None else ent.new_zeros(shape).masked_scatter(targets_at, ent)
    out_h = None
    if hidden:
        out_h = states.new_zeros(shape + (states.shape[-1],)).masked_scatter(targets_at[..., None], states)
    return TokenOutputs(out_lp, out_ent, out_h)


def _states_at(head: LmHead, input_ids: Tensor, attention_mask: Tensor, select: Tensor, packing: bool) -> Tensor:
    """Last hidden states at the positions in `select` `[B, T]` -> `[n, H]`, row-major."""
    if packing and head.packing:
        packed = pack_rows(input_ids, attention_mask, multi_row=head.packing == "multi")
        states = _decoder_states(head.decoder, input_ids=packed.input_ids,
                                 position_ids=packed.position_ids)  # [bins, L, H]
        return _gather(states, packed.flat_index[select])
    states = _decoder_states(head.decoder, input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids_for(attention_mask))  # [B, T, H]
    return states[select]


def _decoder_states(decoder: Any, **inputs: Tensor) -> Tensor:
    """The decoder's last hidden states for the training forwards (compiled layers inside
    `compiled_forwards()`)."""
    with compiled_layers(decoder):
        return decoder(**inputs, use_cache=False).last_hidden_state


def _gather(states: Tensor, index: Tensor) -> Tensor:
    """`[bins, L, X]` states at flat positions `index` `[n]` -> `[n, X]` (a position gathered twice,
    as a shared prompt's last token is, gets the sum of both gradients)."""
    if bool((index < 0).any()):
        raise ValueError("a target token is predicted from a padding position; targets must follow real tokens")
    return states.reshape(-1, states.shape[-1])[index]


def _full_forward_shared(model: Any, shared: tuple[SharedRows, Tensor], attention_mask: Tensor, predict_at: Tensor,
                         targets: Tensor, temperature: float, entropy: str, hidden: bool):
    """The model's own logits on the shared-prompt layout, for the predicting positions only."""
    layout, mask = shared
    index = layout.flat_index[predict_at]  # [n]
    width = layout.input_ids.shape[1]
    cols = torch.unique(index % width)  # sorted: the layout's columns where some bin predicts a target
    out = model(input_ids=layout.input_ids, attention_mask=mask, position_ids=layout.position_ids, use_cache=False,
                logits_to_keep=cols, output_hidden_states=hidden)
    kept = (index // width) * cols.numel() + torch.searchsorted(cols, index % width)
    lp, ent = plain_token_logprobs_and_entropy(_gather(out.logits, kept), targets, temperature=temperature,
                                               entropy=entropy)
    return lp, ent, (_gather(out.hidden_states[-1], index) if hidden else None)


def _decoder_run(decoder: Any):
    return lambda ids, mask, pos: decoder(input_ids=ids, attention_mask=mask, position_ids=pos,
                                          use_cache=False).last_hidden_state


def logits_run(model: Any):
    """(ids, mask, positions) -> the model's own logits, for `shared_layout`'s probe."""
    return lambda ids, mask, pos: model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


def shared_layout(model: Any, module: Any, run: Any, input_ids: Tensor, attention_mask: Tensor, prompt_width: int,
                  mode: str) -> tuple[SharedRows, Tensor] | None:
    """The shared-prompt layout of a batch and its 4D attention mask for `module` (the decoder, or
    the whole `model`), or None where the plain layout is to be used: the module fails the probe
    (`run(ids, mask, positions) -> [b, L, X]` runs it; first use, on every rank alike), a sliding
    window could bite, no two rows share a prompt, or (mode 'auto') the plain layout costs less."""
    if mode not in ("auto", "on"):
        return None
    kind = mask_kind(module, run, model.get_input_embeddings().weight.shape[0], _device(model), lambda: _probing(model))
    config = getattr(module, "config", None)
    if kind is None or prompt_width <= 0 or not window_allows(config, int(attention_mask.sum(-1).max())):
        return None
    cost = AttentionCost.of(config) if mode == "auto" else None
    layout = share_prefixes(input_ids, attention_mask, prompt_width, cost)
    return None if layout is None else (layout, layout.attention_mask(kind))


def _full_forward_outputs(model: Any, input_ids: Tensor, attention_mask: Tensor, predict_at: Tensor, targets: Tensor,
                          temperature: float, entropy: str, hidden: bool):
    """The model's own logits for the columns from the first predicting position on (padded batch)."""
    cols = predict_at.any(0).nonzero()
    first = int(cols[0]) if cols.numel() else input_ids.shape[1] - 1
    keep = input_ids.shape[1] - first
    out = forward_logits(model, input_ids, attention_mask, keep=keep, hidden=hidden)
    logits, states = out if hidden else (out, None)
    sel = predict_at[:, first:]
    lp, ent = plain_token_logprobs_and_entropy(logits[sel], targets, temperature=temperature, entropy=entropy)
    return lp, ent, (states[sel] if hidden else None)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float = 1.0, entropy: str = "none", hidden: bool = False, packing: bool = False,
                        shared_prefix: str = "off"):
    """Log-probs of the last `completion_len` tokens of each row (the completion region of a
    `[left-padded prompt | right-padded completion]` batch): `[B, Tc]` (0 on padding), plus the
    entropy per position when `entropy` is 'metric' (no gradient) or 'grad' (for an entropy bonus),
    plus the hidden states `[B, Tc, H]` of the positions that predicted them when `hidden` (a value
    head). `shared_prefix`: rows with the same prompt compute it once ('auto', 'on', 'off')."""
    tc = completion_len
    target_mask = torch.zeros_like(attention_mask, dtype=torch.bool)
    target_mask[:, -tc:] = attention_mask[:, -tc:].bool()
    out = token_outputs(model, input_ids, attention_mask, target_mask, temperature=temperature, entropy=entropy,
                        hidden=hidden, packing=packing, shared_prefix=shared_prefix,
                        prompt_width=input_ids.shape[1] - tc)
    ent = None if out.entropy is None else out.entropy[:, -tc:]
    if hidden:
        return out.logprobs[:, -tc:], ent, out.hidden[:, -tc:]
    return out.logprobs[:, -tc:], ent


_SCORERS: "weakref.WeakKeyDictionary[Any, tuple[Any, Any, str] | None]" = weakref.WeakKeyDictionary()


def packed_sequence_scores(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor | None:
    """A sequence classifier's (decoder + `score` head, as transformers' `...ForSequenceClassification`)
    logits at each row's last real token, from a padding-free forward  # [N, num_labels]; None when
    the model is not built that way or cannot take packed rows (use its own forward then)."""
    if model not in _SCORERS:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
        score = getattr(base, "score", None)
        found = None
        if isinstance(decoder, nn.Module) and isinstance(score, nn.Module) and not _is_sharded(base):
            with _probing(model):
                mode = _packing_mode(model, decoder)
            found = (decoder, score, mode) if mode else None
        _SCORERS[model] = found
    if _SCORERS[model] is None:
        return None
    decoder, score, mode = _SCORERS[model]
    packed = pack_rows(input_ids, attention_mask, multi_row=mode == "multi")
    states = _decoder_states(decoder, input_ids=packed.input_ids, position_ids=packed.position_ids)  # [bins, L, H]
    first, lengths = attention_mask.long().argmax(-1), attention_mask.sum(-1)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    last = packed.flat_index[rows, first + lengths - 1]  # [N]
    return score(states.reshape(-1, states.shape[-1])[last])


def sft_token_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor,
                  packing: bool = False) -> torch.Tensor:
    """Summed NLL of the target tokens (`target_mask[:, t]` marks token t as a target)."""
    return -token_outputs(model, input_ids, attention_mask, target_mask, packing=packing).logprobs.sum()
