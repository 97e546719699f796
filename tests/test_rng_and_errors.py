"""Dropout RNG streams under tp and recomputation; clear errors for layouts that cannot split."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.layers import TransformerModel
from plait.models import preset
from plait.layers.model import check_tensor_parallel
from plait.parallel import ParallelMesh
from plait.parallel.random import RNGTracker
from plait.testing import run_distributed


def streams_body():
    mesh = ParallelMesh(tp=2)
    tracker = RNGTracker(seed=5, tp_rank=mesh.tp_rank)
    before = torch.get_rng_state()
    with tracker.fork("tp"):
        tp_mask = F.dropout(torch.ones(4096), 0.5, True) > 0
    with tracker.fork("replicated"):
        rep_mask = F.dropout(torch.ones(4096), 0.5, True) > 0
    assert torch.equal(before, torch.get_rng_state()), (
        "fork must leave the default generator untouched"
    )
    masks = [torch.zeros(2, 4096, dtype=torch.bool) for _ in range(2)]
    dist.all_gather(masks, torch.stack([tp_mask, rep_mask]))
    return (masks[0][0] != masks[1][0]).float().mean().item(), torch.equal(masks[0][1], masks[1][1])


def test_tp_stream_differs_and_replicated_stream_matches_across_tp_ranks():
    frac_differ, replicated_equal = run_distributed(streams_body, 2)[0]
    assert 0.4 < frac_differ < 0.6  # independent Bernoulli(0.5) masks differ on ~half the entries
    assert replicated_equal


def dropout_config():
    return preset(
        "gpt2-tiny",
        vocab_size=512,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        hidden_dropout=0.2,
        attention_dropout=0.2,
    )


def replicas_body(sequence_parallel):
    """With dropout on, every tp rank must end up with the same loss (replicated stream kept in step)."""
    mesh = ParallelMesh(tp=2)
    model = TransformerModel(dropout_config(), mesh, sequence_parallel=sequence_parallel, seed=3)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).detach().reshape(1)
    both = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(both, loss)
    no_dropout = model.eval()(input_ids=ids, labels=ids).item()
    return both[0].item(), both[1].item(), no_dropout


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_keeps_tp_replicas_identical(sequence_parallel):
    l0, l1, eval_loss = run_distributed(replicas_body, 2, sequence_parallel)[0]
    assert l0 == l1
    assert l0 != eval_loss  # dropout was really applied


def recompute_body(tp):
    mesh = ParallelMesh(tp=tp)
    grads = []
    for recompute in (None, "full", "selective"):
        cfg = dropout_config()
        model = TransformerModel(cfg, mesh, seed=9, recompute=recompute)
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return all(torch.equal(grads[0][n], g[n]) for g in grads[1:] for n in grads[0])


@pytest.mark.parametrize("tp", [1, 2])
def test_recomputation_replays_dropout_exactly(tp):
    assert all(run_distributed(recompute_body, tp, tp))


def test_recompute_without_replay_would_differ():
    """Guard for the test above: two forward passes of one model draw different dropout masks."""
    model = TransformerModel(dropout_config(), None, seed=9)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    assert model(input_ids=ids, labels=ids).item() != model(input_ids=ids, labels=ids).item()


@pytest.mark.parametrize(
    "field,value,tp,needle",
    [
        (
            "hidden_size",
            66,
            4,
            "hidden_size (66) is not divisible by the tensor-parallel size tp=4",
        ),
        ("num_heads", 6, 4, "num_heads (6) is not divisible by the tensor-parallel size tp=4"),
        (
            "num_kv_heads",
            2,
            4,
            "num_kv_heads (2) is not divisible by the tensor-parallel size tp=4",
        ),
        ("ffn_hidden_size", 250, 4, "ffn_hidden_size (250) is not divisible"),
    ],
)
def test_sizes_not_divisible_by_tp_raise_with_numbers_and_fix(field, value, tp, needle):
    base = dict(
        vocab_size=512,
        hidden_size=96,
        num_heads=12,
        num_kv_heads=4,
        ffn_hidden_size=256,
        num_layers=2,
    )
    base[field] = value
    if field == "hidden_size":
        base.update(num_heads=6, num_kv_heads=6)
    if field == "num_heads":
        base.update(hidden_size=96, num_kv_heads=6)
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(preset("llama-tiny", **base), tp)
    assert needle in str(err.value) and "choose tp from" in str(err.value)


def bad_heads_body():
    with pytest.raises(
        ValueError, match=r"num_heads \(3\) is not divisible by the tensor-parallel size tp=2"
    ):
        TransformerModel(
            preset("gpt2-tiny", hidden_size=48, num_heads=3, num_layers=1), ParallelMesh(tp=2)
        )
    with pytest.raises(ValueError, match=r"dim 1 of shape \(2, 7, 32\) \(7\) is not divisible"):
        model = TransformerModel(
            preset("gpt2-tiny", hidden_size=32, num_heads=2, num_layers=1),
            ParallelMesh(tp=2),
            sequence_parallel=True,
        )
        model(input_ids=torch.zeros(2, 7, dtype=torch.long))
    return True


def test_bad_layouts_raise_at_construction_on_a_real_mesh():
    assert all(run_distributed(bad_heads_body, 2))
