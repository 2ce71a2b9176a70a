"""Pipeline parallel training with chunk-managed stages, launched with torchrun.

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py --steps 5            # 2 stages
    torchrun --nproc-per-node 4 examples/pipeline_torchrun.py --data-parallel 2    # 2 pipelines x 2 stages

Every rank builds the same nn.Sequential and passes the same batch to `pipe.step`; each keeps only
its stage's layers, in chunks under its own device budget (here the CPU simulation, 8 MiB each:
less than a stage's model data, so chunks move). `balance="auto"` profiles the layers on the first
micro-batch and gives each stage a share that minimises the slowest stage.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import chunkmem


class Blocks(nn.Module):
    """A residual MLP block: enough structure to make stages uneven."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build(vocab: int, width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same initial model
    return nn.Sequential(nn.Embedding(vocab, width), *[Blocks(width) for _ in range(depth)], nn.LayerNorm(width),
                         nn.Linear(width, vocab))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description="pipeline-parallel training with chunkmem")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=10, help="any size: need not divide by --microbatches")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b",
                        choices=["gpipe", "1f1b", "interleaved", "zero-bubble", "zbv", "2bw"])
    parser.add_argument("--data-parallel", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    vocab, seq = 256, 32
    pipe = chunkmem.pipeline(
        build(vocab, width=128, depth=6),
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        next_token_loss,
        n_microbatches=args.microbatches, schedule=args.schedule, balance="auto", checkpoint="except_last",
        config=chunkmem.Config(device="cpu", device_memory="8MiB", chunk_size=2**17),
        data_parallel=args.data_parallel)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch_size, seq + 1), generator=gen)  # the same on every rank
        loss = pipe.step(tokens[:, :-1], tokens[:, 1:])
        shown = step - 1 if args.schedule == "2bw" else step  # 2BW: the loss of the mini-batch before
        if torch.distributed.get_rank() == 0 and shown >= 0:
            print(f"step {shown} loss {loss:.4f}", flush=True)
    if args.schedule == "2bw":  # drain: the last mini-batch's backwards and update, and its loss
        loss = pipe.flush()
        if torch.distributed.get_rank() == 0:
            print(f"step {args.steps - 1} loss {loss:.4f}", flush=True)
    stats = pipe.model.memory_stats()
    where = f"stage {pipe.stage}" if len(pipe.stages) == 1 else f"stages {pipe.stages}"  # interleaved: several
    print(f"rank {torch.distributed.get_rank()}: {where} of {pipe.n_stages}, balance {pipe.balance}, "
          f"model data {stats['model_data_bytes']} bytes, device limit {stats['device_limit_bytes']}", flush=True)
    state = pipe.state_dict()  # consolidated, with the original keys, on every rank
    if torch.distributed.get_rank() == 0:
        print(f"consolidated state dict: {len(state)} tensors", flush=True)
    torch.distributed.barrier()  # no rank tears gloo down while a peer still talks to it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
