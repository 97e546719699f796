"""plait.layers.tiled: the MLP over sequence tiles (Arctic Long Sequence Training's TiledMLP) against the
MLP over the whole sequence, float32.

Tolerance 1e-6 relative: per token the tiled MLP runs the same operations; only the matmuls see fewer rows
(another blocking, a few float32 ulps per dot product over h or ffn) and each weight gradient is summed
tile by tile (another summation order over tokens: ~1e-7 measured). A tile left out of a gradient would
miss 1/16 or more of its sum.
"""

import pytest
import torch

from helpers import rel_err
from plait.layers import TransformerModel
from plait.models import preset
from plait.layers.mlp import MLP


def run(mlp, x0, up):
    x = x0.clone().requires_grad_()
    out = mlp(x)
    out.backward(up)
    return [out.detach(), x.grad] + [p.grad.clone() for p in mlp.parameters()]


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_tiled_mlp_matches_the_whole_sequence(activation):
    torch.manual_seed(0)
    whole = MLP(32, 80, activation, bias=activation == "gelu")
    for p in whole.parameters():  # a layer alone is not initialized (TransformerModel does it)
        torch.nn.init.normal_(p, std=0.2)
    tiled = MLP(32, 80, activation, bias=activation == "gelu", chunk_tokens=5)  # tiles 5, 5, 5, 1
    tiled.load_state_dict(whole.state_dict())
    x0, up = torch.randn(3, 16, 32), torch.randn(3, 16, 32)
    for got, want in zip(run(tiled, x0, up), run(whole, x0, up)):
        assert rel_err(got, want) <= 1e-6


def saved_bytes(fn, x):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def test_tiled_mlp_keeps_only_its_input():
    """Whole: the input, both [b, s, ffn] projections and the product (4 x 3 x 64 x 80 x 4 bytes and more);
    tiled: the input alone."""
    torch.manual_seed(0)
    x = torch.randn(3, 64, 32, requires_grad=True)
    tiled = MLP(32, 80, "swiglu", bias=False, chunk_tokens=16)
    assert saved_bytes(tiled, x) == x.numel() * 4
    assert saved_bytes(MLP(32, 80, "swiglu", bias=False), x) >= x.numel() * 4 + 3 * 3 * 64 * 80 * 4


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_model_with_mlp_tiles_matches_untiled(arch):
    """``mlp_chunk_tokens`` in the config: loss and every gradient of a whole model. GPT-2's key bias has a
    zero gradient in exact arithmetic (softmax ignores a constant added to all of a query's scores): its
    ~1e-10 of rounding noise is measured against a norm floor of 1e-3 (the other gradients: 1e-2 to 1)."""

    def grads(chunk):
        cfg = preset(
            f"{arch}-tiny",
            num_layers=2,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            mlp_chunk_tokens=chunk,
        )
        model = TransformerModel(cfg, None, seed=3)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
        loss = model(input_ids=ids, labels=ids.roll(-1, 1))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    (loss, want), (tiled_loss, got) = grads(0), grads(7)
    assert rel_err(tiled_loss, loss) <= 1e-6
    for name, g in want.items():
        assert rel_err(got[name], g, floor=1e-3) <= 1e-6, name


def test_mlp_chunk_tokens_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match=r"mlp_chunk_tokens must be an int >= 0"):
        preset("llama-tiny", mlp_chunk_tokens=-1)
