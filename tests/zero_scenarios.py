"""Scenarios of the ZeRO suite besides parity (``zero_cases._suite`` runs them on the ranks): fp16 overflow,
bf16 compute and bf16 reduction, the bytes autograd holds under stage-3 resharding, memory accounting, and the
gradient norm over tp and pp. They build on ``zero_cases`` (model, batches, ``build``, ``train``); no test here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from plait.zero import ClipOptions, LossScaler, NormGroups, ZeroOptimizer, global_grad_norm
from zero_cases import STEPS, _dp, _slices, build, full_weights, make_model, micro_batch, train


def _fp16_overflow(stage):
    """Rank 1's loss is inf on steps 1 and 2: hysteresis 2 keeps the scale once, then halves it."""
    cfg = dict(stage=stage, dtype="fp16", scaler=LossScaler(initial_scale_power=8, hysteresis=2))
    model = make_model()
    opt = build(model, cfg, _dp()[0])
    before = after = None
    log = []
    for step in range(4):
        log += train(model, opt, cfg, 1, poison=lambda s, r: s in (1, 2) and r == 1)
        if step == 0:
            before = _slices(opt)
        if step == 2:
            after = _slices(opt)
    return {
        "log": log,
        "scale": opt.loss_scale,
        "before": before,
        "after": after,
        "skipped": opt.skipped_steps,
    }


def _bf16(stage):
    """Per-step losses of the same run in fp32 and in bf16 (fp32 masters, fp32 reduction)."""
    logs = {}
    for name, dtype, reduce_dtype in (
        ("fp32", None, "fp32"),
        ("bf16", "bf16", "fp32"),
        ("bf16/bf16", "bf16", "bf16"),
    ):
        cfg = dict(stage=stage, dtype=dtype, reduce=reduce_dtype)
        model = make_model()
        opt = build(model, cfg, _dp()[0])
        logs[name] = [loss for loss, _, _ in train(model, opt, cfg, 2 * STEPS)]
        assert all(
            p.dtype == (dtype and torch.bfloat16 or torch.float32) for p in model.parameters()
        )
        assert all(m.dtype == torch.float32 for m in opt.masters)
    return logs


def _bf16_reduce(stage, gas=3):
    """bf16 reduction (DeepSpeed's ``communication_data_type``) of fp32 gradients, accumulated over
    ``gas`` micro-steps in the fp32 grad shard. Returns, per parameter element this rank owns, the shard
    after the last backward (``got``), the exact expectation from every rank's own gradients (``want``:
    each micro-step's gradient (of the loss / GAS) rounded to bf16 and halved (exact), the two ranks'
    halves summed with one bf16 rounding, then added in fp32) and the same with the sum kept in bf16
    (``bf16_sum``, the broken variant the test must tell apart)."""
    group, dp, rank = _dp()
    cfg = dict(stage=stage, gas=gas, reduce="bf16", overlap=True, bucket=300)
    model, plain = make_model(), make_model()
    opt = build(model, cfg, group)
    want = {n: torch.zeros(p.numel()) for n, p in plain.named_parameters()}
    bf16_sum = {n: torch.zeros_like(w, dtype=torch.bfloat16) for n, w in want.items()}
    for j in range(gas):
        batch = micro_batch(0, dp, gas, rank, j)
        opt.backward(model(*batch))
        if j < gas - 1:
            assert not opt.step()
        plain.zero_grad()
        (plain(*batch) / gas).backward()  # ZeroOptimizer.backward scales by 1/GAS the same way
        for n, p in plain.named_parameters():
            halves = [torch.empty(p.numel(), dtype=torch.bfloat16) for _ in range(dp)]
            dist.all_gather(halves, p.grad.reshape(-1).bfloat16() / dp, group=group)
            reduced = halves[0] + halves[1]  # bf16 + bf16: one rounding of the exact sum
            want[n] += reduced.float()
            bf16_sum[n] += reduced
    got = {}
    for g, flat in enumerate(opt.groups):
        for seg in flat.segments:
            for piece in seg.pieces():
                at = slice(piece.start, piece.start + piece.length)
                value = opt.grad_shards[g][
                    piece.shard_offset : piece.shard_offset + piece.length
                ].clone()
                got.setdefault(piece.slot.name, []).append(
                    (
                        at,
                        value,
                        want[piece.slot.name][at].clone(),
                        bf16_sum[piece.slot.name][at].float(),
                    )
                )
    opt.step()
    return got


def _saved_bytes(reshard: bool):
    """Stage 3, units = blocks, eager: bytes of the distinct storages autograd holds for backward when the
    forward ends, and the bytes of the blocks' gathered segments (what resharding after forward frees)."""
    model = make_model()
    opt = build(model, dict(stage=3, units="blocks", reshard=reshard), _dp()[0])
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*micro_batch(0, _dp()[1], 1, _dp()[2], 0))
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved}
    blocks = {
        id(seg): seg.padded * 4 for u in opt.units if u.module is not model for seg in u.segments
    }
    opt.backward(loss)
    opt.step()
    return {
        "held": sum(storages.values()),
        "blocks": sum(blocks.values()),
        "module": full_weights(model, opt),
    }


def _memory(stage, dp):
    """Bytes held after the backward of step 2 (optimizer state exists), bf16 parameters."""
    cfg = dict(stage=stage, dtype="bf16", bucket=2000)
    model = make_model()
    opt = build(model, cfg, _dp()[0])
    train(model, opt, cfg, 1)
    opt.backward(model(*micro_batch(1, dp, 1, _dp()[2], 0)))
    mem = opt.memory_bytes()
    opt.step()
    return mem


def _tp_norm():
    """tp=2 x dp=2: a tp-replicated and a tp-sharded parameter; the norm counts each element once."""
    from plait.parallel.mesh import ParallelMesh
    from plait.parallel.sharding import TPShard, mark

    mesh = ParallelMesh(tp=2)
    g = torch.Generator().manual_seed(7)
    rep, full = torch.randn(5, generator=g), torch.randn(8, 3, generator=g)
    a = [torch.randn(5, generator=g) for _ in range(2)]
    b = [torch.randn(8, 3, generator=g) for _ in range(2)]
    model = nn.Module()
    model.rep = nn.Parameter(rep.clone())
    model.shard = nn.Parameter(full[4 * mesh.tp_rank : 4 * mesh.tp_rank + 4].clone())
    mark(model.shard, TPShard((8, 3), dim=0, rank=mesh.tp_rank, world=2))
    out = {}
    for stage in (0, 2, 3):
        m = nn.Module()
        m.rep, m.shard = (
            nn.Parameter(model.rep.detach().clone()),
            nn.Parameter(model.shard.detach().clone()),
        )
        mark(m.shard, model.shard.plait_shard)
        opt = ZeroOptimizer(
            m,
            mesh.dp_group,
            stage=stage,
            optimizer=torch.optim.SGD,
            optimizer_kwargs=dict(lr=1.0),
            clip=ClipOptions(1.0, NormGroups(tp=mesh.tp_group, pp=mesh.pp_group)),
        )
        with opt.gathered_parameters():
            loss = (m.rep * a[mesh.dp_rank]).sum() + (
                m.shard * b[mesh.dp_rank][4 * mesh.tp_rank :][:4]
            ).sum()
        opt.backward(loss)
        opt.step()
        with opt.gathered_parameters():
            out[stage] = (opt.grad_norm, m.rep.detach().clone(), m.shard.detach().clone())
    return {"norms": out, "rep": rep, "full": full, "a": a, "b": b, "tp_rank": mesh.tp_rank}


def _pp_norm():
    """pp=2 x dp=2: each stage holds different parameters; the norm sums over stages (and inf-norm
    takes the max), through both ``global_grad_norm`` and the optimizer."""
    from plait.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(pp=2)
    g = torch.Generator().manual_seed(11)
    grads = [[torch.randn(6 + 3 * stage, generator=g) for _ in range(2)] for stage in range(2)]
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(6 + 3 * mesh.pp_rank))
    opt = ZeroOptimizer(
        m,
        mesh.dp_group,
        stage=1,
        optimizer=torch.optim.SGD,
        optimizer_kwargs=dict(lr=1.0),
        clip=ClipOptions(norm_groups=NormGroups(pp=mesh.pp_group)),
    )
    opt.backward((m.w * grads[mesh.pp_rank][mesh.dp_rank]).sum())
    opt.step()
    mine = grads[mesh.pp_rank][mesh.dp_rank]
    inf = global_grad_norm([(mine, True)], mesh.dp_group, None, mesh.pp_group, norm_type=math.inf)
    return {"norm": opt.grad_norm, "grads": grads, "inf": float(inf)}
