"""Hugging Face architectures nobody here wrote, each under a device budget below its model data:
fp32 bit-identical to plain PyTorch, bf16 tracking fp32 (tests/zoo.py builds them)."""

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
BF16_TOLERANCE = 0.03, 0.02  # each step's loss within 3% of fp32's, plus 0.02 (small losses of vision models)


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

    cm, opt = prepared(model, ADAMW, device_memory=least_accepted(model, ADAMW, low=budget // 2, dtype="bf16"),
                       dtype="bf16")
    losses = train(cm, opt, batches, zoo.loss)
    relative, absolute = BF16_TOLERANCE
    assert all(abs(a - b) <= relative * b + absolute for a, b in zip(losses, expected)), (losses, expected)
    assert losses[2] < 0.98 * losses[0] and losses[3] < 0.98 * losses[1], "each batch seen again must fit better"
