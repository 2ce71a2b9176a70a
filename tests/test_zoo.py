"""Hugging Face architectures nobody here wrote, each under a device budget below its model data:
fp32 bit-identical to plain PyTorch, bf16 bit-identical to itself with everything on the device and tracking
fp32 (tests/zoo.py builds them)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests import zoo
from tests.helpers import least_accepted, param_bytes, prepared, train

pytest.importorskip("transformers")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
ARCHS = zoo.available()
# bf16 loss within (relative, absolute) of fp32's (absolute: the small losses of vision models). After updates at
# lr 1e-2 the rounding compounds: ResNet's third loss is 7.5% off fp32 on an AVX2 CPU (within 3% + 0.02 on an
# AVX-512 one, where this bound was once 3% for every step).
BF16_FIRST = 0.03, 0.02
BF16_LATER = 0.15, 0.02


def test_the_zoo_is_broad() -> None:
    assert len(ARCHS) >= 15, [a.name for a in ARCHS]
    assert {"causal", "masked", "seq2seq", "image"} <= {a.inputs for a in ARCHS}


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

    # bf16: streaming under the budget lands on the bits of the same model with everything on the device.
    cm, opt = prepared(model, ADAMW, device_memory=least_accepted(model, ADAMW, low=budget // 2, dtype="bf16"),
                       dtype="bf16")
    losses = train(cm, opt, batches, zoo.loss)
    fitting, fitting_opt = prepared(model, ADAMW, dtype="bf16")
    assert train(fitting, fitting_opt, batches, zoo.loss) == losses
    assert all(torch.equal(a, b) for a, b in zip(cm.state_dict().values(), fitting.state_dict().values()))
    assert cm.memory_stats()["evictions"] > 0, "chunks must move"
    # And it tracks fp32: closely before any update, loosely after (bf16 rounding grows with each step).
    assert abs(losses[0] - expected[0]) <= BF16_FIRST[0] * expected[0] + BF16_FIRST[1], (losses, expected)
    assert all(abs(a - b) <= BF16_LATER[0] * b + BF16_LATER[1] for a, b in zip(losses, expected)), (losses, expected)
    assert losses[2] < 0.98 * losses[0] and losses[3] < 0.98 * losses[1], "each batch seen again must fit better"
