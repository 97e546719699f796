"""A training script written for DeepSpeed's engine, as in DeepSpeed's tutorials; only the import line
names plait. Run with ``torchrun --nproc-per-node 2 deepspeed_engine_script.py --deepspeed --deepspeed_config
CFG --out DIR [--resume]``.

Trains an unmodified ``BertForMaskedLM`` for 3 steps over the loader ``deepspeed.initialize`` returns, saves a
checkpoint with ``client_state``, trains 2 more; with ``--resume`` it loads that checkpoint instead of the
first 3 steps. Rank 0 writes DIR/result[-resumed].json: the losses it saw, the client state, global_steps and
a checksum of the weights.
"""

import argparse
import json

import torch
import transformers

import plait.deepspeed as deepspeed  # was: import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
model = transformers.BertForMaskedLM(
    transformers.BertConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
)
data = [torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(i)) for i in range(40)]
engine, optimizer, loader, _ = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), training_data=data
)
losses, client = [], None
if args.resume:
    _, client = engine.load_checkpoint(f"{args.out}/ckpt")
batches = iter(loader)
for step in range(5):
    ids = next(batches).to(engine.device)
    if args.resume and step < 3:
        continue  # trained before the checkpoint
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    if step == 2 and not args.resume:
        engine.save_checkpoint(f"{args.out}/ckpt", client_state={"epoch": 1, "seen": 3})
with engine.gathered_parameters():
    checksum = float(sum(p.detach().double().abs().sum() for p in engine.module.parameters()))
if deepspeed.comm.get_rank() == 0:
    name = "result-resumed" if args.resume else "result"
    with open(f"{args.out}/{name}.json", "w") as f:
        json.dump(
            {
                "losses": losses,
                "client_state": client,
                "global_steps": engine.global_steps,
                "dp": engine.dp_world_size,
                "checksum": checksum,
            },
            f,
        )
