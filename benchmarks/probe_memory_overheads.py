"""The fixed GPU overheads ``plait.fit`` adds to a planned peak: the CUDA context (memory the driver holds that
``torch.cuda.memory_reserved`` does not count) and the caching allocator's fragmentation (reserved over
allocated at the peak), measured on the device at hand.

    python benchmarks/probe_memory_overheads.py --micro 4   (and --micro 1)

An unmodified ``transformers.LlamaForCausalLM`` of TinyLlama's shape (1.1B), bf16 weights, torch's fused AdamW
(fp32 states), the Trainer's ``gradient_checkpointing``; three steps of random tokens. Prints one
``RESULT {json}`` line: ``context`` (device bytes in use minus reserved, after the steps), ``max_alloc``,
``max_res`` and their ratio (``plait.fit.plan.CUDA_CONTEXT_BYTES``, ``ALLOCATOR_SLACK_BYTES``).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--layers", type=int, default=22)
    cli.add_argument("--micro", type=int, default=4)
    cli.add_argument("--seq", type=int, default=2048)
    opt = cli.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=opt.layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=opt.seq,
    )
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (opt.micro, opt.seq), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    out = {
        "micro": opt.micro,
        "used_before": total - free0,
        "context": used - torch.cuda.memory_reserved(),
        "max_alloc": torch.cuda.max_memory_allocated(),
        "max_res": torch.cuda.max_memory_reserved(),
    }
    out["ratio"] = out["max_res"] / out["max_alloc"]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
