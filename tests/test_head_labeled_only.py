"""``TransformerConfig.head_labeled_only``: the head projects and scores only the positions with a label
(BERT's masked positions) and gives the same loss and gradients as scoring every position.

Tolerance TOL = 1e-6 relative (``rel_err``, l2): both paths compute the same float32 logits rows for the
labeled positions; the unlabeled rows add exact zeros to the weight and bias gradients, so only the
summation order of those matmuls differs (float32 roundings, ~1e-7 of values of order 1), as in
test_fused_cross_entropy.py.
"""

import torch
from helpers import rel_err, tiny

import plait.layers.ends as model_module
from plait.data import mask_tokens
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed

TOL = 1e-6


def mlm_batch(vocab: int) -> dict:
    """``[3, 16]`` ids with BERT's 15% masking (labels -100 except at the selected positions)."""
    ids = torch.randint(6, vocab, (3, 16), generator=torch.Generator().manual_seed(7))
    masked, labels = mask_tokens(
        ids, 4, vocab, range(6), 0.15, generator=torch.Generator().manual_seed(8)
    )
    return {"input_ids": masked, "labels": labels}


def loss_and_grads(labeled_only: bool, mesh=None, sp: bool = False, chunk: int = 0):
    cfg = tiny(
        "bert",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        head_labeled_only=labeled_only,
        fused_loss_chunk_tokens=chunk,
    )
    model = TransformerModel(cfg, mesh, sequence_parallel=sp, seed=3)
    loss = model(**mlm_batch(cfg.vocab_size))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def worst_difference(mesh=None, sp: bool = False, chunk: int = 0) -> float:
    (loss_a, g_a), (loss_b, g_b) = (
        loss_and_grads(True, mesh, sp, chunk),
        loss_and_grads(False, mesh, sp, chunk),
    )
    return max([rel_err(loss_a, loss_b)] + [rel_err(g_a[n], g_b[n], floor=1e-3) for n in g_b])


def test_same_loss_and_gradients_one_process():
    assert worst_difference() <= TOL
    assert worst_difference(chunk=5) <= TOL  # the fused head + loss takes the scored rows too


def test_the_head_scores_only_the_labeled_rows(monkeypatch):
    seen = []
    original = model_module.vocab_parallel_cross_entropy

    def spy(logits, labels, **kw):
        seen.append((tuple(logits.shape[:-1]), int((labels != -100).sum())))
        return original(logits, labels, **kw)

    monkeypatch.setattr(model_module, "vocab_parallel_cross_entropy", spy)
    labeled = int((mlm_batch(257)["labels"] != -100).sum())
    loss_and_grads(True)
    loss_and_grads(False)
    assert 0 < labeled < 3 * 16 // 2
    assert seen == [((labeled,), labeled), ((3, 16), labeled)]


def _tp2_body():
    return worst_difference(ParallelMesh(tp=2), sp=True)


def test_same_loss_and_gradients_tp2_sequence_parallel():
    """Every tp rank selects the same rows of the gathered sequence; vocab-parallel loss over them."""
    for worst in run_distributed(_tp2_body, 2, timeout_s=120):
        assert worst <= TOL
