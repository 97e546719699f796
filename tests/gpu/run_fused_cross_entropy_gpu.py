"""GPU check of the fused head + loss (plait.layers.fused_cross_entropy), run on a lent GPU:

    python tests/gpu/run_fused_cross_entropy_gpu.py

1. float32 (TF32 off), small: fused == unfused (loss, hidden, weight and bias gradients) to 1e-6
   relative, as on CPU (tests/test_fused_cross_entropy.py).
2. bfloat16 at Llama-3 size (8192 tokens, hidden 4096, vocabulary 128256, tp=1): fused vs unfused
   agreement (bf16 rounding: 1e-2), the memory held from forward to backward (fused: only the weight
   and hidden gradients it computed), the peak memory of a forward + backward, and its time (median
   of 5 after a warm-up), for chunks of 1024, 2048 and 4096 tokens.
3. A tiny Llama in bf16 with ``fused_loss_chunk_tokens`` on and off: the same loss to bf16 rounding.
Prints one line per check; exit 1 on failure.
"""

import sys
import time

import torch
import torch.nn.functional as F

from plait.layers import TransformerModel, fused_linear_cross_entropy, vocab_parallel_cross_entropy
from plait.models import preset

MIB = 2**20


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


VOCAB = 128256


def head(fused, x, w, b, t, chunk, vocab):
    kw = dict(vocab_size=vocab, label_smoothing=0.1)
    if fused:
        return fused_linear_cross_entropy(x, w, b, t, chunk_tokens=chunk, **kw)
    return vocab_parallel_cross_entropy(F.linear(x, w, b), t, **kw)


def step(fused, x0, w0, b0, t, chunk, vocab=VOCAB):
    """Forward + backward; returns (loss, grads, bytes held between them, peak bytes over the start)."""
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    b = None if b0 is None else b0.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    losses = head(fused, x, w, b, t, chunk, vocab)
    loss = losses.sum() / (t != -100).sum()
    held = torch.cuda.memory_allocated() - start
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grads = [x.grad, w.grad] + ([] if b is None else [b.grad])
    return losses.detach(), grads, held, peak


def check_fp32(failures):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 64, device="cuda", generator=g)
    w = torch.randn(VOCAB // 32, 64, device="cuda", generator=g) * 0.2
    b = torch.randn(w.shape[0], device="cuda", generator=g) * 0.1
    t = torch.randint(0, 3000, (1000,), device="cuda", generator=g)
    t[::7] = -100
    ref = step(False, x, w, b, t, 0, vocab=3000)  # rows >= 3000 are padding
    got = step(True, x, w, b, t, 300, vocab=3000)
    errs = [rel(a, r) for a, r in zip([got[0]] + got[1], [ref[0]] + ref[1])]
    ok = max(errs) <= 1e-6
    print(
        f"fp32 parity (loss, hidden, weight, bias): {['%.1e' % e for e in errs]} {'ok' if ok else 'FAIL'}"
    )
    if not ok:
        failures.append("fp32 parity")


def check_bf16_large(failures):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(8192, 4096, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(VOCAB, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    t = torch.randint(0, VOCAB, (8192,), device="cuda", generator=g)
    t[:100] = -100
    results = {}
    for name, fused, chunk in [
        ("unfused", False, 0),
        ("fused-1024", True, 1024),
        ("fused-2048", True, 2048),
        ("fused-4096", True, 4096),
    ]:
        step(fused, x, w, None, t, chunk)  # warm-up
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = step(fused, x, w, None, t, chunk)
            times.append(time.perf_counter() - t0)
        results[name] = out
        print(
            f"bf16 8192x4096 -> V {VOCAB}: {name}: held fwd->bwd {out[2] / MIB:.0f} MiB, peak {out[3] / MIB:.0f} "
            f"MiB, fwd+bwd {1e3 * sorted(times)[2]:.1f} ms (median of 5)"
        )
    ref = results["unfused"]
    for name in ("fused-1024", "fused-2048", "fused-4096"):
        got = results[name]
        errs = [rel(a, r) for a, r in zip([got[0]] + got[1], [ref[0]] + ref[1])]
        # Held from forward to backward: only the gradients it computed, the hidden one in bf16 and the weight's
        # float32 sum over chunks (kept float32 until backward scales it: commit 0ab7085; 2 B/element before).
        ok = (
            errs[0] < 1e-3
            and max(errs[1:]) < 1e-2
            and got[2] <= w.numel() * 4 + x.numel() * 2 + 4 * MIB
        )
        print(
            f"  {name} vs unfused (loss, hidden, weight): {['%.1e' % e for e in errs]} {'ok' if ok else 'FAIL'}"
        )
        if not ok:
            failures.append(name)


def check_model(failures):
    cfg = preset(
        "llama-tiny",
        vocab_size=1001,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        label_smoothing=0.1,
    )
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1001, (2, 65), generator=g).cuda()
    losses = []
    for chunk in (0, 48):
        model = TransformerModel(
            cfg.replace(fused_loss_chunk_tokens=chunk), seed=4, device="cuda", dtype=torch.bfloat16
        )
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        losses.append(loss.float().item())
    ok = abs(losses[0] - losses[1]) <= 1e-2 * abs(losses[0])
    print(
        f"tiny llama bf16 loss unfused {losses[0]:.5f} fused {losses[1]:.5f} {'ok' if ok else 'FAIL'}"
    )
    if not ok:
        failures.append("model")


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    failures = []
    check_fp32(failures)
    check_bf16_large(failures)
    check_model(failures)
    print("FAILED: " + ", ".join(failures) if failures else "all ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
