"""Compiled mixture-of-experts blocks (``plait.engine.compile``): the host's read of an expert-parallel layer's
all-to-all sizes breaks a compiled block once, with eager's results bitwise (aot_eager runs eager's ops)."""

import torch
import torch.distributed as dist

from plait.layers import TransformerModel
from moe_helpers import grads_of, moe_tiny


def compiled_ep_body(regions):
    """ep 2 (gloo), two steps of the model compiled per block (aot_eager: eager's ops, so bitwise) with
    ``compile_regions`` (``regions``) or a bare ``torch.compile`` per block: (graph breaks, graphs compiled,
    loss and gradients equal to an eager copy's at both steps, last loss)."""
    import types

    from test_engine import micro_batch
    from torch._dynamo.utils import counters

    from plait.engine.compile import compile_regions
    from plait.layers import TransformerBlock
    from plait.parallel import ParallelMesh

    torch._dynamo.reset()
    counters.clear()
    model, ref = (
        TransformerModel(moe_tiny(), ParallelMesh(ep=2), seed=5).to(torch.bfloat16)
        for _ in range(2)
    )
    if regions:
        compile_regions(model, backend="aot_eager")
    else:
        for block in (m for m in model.modules() if isinstance(m, TransformerBlock)):
            block.forward = types.MethodType(
                torch.compile(TransformerBlock.forward, backend="aot_eager"), block
            )
    same = []
    for step in range(2):
        losses = [m(**micro_batch(0, step, dist.get_rank())) for m in (model, ref)]
        for loss in losses:
            loss.backward()
        same.append(
            losses[0].item() == losses[1].item()
            and all(torch.equal(g, grads_of(ref)[n]) for n, g in grads_of(model).items())
        )
    return (
        sum(counters["graph_break"].values()),
        counters["stats"]["unique_graphs"],
        all(same),
        losses[0].item(),
    )


def test_a_compiled_expert_parallel_block_breaks_once_with_eager_results():
    """``compile_regions`` traces each block with ``nested_graph_breaks``: the host's read of the ep
    all-to-all's split sizes (in ``expert_parallel``, four calls below the block's ``forward``) breaks the
    block's graph once, not once per frame on the way, with eager's loss and gradients bitwise on both ranks.
    A bare ``torch.compile`` of the blocks (the head left eager) breaks in every frame and compiles more
    graphs (the control)."""
    from plait.testing import run_distributed

    nested, bare = (run_distributed(compiled_ep_body, 2, regions) for regions in (True, False))
    for (breaks, graphs, same, loss), (bare_breaks, bare_graphs, bare_same, _) in zip(nested, bare):
        assert breaks == 1 and same and loss > 0
        assert bare_breaks > 1 and bare_graphs > graphs and bare_same
