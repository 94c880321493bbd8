"""Log-probs and entropy of chosen tokens straight from the last hidden states, never holding a
`[tokens, V]` logits tensor: the logits are computed block by block (tokens x vocabulary slices).

With a 151,936-token vocabulary, `[rows, T, V]` float32 logits are the largest tensor of an RL
step, and autograd keeps them (and the log-softmax's output) until backward. Here a custom
autograd function walks the logits in blocks: forward keeps only each token's log-sum-exp and
entropy (an online log-sum-exp over vocabulary slices); backward recomputes each block's logits
from the saved hidden states and head weight. Saved: `hidden [M, H]`, a reference to the weight,
and `[M]` vectors.

Blocks are vocabulary slices over a token chunk of up to `TOKEN_CHUNK` tokens, sized so one block
holds about `BLOCK_ELEMENTS` logits. Slicing the vocabulary rather than the tokens keeps every
matmul large in its reduced dimension and writes each slice of the weight gradient once per token
chunk (a token-only split would add a full `[V, H]` product into the gradient for every chunk).

Maths, per token with logits z (after the head's own post-processing and 1/temperature):
    logp_t = z_t - lse(z);  d logp_t / dz = onehot(t) - p
    H = -sum_j p_j log p_j;  dH / dz = -p * (log p + H)
    online over slices, in coordinates shifted by the running max m:
    s = sum exp(z - m), u = sum exp(z - m) (z - m)  ->  lse = m + log s, H = log s - u / s
Post-processing handled here (what the architectures in transformers apply after lm_head): a
multiplicative `scale` (Cohere's `logit_scale`, Granite's 1 / `logits_scaling`) and Gemma-2's
`final_logit_softcapping` cap * tanh(z / cap), whose derivative is 1 - tanh^2.

Precision: the matmuls run in the autocast dtype when autocast is on for the hidden states'
device (else in the inputs' common dtype), as `nn.Linear` would under autocast; the softmax maths,
the returned values and the gradient accumulators are float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK_ELEMENTS = 1 << 23  # logits per block: 32 MiB in float32
TOKEN_CHUNK = 4096  # tokens per chunk: the weight gradient is accumulated once per chunk


def block_shape(tokens: int, vocab: int, elements: int = BLOCK_ELEMENTS) -> tuple[int, int]:
    """(tokens per chunk, vocabulary slice) for a [tokens, vocab] logits matrix."""
    chunk = max(1, min(tokens, TOKEN_CHUNK))
    return chunk, max(1, min(vocab, elements // chunk))


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The matmul dtype `nn.Linear` would use here: autocast's when it is on, else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _acc_dtype(cd: torch.dtype) -> torch.dtype:
    """Softmax maths in float32; float64 stays float64 (exactness tests, gradcheck)."""
    return torch.float64 if cd == torch.float64 else torch.float32


class _Head:
    """The head's weight/bias in the compute dtype and the logits post-processing."""

    def __init__(self, weight: Tensor, bias: Tensor | None, cd: torch.dtype, temperature: float,
                 softcap: float | None, scale: float):
        self.w, self.b = weight.to(cd), None if bias is None else bias.to(cd)
        self.cd, self.acc = cd, _acc_dtype(cd)
        self.temperature, self.softcap, self.scale = temperature, softcap, scale

    def logits(self, h: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor | None]:
        """(post-processed logits [c, v1 - v0] in the accumulation dtype, tanh(z / cap) or None)"""
        w = self.w[v0:v1]
        z = h @ w.t() if self.b is None else torch.addmm(self.b[v0:v1], h, w.t())
        z = z.to(self.acc)
        if self.scale != 1.0:
            z.mul_(self.scale)
        capped = None
        if self.softcap:
            capped = z.div_(self.softcap).tanh_()
            z = capped * self.softcap
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z, capped

    def chain(self, dz: Tensor, capped: Tensor | None) -> Tensor:
        """d/d(raw logits) from d/d(post-processed logits), in place."""
        if self.temperature != 1.0:
            dz.div_(self.temperature)
        if capped is not None:
            dz.mul_(1.0 - capped.square_())
        if self.scale != 1.0:
            dz.mul_(self.scale)
        return dz


def _pick_targets(z: Tensor, targets: Tensor, v0: int, v1: int, out: Tensor) -> None:
    """out[i] = z[i, targets[i] - v0] for the targets inside this vocabulary slice."""
    inside = (targets >= v0) & (targets < v1)
    if bool(inside.any()):
        rows = inside.nonzero().squeeze(-1)
        out[rows] = z[rows, targets[rows] - v0]


def _forward_chunk(head: _Head, h: Tensor, targets: Tensor, vb: int, entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs, lse, entropy) of one token chunk by an online log-sum-exp over vocab slices."""
    c, vocab = h.shape[0], head.w.shape[0]
    picked = torch.zeros(c, dtype=head.acc, device=h.device)
    lse = m = s = u = None
    for v0 in range(0, vocab, vb):
        v1 = min(v0 + vb, vocab)
        z, _ = head.logits(h, v0, v1)  # [c, vb]
        _pick_targets(z, targets, v0, v1, picked)
        if not entropy:  # log-sum-exp alone: fused kernels, no running sums needed
            block = torch.logsumexp(z, dim=-1)
            lse = block if lse is None else torch.logaddexp(lse, block)
            continue
        block_max = z.max(-1).values
        m_new = block_max if m is None else torch.maximum(m, block_max)
        z.sub_(m_new[:, None])  # z - m_new
        e = z.exp()
        block_s, block_u = e.sum(-1), (e * z).sum(-1)
        if m is None:
            s, u = block_s, block_u
        else:
            shift = m - m_new  # <= 0: rescale the running sums to the new max
            alpha = shift.exp()
            u = alpha * (u + shift * s) + block_u
            s = alpha * s + block_s
        m = m_new
    if not entropy:
        return picked - lse, lse, torch.zeros_like(lse)
    log_s = s.log()
    lse = m + log_s
    return picked - lse, lse, log_s - u / s


class _HeadLogprobs(torch.autograd.Function):
    """(hidden [M, H], weight [V, H], bias [V] | None, targets [M]) -> (logprobs [M], entropy [M])"""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, scale, entropy_mode, blocks, cd):
        m = hidden.shape[0]
        chunk, vb = blocks
        with torch.autocast(hidden.device.type, enabled=False):  # explicit dtypes below
            head = _Head(weight, bias, cd, temperature, softcap, scale)
            logprobs = torch.empty(m, dtype=head.acc, device=hidden.device)
            entropy = torch.zeros(m, dtype=head.acc, device=hidden.device)
            lse_all = torch.empty(m, dtype=head.acc, device=hidden.device)
            for s in range(0, m, chunk):
                lp, lse, ent = _forward_chunk(head, hidden[s:s + chunk].to(cd), targets[s:s + chunk], vb,
                                              entropy_mode != "none")
                logprobs[s:s + chunk], lse_all[s:s + chunk], entropy[s:s + chunk] = lp, lse, ent
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all, entropy)
        ctx.settings = (temperature, softcap, scale, entropy_mode, blocks, cd)
        ctx.set_materialize_grads(False)
        if entropy_mode != "grad":
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logprobs, g_entropy):
        hidden, weight, bias, targets, lse_all, entropy = ctx.saved_tensors
        temperature, softcap, scale, entropy_mode, (chunk, vb), cd = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if entropy_mode != "grad":
            g_entropy = None
        if g_logprobs is None and g_entropy is None:
            return (None,) * 10
        m, vocab = hidden.shape[0], weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            head = _Head(weight, bias, cd, temperature, softcap, scale)
            acc = head.acc
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
            grad_b = torch.zeros(vocab, dtype=acc, device=weight.device) if need_b else None
            for s in range(0, m, chunk):
                e = min(s + chunk, m)
                h = hidden[s:e].to(cd)
                t = targets[s:e]
                g_lp = torch.zeros(e - s, dtype=acc, device=h.device) if g_logprobs is None else g_logprobs[s:e].to(acc)
                # d/dz of (g_lp * logp_t + g_ent * H) = p * (c1 * logp + c2) + g_lp * onehot(t),
                # with c1 = -g_ent and c2 = -(g_ent * H + g_lp)
                if g_entropy is not None:
                    g_ent = g_entropy[s:e].to(acc)
                    c1, c2 = -g_ent[:, None], -(g_ent * entropy[s:e] + g_lp)[:, None]
                else:
                    c1, c2 = None, -g_lp[:, None]
                dh = torch.zeros(h.shape, dtype=acc, device=h.device) if need_h else None
                for v0 in range(0, vocab, vb):
                    v1 = min(v0 + vb, vocab)
                    z, capped = head.logits(h, v0, v1)
                    logp = z.sub_(lse_all[s:e, None])  # [c, vb]
                    p = logp.exp()
                    dz = p.mul_(logp.mul_(c1).add_(c2)) if c1 is not None else p.mul_(c2)
                    inside = (t >= v0) & (t < v1)
                    if bool(inside.any()):
                        rows = inside.nonzero().squeeze(-1)
                        dz[rows, t[rows] - v0] += g_lp[rows]
                    dz = head.chain(dz, capped)
                    dz_c = dz.to(cd)
                    if need_h:
                        dh += (dz_c @ head.w[v0:v1]).to(acc)
                    if need_w:
                        grad_w[v0:v1] += (dz_c.t() @ h).to(acc)
                    if need_b:
                        grad_b[v0:v1] += dz.sum(0)
                if need_h:
                    grad_h[s:e] = dh.to(hidden.dtype)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None, None)


def token_logprobs_and_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                               temperature: float = 1.0, softcap: float | None = None, scale: float = 1.0,
                               entropy: str = "none", chunk: int | None = None,
                               vocab_block: int | None = None) -> tuple[Tensor, Tensor | None]:
    """log softmax(post(hidden @ weight.T + bias) / temperature)[target] and the entropy of that
    distribution, per token, float32: `[..., H], [V, H], [...] -> [...], [...] | None`.

    `entropy`: 'none' (not computed), 'metric' (computed, no gradient) or 'grad' (differentiable,
    for an entropy bonus). `chunk` (tokens) and `vocab_block` (vocabulary slice) size the blocks;
    by default a block holds about 8M logits."""
    if entropy not in ("none", "metric", "grad"):
        raise ValueError(f"entropy must be 'none', 'metric' or 'grad', got {entropy!r}")
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    auto_chunk, auto_vb = block_shape(flat_t.numel(), weight.shape[0])
    blocks = (int(chunk or auto_chunk), int(vocab_block or (block_shape(chunk, weight.shape[0])[1] if chunk else auto_vb)))
    cd = compute_dtype(hidden, weight)
    lp, ent = _HeadLogprobs.apply(flat_h, weight, bias, flat_t, float(temperature), softcap, float(scale), entropy,
                                  blocks, cd)
    return lp.reshape(lead), (ent.reshape(lead) if entropy != "none" else None)


def chunk_tokens_for(vocab: int, elements: int = BLOCK_ELEMENTS) -> int:
    """Tokens per chunk for a plain (materialised logits) log-softmax of `elements` logits."""
    return max(1, elements // max(vocab, 1))


def plain_token_logprobs_and_entropy(logits: Tensor, targets: Tensor, *, temperature: float = 1.0,
                                     entropy: str = "none", chunk: int | None = None) -> tuple[Tensor, Tensor | None]:
    """The same from logits a head module already computed (`[M, V]`, e.g. a LoRA-wrapped lm_head),
    in chunks of tokens so that only the float32 copy of one chunk is alive at a time in forward."""
    chunk = chunk or chunk_tokens_for(logits.shape[-1])
    lps, ents = [], []
    for s in range(0, logits.shape[0], chunk):
        block = logits[s:s + chunk]
        block = (block if block.dtype == torch.float64 else block.float()) / temperature
        logp = torch.log_softmax(block, dim=-1)
        lps.append(logp.gather(-1, targets[s:s + chunk, None]).squeeze(-1))
        if entropy == "grad":
            ents.append(-(logp.exp() * logp).sum(-1))
        elif entropy == "metric":
            ents.append(-(logp.exp() * logp).sum(-1).detach())
    empty = logits.new_zeros(0, dtype=torch.float32)
    lp = torch.cat(lps) if lps else empty
    return lp, ((torch.cat(ents) if ents else empty) if entropy != "none" else None)
