"""Single-process reference GPT-2, Llama and BERT in plain PyTorch, written from the papers and
the Hugging Face implementations' semantics, using no plait layer. Weights come in as a dict of
whole logical tensors keyed by plait's parameter names; the forward returns the mean loss over
labels != -100."""

import math

import torch
import torch.nn.functional as F


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _rope(x, pos, theta):
    """Rotate pairs (i, i + d/2) by angle pos * theta^(-2i/d)."""
    d = x.shape[-1]
    half = d // 2
    freq = theta ** (-torch.arange(half, dtype=x.dtype) * 2.0 / d)
    ang = pos[:, None, :, None].to(x.dtype) * freq  # [b, 1, s, d/2]
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _attention(x, W, p, cfg, mask_add, pos):
    b, s, h = x.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, h // cfg.num_heads

    def proj(name, heads):
        y = x @ W[f"{p}.attn.{name}.weight"].T
        if cfg.bias:
            y = y + W[f"{p}.attn.{name}.bias"]
        return y.view(b, s, heads, hd).transpose(1, 2)  # [b, heads, s, hd]

    q, k, v = proj("q_proj", nh), proj("k_proj", nkv), proj("v_proj", nkv)
    if cfg.rope_theta is not None:
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd) + mask_add
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, nh * hd)
    out = out @ W[f"{p}.attn.o_proj.weight"].T
    return out + W[f"{p}.attn.o_proj.bias"] if cfg.bias else out


def _mlp(x, W, p, cfg):
    def lin(name, y):
        out = y @ W[f"{p}.mlp.{name}.weight"].T
        return out + W[f"{p}.mlp.{name}.bias"] if cfg.bias else out

    if cfg.activation == "swiglu":
        return lin("down_proj", F.silu(lin("gate_proj", x)) * lin("up_proj", x))
    act = _gelu_tanh if cfg.activation == "gelu_tanh" else _gelu_erf
    return lin("down_proj", act(lin("up_proj", x)))


def _norm(x, W, name, cfg):
    if cfg.norm == "rmsnorm":
        return _rms(x, W[f"{name}.weight"], cfg.norm_eps)
    return _ln(x, W[f"{name}.weight"], W[f"{name}.bias"], cfg.norm_eps)


def reference_loss(cfg, W, input_ids, labels, attention_mask=None, token_type_ids=None):
    """Mean cross entropy of the model ``cfg`` with weights ``W`` on one batch ``[b, s]``."""
    b, s = input_ids.shape
    L = cfg.num_layers
    pos = torch.arange(s).expand(b, s)
    x = W["layers.0.word_embeddings.weight"][input_ids]
    if cfg.rope_theta is None:
        x = x + W["layers.0.position_embeddings"][pos]
    if cfg.type_vocab_size:
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = x + W["layers.0.token_type_embeddings"][types]
    if cfg.arch == "bert":
        x = _norm(x, W, "layers.0.norm", cfg)
    if cfg.causal:
        mask_add = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)
    else:
        keep = (
            torch.ones(b, s, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        mask_add = torch.zeros(b, 1, 1, s, dtype=x.dtype).masked_fill(
            ~keep[:, None, None, :], float("-inf")
        )
    for i in range(1, L + 1):
        p = f"layers.{i}"
        if cfg.post_norm:
            x = _norm(x + _attention(x, W, p, cfg, mask_add, pos), W, f"{p}.attn_norm", cfg)
            x = _norm(x + _mlp(x, W, p, cfg), W, f"{p}.mlp_norm", cfg)
        else:
            x = x + _attention(_norm(x, W, f"{p}.attn_norm", cfg), W, p, cfg, mask_add, pos)
            x = x + _mlp(_norm(x, W, f"{p}.mlp_norm", cfg), W, p, cfg)
    head = f"layers.{L + 1}"
    if cfg.arch == "bert":
        x = _gelu_erf(x @ W[f"{head}.dense.weight"].T + W[f"{head}.dense.bias"])
    x = _norm(x, W, f"{head}.norm", cfg)
    out_w = W["layers.0.word_embeddings.weight"] if cfg.tie_embeddings else W[f"{head}.weight"]
    logits = x @ out_w.T
    if cfg.arch == "bert":
        logits = logits + W[f"{head}.bias"]
    return F.cross_entropy(
        logits.reshape(-1, cfg.vocab_size),
        labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=cfg.label_smoothing,
    )
