"""Interleaved 1F1B (v=2) with a number of micro-batches m that is not a multiple of the pipeline size p,
on CPU/gloo: p=2 with m in {1, 3, 5} and p=3 with m in {4, 5} (rounds of 3+ micro-batches; see
``schedules.interleaved_1f1b``), against a single process running the whole model with plain gradient
accumulation over the same micro-batches (loss averaged over micro-batches: each micro-batch's loss / m
is back-propagated and the gradients add up).

Model: GPT-2 tiny (6 blocks, tied embeddings, so the head copy on the last virtual stage is summed with the
embedding on stage 0 over the tied group); micro-batches of different sequence lengths, some labels masked.

Tolerance (float32 on both sides): the loss to 1e-5 relative and every gradient to 1e-5 in the metric
||g - g_ref|| / max(||g_ref||, 1e-3) (the floor only matters for gradients that are exactly zero). The
pipeline adds the micro-batches' gradient contributions in its schedule's backward order and the tied
copies across ranks, the reference in micro-batch order: the same terms summed in another order, a few
float32 ulps (1.2e-7 each) apart, so 1e-5 leaves ample margin, while a micro-batch whose backward is
lost or counted twice moves the gradients by about 1/m (>= 20%).

One process launch per world size loops over its m values (each launch costs a few seconds on 2 cores).
"""

import pytest
import torch
from helpers import rel_err

from plait.layers import TransformerModel
from plait.models import preset
from plait.layers.init import TIED_ATTR
from plait.layers.stages import build_stage_modules
from plait.parallel import ParallelMesh
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.testing import run_distributed

RTOL = 1e-5
SEQS = (8, 12, 6, 10)  # sequence length of micro-batch i is SEQS[i % 4]
CASES = {2: (1, 3, 5), 3: (4, 5)}  # world size (= p) -> micro-batch counts m (none a multiple of p)


def make_config():
    return preset(
        "gpt2-tiny",
        vocab_size=1001,
        num_layers=6,
        hidden_size=32,
        num_heads=4,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def make_microbatches(count: int, seed: int) -> list[dict]:
    """``count`` micro-batches of 2 samples: ``input_ids``/``labels`` [2, SEQS[i % 4]], a few labels -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        ids = torch.randint(0, 1001, (2, SEQS[i % len(SEQS)]), generator=g)
        labels = torch.randint(0, 1001, ids.shape, generator=g)
        labels[i % 2, : 1 + i % 3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference(batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """(mean loss, {name: grad}) of the whole model in one process, gradients accumulated per micro-batch."""
    whole = TransformerModel(make_config(), None, seed=11)
    total = 0.0
    for b in batches:
        loss = whole(**b) / len(batches)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in whole.named_parameters()}


def pipeline_body(ms: tuple[int, ...]) -> list[tuple[int, float, dict[str, torch.Tensor]]]:
    """On every rank: for each m, one interleaved train_batch; return (m, loss, {reference name: grad})."""
    mesh = ParallelMesh(pp=torch.distributed.get_world_size())
    out = []
    for m in ms:
        chunks = build_stage_modules(make_config(), mesh, 2, seed=11)
        pipe = PipelineParallel(
            chunks, mesh, schedule="interleaved", micro_batches=m, virtual_stages=2
        )
        loss = pipe.train_batch(iter(make_microbatches(m, seed=5 + m)))
        grads = {
            getattr(p, TIED_ATTR, None) or n: p.grad.clone() for n, p in pipe.named_parameters()
        }
        out.append((m, loss.item(), grads))
    return out


@pytest.mark.parametrize("p", sorted(CASES))
def test_interleaved_any_m_matches_gradient_accumulation(p):
    per_rank = run_distributed(pipeline_body, p, CASES[p], timeout_s=120)
    for i, m in enumerate(CASES[p]):
        want_loss, want = reference(make_microbatches(m, seed=5 + m))
        seen = set()
        for rank, results in enumerate(per_rank):
            got_m, loss, grads = results[i]
            assert got_m == m
            assert abs(loss - want_loss) <= RTOL * abs(want_loss), (p, m, rank, loss, want_loss)
            for name, g in grads.items():
                err = rel_err(g, want[name], floor=1e-3)
                assert err <= RTOL, (
                    f"p={p} m={m} rank {rank}: gradient of {name} off by {err:.2e} relative"
                )
            seen |= set(grads)
        assert seen == set(want), (
            p,
            m,
            sorted(set(want) - seen),
        )  # every parameter held by some rank
