"""The model, batch and budgets of the CUDA budgets issue's table, which benchmarks/gpu_offload.py runs beside the
speed issue's: a transformers LLaMA (hidden 2048, 20 layers: 1.16B parameters) in bf16 with AdamW, batch 4 x 1024,
at budgets of what the process holds outside the allocator + 1.15 x the activation peak of the same step in plain
PyTorch + a share of the model data; in the CPU simulation, the same scaled down 256 times (tests/test_budgets.py's
case), its allocator's sizes with it.
"""

from __future__ import annotations

import torch

SHAPES = {"cuda": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
                       num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024),
          "cpu": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=20, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=2000, max_position_embeddings=128),
          # launch-bound (issue 36's other size): kernels cost next to nothing, so a GPU waits on the host. Its
          # embedding is to a layer as the 1.16B model's is (about 1.3 layers), so that it has that model's 9 chunk
          # groups, each a call the optimizer makes (benchmarks/overhead.py's --vocab 1024; 256 gave 42)
          "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=20, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=1024, max_position_embeddings=64)}
BATCH = {"cuda": (4, 1024), "cpu": (4, 64), "tiny": (1, 16)}
DIVISOR = 256  # the simulation's scale: its allocator's sizes too


def model(device: str, shape: str | None = None) -> torch.nn.Module:
    """The LLaMA of SHAPES[shape] (by default the one for `device`), built on `device`: a CUDA GPU draws the 1.16B
    random weights in a blink, where a CPU core takes half a minute, in each of the benchmark's processes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**SHAPES[shape or device]))


def host_model(device: str, shape: str | None = None) -> torch.nn.Module:
    """model(), on the host (what chunkmem.prepare and FSDP2's CPU offload take), none of it left on the device."""
    net = model(device, shape).cpu()
    if device == "cuda":
        torch.cuda.empty_cache()
    return net


def ids(device: str, shape: str | None = None) -> torch.Tensor:
    vocab = SHAPES[shape or device]["vocab_size"]
    return torch.randint(0, vocab, BATCH[shape or device], generator=torch.Generator().manual_seed(1))


def plain_peak(device: str, shape: str | None = None) -> dict[str, int]:
    """The activation peak of one plain bf16 step (gradients included) and the model data chunkmem keeps."""
    net = model(device, shape).to(torch.bfloat16)
    data = sum(p.numel() for p in net.parameters()) * (2 + 2 + 4 + 4 + 4)  # param, grad, fp32 master, 2 states
    batch = ids(device, shape)
    if device == "cuda":
        net = net.cuda()
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        net(batch.cuda(), labels=batch.cuda()).loss.backward()
        torch.cuda.synchronize()
        return {"activations": torch.cuda.max_memory_allocated() - static, "model_data": data}
    from chunkmem.memory.allocator import Sizes
    from chunkmem.memory.simmemory import use_simulated_memory

    memory = use_simulated_memory(Sizes.scaled(DIVISOR))
    for param in net.parameters():
        memory.charge(param.data)
    static = memory.allocator.allocated
    net(batch, labels=batch).loss.backward()
    return {"activations": memory.allocator.peak_allocated - static, "model_data": data}


def held_after_a_step() -> int:
    """What a process holds on the device once a prepared model has trained: selftest.budget_for's budget with
    nothing for model data (reserved memory, memory outside the allocator, two allocator segments)."""
    from chunkmem.selftest import budget_for

    return budget_for("cuda", 0) or 0

