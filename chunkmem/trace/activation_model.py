"""How many bytes autograd saves for backward in one step of a decoder-only transformer.

[Note: where the GPT-2 numbers come from]
Counted, per token, from the tensors Hugging Face's GPT-2 saves for backward (unique storages, as
chunkmem.runtime.activations counts them; weights excluded, they are chunk views), e = compute dtype bytes:
  per layer, attention with dropout (PyTorch's "math" scaled-dot-product path, which the CPU and
  eager attention take; it computes in fp32): 27*h*e + 3*h*4 (q, k, v upcast) + 3*heads*s*4
  (probabilities, dropout mask, dropped probabilities) + 4*e (two layer norms' mean and rstd);
  per layer, fused attention (flash / memory-efficient, or the CPU's fused kernel without dropout):
  30*h*e + heads*4 (log-sum-exp) + 4*e;
  once: (2 + embedding dropout)*h*e + 2*e (final norm) + vocab*4 (log-softmax of the fp32 logits
  the loss upcasts) + 16 + 8/b (token ids, labels, position ids; int64).
With activation checkpointing the forward keeps only each layer's input (h*e per token per layer)
plus the once-only terms; backward then recomputes one layer at a time, so the estimate adds one
layer's activations. The CPU simulation measures the forward's part only: torch.utils.checkpoint
keeps recomputed tensors in its own frame, where no saved-tensor hook sees them.
Other families (LLaMA-style: gated MLP of `intermediate` width, RMS norm) use the same structure with
the MLP term scaled by their intermediate width; that is an approximation, documented as such.
"""

from __future__ import annotations

import dataclasses

ATTENTION = ("math", "fused")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the activation estimate needs of a model."""

    family: str  # "gpt2" (exact counts above) or "generic"
    layers: int
    hidden: int
    heads: int
    vocab: int
    intermediate: int  # MLP width (4*hidden for GPT-2)
    attn_dropout: float = 0.0
    embd_dropout: float = 0.0


@dataclasses.dataclass(frozen=True)
class Activations:
    """Bytes saved for backward at the end of the forward, and the peak including recomputation."""

    per_layer: int
    once: int
    boundaries: int  # checkpointing: the layer inputs kept
    peak: int
    forward_peak: int  # at the end of the forward (what the CPU simulation measures)


def estimate(shape: Shape, batch: int, seq: int, itemsize: int, checkpointing: bool, attention: str) -> Activations:
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION}")
    tokens = batch * seq
    e, h = itemsize, shape.hidden
    mlp = 5 * shape.intermediate * e if shape.family == "gpt2" else 3 * shape.intermediate * e + 2 * h * e
    if attention == "math" and shape.attn_dropout > 0:
        attn = 7 * h * e + 3 * h * 4 + 3 * shape.heads * seq * 4
    else:  # fused kernels (and the CPU's own when there is no dropout): q, k, v, output, log-sum-exp
        attn = 10 * h * e + shape.heads * 4
    per_layer = tokens * (attn + mlp + 4 * e)
    once = tokens * ((2 + (shape.embd_dropout > 0)) * h * e + 2 * e + shape.vocab * 4 + 16) + 8 * seq
    if not checkpointing:
        peak = shape.layers * per_layer + once
        return Activations(per_layer, once, 0, peak, peak)
    boundaries = shape.layers * tokens * h * e
    return Activations(per_layer, once, boundaries, boundaries + once + per_layer, boundaries + once)
