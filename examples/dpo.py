"""DPO with a trained policy and a frozen reference under one chunkmem budget, smaller than both models' data.

    python examples/dpo.py                   # CPU simulation of a device: 50% of the two models' data
    python examples/dpo.py --budget 0.25 --check
    python examples/dpo.py --device cuda --dtype bf16

One `chunkmem.Manager` prepares both models: one device budget, one plan over the accesses of both, the
reference's forward being part of each step. The DPO loss is written out (Rafailov et al. 2023): the policy's
log-probability margin of the chosen over the rejected answer, against the reference's. `--check` trains
plain PyTorch copies side by side and says whether losses and the policy's weights are bit-identical (fp32).

Preference pairs are made from this repository's source, byte by byte (no downloads, no tokenizer): the
chosen answer is the text that follows a prompt, the rejected one the same bytes shuffled.
"""

from __future__ import annotations

import argparse
import copy
import pathlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import chunkmem
from chunkmem.chunks.family import Families
from chunkmem.chunks.store import planned_model_data_bytes

CHUNK = 2**16  # elements per chunk: small models, several chunks each


def preference_pairs(steps: int, batch: int, prompt: int, answer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(chosen, rejected) token batches: a prompt followed by the true continuation, or by it shuffled."""
    root = pathlib.Path(__file__).resolve().parent.parent
    text = b"".join(p.read_bytes() for p in sorted(root.glob("chunkmem/*.py")))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - prompt - answer, (batch,), generator=gen)
        chosen = torch.stack([data[s:s + prompt + answer] for s in starts])
        order = torch.argsort(torch.rand(batch, answer, generator=gen), dim=1)
        rejected = torch.cat([chosen[:, :prompt], chosen[:, prompt:].gather(1, order)], dim=1)
        pairs.append((chosen, rejected))
    return pairs


def sequence_logps(model: nn.Module, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The log-probability of each sequence's answer (the tokens after the prompt) under `model`."""
    logits = model(ids).logits[:, prompt - 1:-1].float()
    targets = ids[:, prompt:].to(logits.device)
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1).sum(-1)


def dpo_loss(policy: nn.Module, reference: nn.Module, chosen: torch.Tensor, rejected: torch.Tensor, prompt: int,
             beta: float = 0.1) -> torch.Tensor:
    with torch.no_grad():
        ref_margin = sequence_logps(reference, chosen, prompt) - sequence_logps(reference, rejected, prompt)
    margin = sequence_logps(policy, chosen, prompt) - sequence_logps(policy, rejected, prompt)
    return -F.logsigmoid(beta * (margin - ref_margin.to(margin.device))).mean()


def tiny_llama(seed: int, layers: int, width: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=256))


def models_data_bytes(policy: nn.Module, reference: nn.Module, dtype: torch.dtype) -> int:
    """The chunk bytes of both: the policy with AdamW's two states, the reference frozen (parameters only)."""
    frozen = copy.deepcopy(reference).requires_grad_(False)
    return planned_model_data_bytes(policy, CHUNK, Families.declare(dtype, ("exp_avg", "exp_avg_sq"))) + \
        planned_model_data_bytes(frozen, CHUNK, Families.declare(dtype))


def activation_peak(policy: nn.Module, reference: nn.Module, pair: tuple[torch.Tensor, torch.Tensor], prompt: int,
                    device: str) -> int:
    """What one plain DPO step reserves on `device` beyond the parameters (activations, temporaries, gradients), in
    the caching allocator's segments; in the simulation, as its model of that allocator places them."""
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    if device == "cpu":
        from chunkmem.memory.simmemory import simulated_memory

        memory = simulated_memory()
        if memory is None:  # CHUNKMEM_SIM_MEMORY=0: memory is not modelled
            return 0
        for param in [*policy.parameters(), *reference.parameters()]:
            memory.charge(param.data)
        static = memory.allocator.reserved
        dpo_loss(policy, reference, *pair, prompt).backward()
        return memory.allocator.peak_reserved - static
    policy.to(device), reference.to(device)
    static = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    dpo_loss(policy, reference, *(ids.to(device) for ids in pair), prompt).backward()
    return torch.cuda.max_memory_reserved(device) - static


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="'cpu' (simulation), 'cuda' or 'cuda:N'")
    parser.add_argument("--budget", type=float, default=0.5, help="the share of both models' data the budget holds")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--check", action="store_true", help="train plain PyTorch copies and compare")
    args = parser.parse_args()

    policy = tiny_llama(0, layers=4, width=128)
    reference = copy.deepcopy(policy)  # DPO starts the policy from the reference
    plain = (copy.deepcopy(policy), copy.deepcopy(reference)) if args.check else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    prompt, pairs = 32, preference_pairs(args.steps, 4, 32, 64)
    data = models_data_bytes(policy, reference, torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    budget = int(1.15 * activation_peak(policy, reference, pairs[0], prompt, args.device) + args.budget * data)
    manager = chunkmem.Manager(chunkmem.Config(device=args.device, dtype=args.dtype, chunk_size=CHUNK,
                                               device_memory=budget))
    policy, optimizer = manager.prepare(policy, optimizer)
    reference = manager.prepare(reference)
    print(f"two models, {data / 2**20:.1f} MiB of model data; one device budget of {budget / 2**20:.1f} MiB")
    losses = []
    for step, (chosen, rejected) in enumerate(pairs):
        loss = dpo_loss(policy, reference, chosen, rejected, prompt)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step}: DPO loss {loss.item():.6f}")
    stats = manager.memory_stats()
    print(f"device peak {stats['device_bytes_peak'] / 2**20:.2f} MiB of {budget / 2**20:.2f}; moved per step: "
          f"h2d {stats['h2d_bytes'] / args.steps / 2**20:.2f} MiB, d2h {stats['d2h_bytes'] / args.steps / 2**20:.2f} MiB")
    if plain is not None:
        plain_policy, plain_reference = plain
        plain_optimizer = torch.optim.AdamW(plain_policy.parameters(), lr=1e-4)
        expected = []
        for chosen, rejected in pairs:
            loss = dpo_loss(plain_policy, plain_reference, chosen, rejected, prompt)
            loss.backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()
            expected.append(loss.item())
        ours, theirs = policy.state_dict(), plain_policy.state_dict()
        same = losses == expected and all(torch.equal(ours[k], theirs[k]) for k in theirs)
        print(f"plain PyTorch: {'bit-identical' if same else 'DIFFERENT'} losses and policy weights")


if __name__ == "__main__":
    main()
