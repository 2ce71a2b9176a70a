"""Hugging Face architectures nobody here wrote, each under a device budget below its model data:
fp32 bit-identical to plain PyTorch, bf16 bit-identical to plain PyTorch mixed precision (tests/zoo.py builds
them)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from benchmarks.overhead import plain_step
from tests import zoo
from tests.helpers import least_accepted, param_bytes, prepared, train

pytest.importorskip("transformers")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
ARCHS = zoo.available()
BF16_FIRST_LOSS = 0.03, 0.02  # within 3% of fp32's before any update, plus 0.02 (small losses of vision models)


def test_the_zoo_is_broad() -> None:
    assert len(ARCHS) >= 15, [a.name for a in ARCHS]
    assert {"causal", "masked", "seq2seq", "image", "speech", "speech2text", "contrastive"} <= {a.inputs for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_architecture_trains_like_pytorch_under_a_budget_below_its_model_data(arch: zoo.Arch) -> None:
    model, batches = arch.build(), arch.batches(2) * 2  # the same two batches twice: the loss must fall
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, zoo.loss)
    # Half the parameter bytes (an eighth of the model data), or the least budget prepare accepts if more.
    budget = least_accepted(model, ADAMW, low=param_bytes(model) // 2)

    cm, opt = prepared(model, ADAMW, device_memory=budget)
    assert train(cm, opt, batches, zoo.loss) == expected
    state = cm.state_dict()
    assert state.keys() == ref.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    stats = cm.memory_stats()
    assert stats["model_data_bytes"] > 2 * budget and stats["evictions"] > 0, "chunks must move"
    assert stats["device_chunk_bytes_peak"] <= stats["device_limit_bytes"]

    cm, opt = prepared(model, ADAMW, device_memory=least_accepted(model, ADAMW, low=budget // 2, dtype="bf16"),
                       dtype="bf16")
    losses = train(cm, opt, batches, zoo.loss)
    assert losses == plain_bf16(copy.deepcopy(model), batches)
    assert cm.memory_stats()["evictions"] > 0, "chunks must move"
    relative, absolute = BF16_FIRST_LOSS
    assert abs(losses[0] - expected[0]) <= relative * expected[0] + absolute, (losses, expected)
    assert losses[2] < 0.98 * losses[0] and losses[3] < 0.98 * losses[1], "each batch seen again must fit better"


def plain_bf16(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """The losses of plain PyTorch mixed precision (benchmarks/overhead.py's bf16 step: bf16 parameters, fp32
    master weights and AdamW states) on `batches`, its floating inputs cast to bf16 as chunkmem casts them.
    BatchNorm's bf16 weight and bias reach the op cast to its statistics' fp32 (a parametrization; chunkmem
    casts them the same way), which torch's mixed-precision batch norm requires."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            for name in ("weight", "bias"):
                parametrize.register_parametrization(module, name, _ToFloat())
    losses: list[float] = []
    left = iter(batches)

    def loss(plain: nn.Module) -> torch.Tensor:
        batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in next(left).items()}
        value = zoo.loss(plain, batch)
        losses.append(value.item())
        return value

    step = plain_step(model, loss, torch.bfloat16, ADAMW)
    for _ in batches:
        step()
    return losses


class _ToFloat(nn.Module):
    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float()
