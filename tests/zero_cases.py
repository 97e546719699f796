"""The cases of the ZeRO parity suite (``tests/test_zero.py``, ``test_zero_stage3.py``, ``test_zero_units.py``):
the tiny model, the single-process torch reference, building and training a ``ZeroOptimizer``, the per-rank
scenarios and the cached distributed run of all of them (``suite``).

Parity contract: after 5 optimizer steps every weight (the fp32 master slices reassembled from
all ranks, and the model's own parameters) equals a single-process ``torch.optim.AdamW`` trained
on the same global batch to 1e-6 relative (``rtol=1e-6, atol=1e-6 * max|w|``), for stages 0-3 x
dp {1, 2, 4} x GAS {1, 3}, overlap on/off, small buckets (several segments, parameters split
across partition boundaries), stage-3 persistence and caller-listed units, with and without
gradient clipping. lr is 1e-3: Adam divides by sqrt(v), so float32 reduction-order noise in a
near-zero gradient moves a weight by up to ~lr; at 1e-3 that stays inside the tolerance.

One distributed run per dp size executes every scenario (``_suite``), caching the per-rank
results; the tests only assert on them. A scenario that raises is reported by its test. Imported as
``from zero_cases import ...`` (pytest puts ``tests/`` on ``sys.path``, as for ``helpers``); no test here.
"""

from __future__ import annotations

import math
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.testing import run_distributed
from plait.zero import (
    ClipOptions,
    CommOptions,
    PrecisionOptions,
    ZeroOptimizer,
    slices_reader,
    weight_decay_groups,
)
from plait.zero.slices import ParamSlice, ShardState

VOCAB, HIDDEN, SEQ, MICRO_BS, STEPS, LR, MAX_NORM = 32, 16, 8, 2, 5, 1e-3, 0.05


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding + a position parameter on the root + 2 blocks + LayerNorm + a head tied to the
    embedding the Hugging Face way (``head.weight = embed.weight``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.1)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    #: recompute each block in backward the Hugging Face way (``checkpoint(block.__call__, ...)``: the
    #: block's hooks run again inside backward); "reentrant" as ``use_reentrant=True`` does it
    checkpoint_blocks: bool | str = False

    def forward(self, ids, targets):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = (
                checkpoint(block, x, use_reentrant=self.checkpoint_blocks == "reentrant")
                if self.checkpoint_blocks
                else block(x)
            )
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def global_batch(step: int, n: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(
        0, VOCAB, (n, SEQ), generator=g
    )


def micro_batch(step: int, dp: int, gas: int, rank: int, j: int):
    """Rank ``rank``'s ``j``-th micro-batch of step ``step``'s global batch (``dp*gas*MICRO_BS`` rows):
    equal sizes, so the mean of the per-rank micro-batch means is the global mean."""
    ids, tgt = global_batch(step, dp * gas * MICRO_BS)
    rows = slice((j * dp + rank) * MICRO_BS, (j * dp + rank + 1) * MICRO_BS)
    return ids[rows], tgt[rows]


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=LR)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def reference(global_bs: int, steps: int = STEPS, max_norm: float = 0.0, opt: str = "adamw"):
    """Single-process training on the whole global batch: (weights, grad norms, losses)."""
    model = make_model()
    cls, kwargs = OPTIMIZERS[opt]
    optimizer = cls(weight_decay_groups(model, 0.1), **kwargs)
    norms, losses = [], []
    for step in range(steps):
        loss = model(*global_batch(step, global_bs))
        loss.backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf))
        )
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms, losses


# ---- running on ranks ---------------------------------------------------------------------------
def _dp():
    if dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    return None, 1, 0


def build(model, cfg: dict, group) -> ZeroOptimizer:
    cls, kwargs = OPTIMIZERS[cfg.get("opt", "adamw")]
    units = list(model.blocks) if cfg.get("units") == "blocks" else None
    return ZeroOptimizer(
        model,
        group,
        stage=cfg["stage"],
        optimizer=cls,
        optimizer_kwargs=kwargs,
        param_groups=weight_decay_groups(model, 0.1),
        gradient_accumulation_steps=cfg.get("gas", 1),
        comm=CommOptions(
            overlap_comm=cfg.get("overlap", False),
            reduce_bucket_size=cfg.get("bucket", 10_000_000),
            allgather_bucket_size=cfg.get("gather_bucket", 10_000_000),
            prefetch_bucket_size=cfg.get("prefetch", 0),
            param_persistence_threshold=cfg.get("persist", 0),
            reduce_dtype=cfg.get("reduce", "fp32"),
            reshard_after_forward=cfg.get("reshard", True),
        ),
        units=units,
        clip=ClipOptions(max_grad_norm=cfg.get("max_norm", 0.0)),
        precision=PrecisionOptions(param_dtype=cfg.get("dtype"), loss_scaler=cfg.get("scaler")),
    )


def train(model, opt, cfg: dict, steps: int, poison=None):
    """``steps`` optimizer steps; ``poison(step, rank)`` True multiplies that rank's loss by inf.
    Returns per-step (loss of micro-batch 0, applied, loss scale before the step)."""
    _, dp, rank = _dp()
    gas, log = cfg.get("gas", 1), []
    for _ in range(steps):
        step = opt.global_steps + opt.skipped_steps
        scale = opt.loss_scale
        for j in range(gas):
            loss = model(*micro_batch(step, dp, gas, rank, j))
            opt.backward(loss * math.inf if poison and poison(step, rank) else loss)
            applied = opt.step()
            assert applied or j < gas - 1 or cfg.get("scaler"), (cfg, step, j)
            if j == 0:
                first = float(loss.detach())
        log.append((first, applied, scale))
    return log


def _slices(opt):
    return [
        (
            s.name,
            s.shape,
            s.start,
            s.length,
            s.master.clone(),
            {k: v.clone() for k, v in s.state.items()},
        )
        for s in opt.shard_state().slices
    ]


def full_weights(model, opt):
    with opt.gathered_parameters():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _parity(cfg):
    model = make_model()
    model.checkpoint_blocks = cfg.get("ckpt", False)
    opt = build(model, cfg, _dp()[0])
    seen = {}
    if cfg["stage"] == 3:  # parameters are whole inside forward
        model.blocks[0].fc1.register_forward_pre_hook(
            lambda m, a: seen.update(fc1=tuple(m.weight.shape)) or None
        )
    log = train(model, opt, cfg, STEPS)
    info = {
        "slices": _slices(opt),
        "norm": opt.grad_norm,
        "module": full_weights(model, opt),
        "log": log,
    }
    if cfg["stage"] == 3:  # outside forward/backward only persistent parameters are whole
        info["param_numel"] = {n: p.numel() for n, p in model.named_parameters()}
        info["storage"] = {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()}
        info["seen"] = seen
        info["stats"] = dict(opt.gatherer.stats)
        with torch.no_grad():  # evaluation forward: gathers and releases too
            model.eval()(*micro_batch(0, 1, 1, 0, 0))
        assert all(p.numel() == 0 or p.numel() < cfg.get("persist", 0) for p in model.parameters())
    return info


def _save(cfg, steps):
    model = make_model()
    opt = build(model, cfg, _dp()[0])
    train(model, opt, cfg, steps)
    state = opt.shard_state()
    return {
        "slices": _slices(opt),
        "groups": state.groups,
        "scaler": state.loss_scaler,
        "steps": (state.global_steps, state.skipped_steps),
    }


def restore(saved_ranks, cfg, steps):
    """Load a checkpoint saved by every rank of another dp size, train on, return the weights."""
    slices = [ParamSlice(*s) for r in saved_ranks for s in r["slices"]]
    first = saved_ranks[0]
    state = ShardState(
        slices, first["groups"], first["scaler"], *first["steps"], stage=1, dp_size=0, dp_rank=0
    )
    model = make_model(
        seed=123
    )  # different initial weights: everything must come from the checkpoint
    opt = build(model, cfg, _dp()[0])
    opt.load_shard_state(slices_reader(slices), state)
    train(model, opt, cfg, steps)
    return {"slices": _slices(opt), "module": full_weights(model, opt)}


def _guard(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception:  # noqa: BLE001 - reported by the test that owns the scenario
        return ("error", traceback.format_exc())


def _suite(dp: int, saved_dp2=None):
    from zero_scenarios import (
        _bf16,
        _bf16_reduce,
        _fp16_overflow,
        _memory,
        _pp_norm,
        _saved_bytes,
        _tp_norm,
    )

    out = {"parity": [_guard(_parity, cfg) for cfg in parity_cfgs(dp)]}
    if dp == 2:
        out["fp16"] = {s: _guard(_fp16_overflow, s) for s in (1, 2, 3)}
        out["bf16"] = {s: _guard(_bf16, s) for s in (2, 3)}
        out["bf16_reduce"] = {s: _guard(_bf16_reduce, s) for s in (2, 3)}
        out["saved_bytes"] = {r: _guard(_saved_bytes, r) for r in (True, False)}
        out["save"] = _guard(_save, dict(stage=1, gas=2), 3)
    if dp == 4:
        out["memory"] = {s: _guard(_memory, s, dp) for s in (1, 2, 3)}
        out["tp_norm"] = _guard(_tp_norm)
        out["pp_norm"] = _guard(_pp_norm)
        out["restore"] = {
            s: _guard(restore, saved_dp2, dict(stage=s, bucket=500, overlap=True), 2)
            for s in (2, 3)
        }
    return out


def _portable(x):
    """Tensors -> numpy (torch tensors through a multiprocessing queue need live shared-memory fds)."""
    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy().copy()
    if isinstance(x, dict):
        return {k: _portable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_portable(v) for v in x)
    return x


def _torch(x):
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, dict):
        return {k: _torch(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_torch(v) for v in x)
    return x


def _portable_suite(dp, saved):
    return _portable(_suite(dp, _torch(saved)))


_RESULTS: dict[int, list] = {}


def suite(dp: int) -> list[dict]:
    """Per-rank results of ``_suite`` at ``dp`` ranks (cached; dp=1 runs in this process)."""
    if dp not in _RESULTS:
        saved = None
        if dp == 4:
            saved = [r["save"] for r in suite(2)]
            assert all(s[0] == "ok" for s in saved), saved[0][1]
            saved = [s[1] for s in saved]
        if dp == 1:
            _RESULTS[dp] = [_suite(1)]
        else:
            _RESULTS[dp] = _torch(run_distributed(_portable_suite, dp, dp, _portable(saved)))
    return _RESULTS[dp]


def ok(per_rank: list):
    """Unwrap ``_guard`` results of every rank, failing with the first traceback."""
    for status, value in per_rank:
        if status != "ok":
            pytest.fail(value, pytrace=False)
    return [value for _, value in per_rank]


def parity_cfgs(dp: int) -> list[dict]:
    small = dict(bucket=300, gather_bucket=700, prefetch=600, persist=40)
    cfgs = [
        dict(stage=s, gas=g, overlap=o, **(small if o else {}))
        for s in (0, 1, 2, 3)
        for g in (1, 3)
        for o in (False, True)
    ]
    if dp < 4:  # clipping at dp 1 and 2 (dp=4 adds nothing new to the norm and costs test time)
        cfgs += [
            dict(stage=s, gas=1 + 2 * (s % 2), max_norm=MAX_NORM, overlap=s > 1)
            for s in (0, 1, 2, 3)
        ]
    if dp == 2:
        # prefetch 2000: below one block (2160 elements), so each prefetch takes exactly the next block
        cfgs += [
            dict(stage=3, gas=3, units="blocks", prefetch=2000, overlap=True, max_norm=MAX_NORM),
            dict(stage=3, gas=3, units="blocks", prefetch=5000, overlap=True, reshard=False),
            dict(
                stage=3,
                gas=1,
                units="blocks",
                prefetch=2000,
                overlap=True,
                ckpt=True,
                max_norm=MAX_NORM,
            ),
            dict(stage=3, gas=1, ckpt=True, reshard=False),
            dict(stage=3, gas=2, units="blocks", prefetch=2000, overlap=True, ckpt="reentrant"),
            dict(stage=2, gas=1, opt="sgd", bucket=500),
            dict(stage=3, gas=1, opt="sgd", persist=20),
        ]
    return cfgs


def from_slices(per_rank_slices, kind="master"):
    flat = [ParamSlice(*s) for slices in per_rank_slices for s in slices]
    read = slices_reader(flat)
    shapes = {s.name: s.shape for s in flat}
    return {n: read(n, kind, 0, math.prod(shape)).view(shape) for n, shape in shapes.items()}


def assert_weights(got: dict, want: dict, what: str, rtol: float = 1e-6):
    assert set(got) == set(want), what
    for name, w in want.items():
        torch.testing.assert_close(
            got[name].float(),
            w,
            rtol=rtol,
            atol=rtol * float(w.abs().max()),
            msg=lambda m, name=name: f"{what}: {name}: {m}",
        )
