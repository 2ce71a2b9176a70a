"""ZeRO data parallel with torchrun: the same training loop, model data sharded across ranks.

One machine, two processes:
    torchrun --nproc-per-node 2 examples/zero_torchrun.py

Two machines (run the same command on each, with its own --node-rank; MASTER is node 0's address):
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr MASTER --master-port 29500 \\
        examples/zero_torchrun.py --device cuda

chunkmem.prepare sees torchrun's environment, initialises the process group (NCCL on GPUs, gloo on
CPUs) and gives each rank 1/N of the parameters, gradients, master weights and optimizer states.
Each rank feeds its own shard of the global batch; gradients are averaged as DDP does.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import chunkmem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)  # every rank builds the same initial model
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    device = args.device if args.device == "cpu" else f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    model, optimizer = chunkmem.prepare(model, optimizer, chunkmem.Config(device=device))
    rank, world = dist.get_rank(), dist.get_world_size()

    generator = torch.Generator().manual_seed(1)  # the same global batches everywhere; each rank takes its shard
    for step in range(args.steps):
        ids = torch.randint(0, 256, (args.global_batch, 32), generator=generator).chunk(world)[rank]
        loss = model(ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.6f}")
    print(f"rank {rank}/{world}: model data {model.memory_stats()['model_data_bytes']} bytes")
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
