"""Train a small GPT-2 with a device budget smaller than its model data, and print what moved.

    python examples/train_gpt2.py                      # CPU simulation of a device, 40% of the model data
    python examples/train_gpt2.py --device cuda --budget 0.25 --dtype bf16

The device budget is room for the activations of one step (measured on a plain copy of the model, with 15% to
spare) plus a fraction of the model data (`--budget`): activations take device memory besides the chunks, and
the simulation places them as CUDA's caching allocator would, so a budget that cannot hold them fails there as
it would on a GPU.

The text is this repository's own Python source, read byte by byte (no downloads, no tokenizer).
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import time

import torch
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

import chunkmem


def byte_batches(steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    root = pathlib.Path(__file__).resolve().parent.parent
    text = b"".join(p.read_bytes() for p in sorted(root.glob("chunkmem/*.py")))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - seq, (steps, batch), generator=gen)
    return [torch.stack([data[s:s + seq] for s in row]) for row in starts]


def activation_peak(model: torch.nn.Module, ids: torch.Tensor, device: str) -> int:
    """What one plain step reserves on `device` beyond its parameters: activations, temporaries and gradients, in
    the caching allocator's segments. In the simulation, as its model of that allocator places them
    (chunkmem/memory/simmemory.py)."""
    plain = copy.deepcopy(model)
    if device == "cpu":
        from chunkmem.memory.simmemory import simulated_memory

        memory = simulated_memory()
        if memory is None:  # CHUNKMEM_SIM_MEMORY=0: memory is not modelled
            return 0
        for param in plain.parameters():
            memory.charge(param.data)
        static = memory.allocator.reserved
        plain(ids, labels=ids).loss.backward()
        return memory.allocator.peak_reserved - static
    plain.to(device)
    static = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    plain(ids.to(device), labels=ids.to(device)).loss.backward()
    return torch.cuda.max_memory_reserved(device) - static


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="'cpu' (simulation), 'cuda' or 'cuda:N'")
    parser.add_argument("--budget", type=float, default=0.4, help="the share of the model data the device budget holds")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=args.width, n_layer=args.layers,
                        n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    model_data = param_bytes * 4  # fp32 AdamW: parameters, gradients, two states
    batches = byte_batches(args.steps, 8, 128)
    budget = int(1.15 * activation_peak(model, batches[0], args.device) + model_data * args.budget)
    model, optimizer = chunkmem.prepare(model, optimizer, chunkmem.Config(
        device=args.device, device_memory=budget, dtype=args.dtype))
    stats = model.memory_stats()
    print(f"model: {param_bytes / 2**20:.1f} MiB of fp32 parameters, model data {stats['model_data_bytes'] / 2**20:.1f}"
          f" MiB in {stats['num_chunks']} chunks of {stats['chunk_size']} elements; "
          f"device budget {budget / 2**20:.1f} MiB")

    start = time.perf_counter()
    progress = tqdm(batches, desc="training", unit="step")
    for ids in progress:
        loss = model(ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        progress.set_postfix(loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - start
    stats = model.memory_stats()
    print(f"final loss {loss.item():.3f} after {args.steps} steps in {elapsed:.1f}s")
    mib = {k: v / 2**20 for k, v in stats.items()}
    print(f"device peak {mib['device_bytes_peak']:.2f} MiB, chunks {mib['device_chunk_bytes_peak']:.2f} MiB "
          f"(limit {mib['device_limit_bytes']:.2f} MiB); moved per step: "
          f"h2d {mib['h2d_bytes'] / args.steps:.2f} MiB, d2h {mib['d2h_bytes'] / args.steps:.2f} MiB")


if __name__ == "__main__":
    main()
