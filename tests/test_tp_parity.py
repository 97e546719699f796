"""Tensor-parallel parity: plait's GPT-2, Llama (GQA) and BERT at tp in {1, 2, 4}, sequence
parallelism on and off, against the independent single-process reference in
reference_models.py (float64). Tolerances: loss to 1e-5 relative; each gradient, gathered to
its whole logical shape, to 1e-5 relative in the norm ||g - g_ref|| / max(||g_ref||, 1e-3). The floor
matters only for k_proj.bias, whose gradient is zero in exact arithmetic (softmax ignores a shift
shared by all keys): it is held to 1e-8 absolute.
Vocabulary 1001 (not divisible by tp, padded) and 3 blocks (odd)."""

import pytest
import torch
import torch.distributed as dist

from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.parallel.sharding import gather_logical_state
from plait.testing import run_distributed
from reference_models import reference_loss
from helpers import make_config, rel_err

RTOL = 1e-5
SEQ = 12


def make_batch(arch: str, batch: int = 2, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 1001, (batch, seq), generator=g)
    ids[0, 0] = 1000  # the last real vocabulary row, on the last tp rank
    labels = torch.randint(0, 1001, (batch, seq), generator=g)
    labels[0, :3] = -100
    out = {"input_ids": ids, "labels": labels}
    if arch == "bert":
        keep = torch.ones(batch, seq, dtype=torch.long)
        keep[1, -3:] = 0
        out["attention_mask"] = keep
        out["token_type_ids"] = torch.randint(0, 2, (batch, seq), generator=g)
        out["labels"] = labels.masked_fill(torch.rand(batch, seq, generator=g) > 0.4, -100)
    return out


def parity_body(arch: str, tp: int, sequence_parallel: bool, device: str = "cpu"):
    """On every rank: plait forward/backward, gather whole grads; rank 0 compares to the reference.
    ``device="cuda"`` runs the same check over NCCL (tests/gpu/run_tp_parity_nccl.py)."""
    mesh = ParallelMesh(tp=tp)
    cfg = make_config(arch)
    model = TransformerModel(cfg, mesh, sequence_parallel=sequence_parallel, seed=11, device=device)
    batch = {k: v.to(device) for k, v in make_batch(arch).items()}
    loss = model(**batch)
    loss.backward()
    full_w = {n: t.cpu() for n, t in gather_logical_state(model, mesh.tp_group).items()}
    full_g = {n: t.cpu() for n, t in gather_logical_state(model, mesh.tp_group, grads=True).items()}
    # Layout-invariant initialization: whole weights equal a single-process build's.
    single = {
        n: t.cpu()
        for n, t in gather_logical_state(
            TransformerModel(cfg, None, seed=11, device=device)
        ).items()
    }
    for name, w in full_w.items():
        assert torch.equal(w, single[name]), f"{name} differs from the tp=1 initialization"
    batch = {k: v.cpu() for k, v in batch.items()}
    losses = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach().reshape(1))
    losses = [x.cpu() for x in losses]
    assert all(torch.equal(x, losses[0]) for x in losses), f"loss differs across tp ranks: {losses}"
    if dist.get_rank() != 0:
        return None
    ref_w = {k: v.double().requires_grad_() for k, v in full_w.items()}
    ref = reference_loss(
        cfg,
        ref_w,
        batch["input_ids"],
        batch["labels"],
        batch.get("attention_mask"),
        batch.get("token_type_ids"),
    )
    ref.backward()
    loss_err = abs(loss.item() - ref.item()) / abs(ref.item())
    assert loss_err <= RTOL, f"loss {loss.item()} vs reference {ref.item()} (rel {loss_err:.2e})"
    grad_errs = {k: rel_err(full_g[k], ref_w[k].grad, floor=1e-3) for k in full_g}
    worst = max(grad_errs, key=grad_errs.get)
    assert grad_errs[worst] <= RTOL, f"gradient of {worst} off by {grad_errs[worst]:.2e} relative"
    return loss_err, grad_errs[worst]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_parity(arch, tp):
    for sp in [False] if tp == 1 else [False, True]:
        results = run_distributed(parity_body, tp, arch, tp, sp)
        loss_err, grad_err = results[0]
        assert loss_err <= RTOL and grad_err <= RTOL
