"""Config and prepare reject bad input with errors that name the value and what is allowed."""

from __future__ import annotations

import copy

import pytest
import torch

import chunkmem
from chunkmem.config import parse_size
from tests.helpers import mlp, mlp_batches, mlp_loss, param_bytes, train


@pytest.mark.parametrize("text,expected", [(1024, 1024), ("512MiB", 512 * 2**20), ("20GiB", 20 * 2**30),
                                           ("20GB", 20 * 10**9), ("1.5 GiB", int(1.5 * 2**30))])
def test_sizes_accept_ints_and_units(text, expected):
    assert parse_size("device_memory", text) == expected


@pytest.mark.parametrize("kwargs,match", [
    (dict(device_memory="lots"), r"Config.device_memory='lots': expected a size"),
    (dict(device_memory=-5), r"Config.device_memory=-5: a size must be positive"),
    (dict(host_memory="3XB"), r"Config.host_memory='3XB'"),
    (dict(dtype="int8"), r"Config.dtype='int8': expected one of \['bf16', 'fp16', 'fp32'\]"),
    (dict(dtype=["fp32"]), r"Config.dtype=\['fp32'\]: expected one of"),  # unhashable: a bare TypeError before
    (dict(device_memory="0.5"), r"Config.device_memory='0.5': a size must be at least one byte"),  # said =0
    (dict(chunk_size=0), r"Config.chunk_size=0"),
    (dict(chunk_size=2.5), r"Config.chunk_size=2.5"),
    (dict(device="tpu"), r"Config.device='tpu': expected 'cuda', 'cuda:N' or 'cpu'"),
    (dict(offload_activations="yes"), r"Config.offload_activations='yes': expected True or False"),
    (dict(native_optimizer=1), r"Config.native_optimizer=1: expected True, False or None \(auto\)"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chunkmem.Config(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_cuda_without_cuda_says_to_use_the_simulation():
    with pytest.raises(ValueError, match="use device='cpu'"):
        chunkmem.Config(device="cuda")


def test_the_native_optimizer_is_on_by_default_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulation keeps torch.optim's bits whatever the budget; on CUDA host and device updates differ anyway.
    assert not chunkmem.Config(device="cpu").uses_native_optimizer
    assert chunkmem.Config(device="cpu", native_optimizer=True).uses_native_optimizer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert chunkmem.Config(device="cuda:0").uses_native_optimizer
    assert not chunkmem.Config(device="cuda:0", native_optimizer=False).uses_native_optimizer


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="device_mem"):
        chunkmem.Config(device_mem="1GiB")


def test_unsupported_optimizer_names_its_class_and_the_supported_ones():
    model = mlp()
    with pytest.raises(TypeError, match=r"torch.optim.rmsprop.RMSprop: supported optimizers are "
                                        r"torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD"):
        chunkmem.prepare(model, torch.optim.RMSprop(model.parameters()), chunkmem.Config(device="cpu"))


def test_amsgrad_is_refused_with_the_fix():
    model = mlp()
    with pytest.raises(ValueError, match="amsgrad=False"):
        chunkmem.prepare(model, torch.optim.Adam(model.parameters(), amsgrad=True), chunkmem.Config(device="cpu"))


def test_chunk_size_below_a_parameter_names_the_parameter():
    model = mlp()
    with pytest.raises(ValueError, match=r"parameter '0.weight' has 1024 elements, more than chunk_size=100"):
        chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         chunkmem.Config(device="cpu", chunk_size=100))


def test_budget_too_small_for_one_module_fails_before_training():
    model = mlp()
    with pytest.raises(chunkmem.MemoryBudgetError,
                       match=r"module Linear .* \d+ bytes, but Config.device_memory allows 1000: raise device_memory"):
        chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         chunkmem.Config(device="cpu", device_memory=1000))


def test_host_budget_too_small_is_a_memory_budget_error():
    model = mlp()
    with pytest.raises(chunkmem.MemoryBudgetError, match="host memory"):
        chunkmem.prepare(model, torch.optim.AdamW(model.parameters()),
                         chunkmem.Config(device="cpu", host_memory=param_bytes(model)))


def test_optimizer_over_another_model_is_refused():
    model, other = mlp(), mlp()
    with pytest.raises(ValueError, match="not in the model"):
        chunkmem.prepare(model, torch.optim.SGD(other.parameters(), lr=0.1), chunkmem.Config(device="cpu"))


def test_preparing_twice_is_refused():
    model = mlp()
    cm, opt = chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), chunkmem.Config(device="cpu"))
    with pytest.raises(ValueError, match="already prepared"):
        chunkmem.prepare(cm, opt, chunkmem.Config(device="cpu"))


def test_load_state_dict_reports_missing_keys_like_pytorch():
    model = mlp()
    cm, _ = chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), chunkmem.Config(device="cpu"))
    state = cm.state_dict()
    del state["0.bias"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.bias"'):  # torch's own words
        cm.load_state_dict(state)
    result = cm.load_state_dict(state, strict=False)
    assert result.missing_keys == ["0.bias"]
    state["0.weight"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight: .* shape torch.Size\(\[3\]\) .* "
                                           r"torch.Size\(\[32, 32\]\)"):
        cm.load_state_dict(state, strict=False)


def test_optimizer_state_dict_of_sgd_without_momentum_is_torchs():
    # It raised NotImplementedError (tests/runtime/test_optim.py has AdamW's and SGD's with momentum).
    model = mlp()
    plain = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(plain.parameters(), lr=0.1)]
    cm, opt = chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), chunkmem.Config(device="cpu"))
    for net, optimizer in ((plain, optimizers[0]), (cm, opt)):
        train(net, optimizer, mlp_batches(1), mlp_loss)
    assert opt.state_dict() == optimizers[0].state_dict() and opt.state_dict()["param_groups"]


def test_gather_units_are_class_names():
    assert chunkmem.Config(device="cpu", gather_units=["A", "B"]).gather_units == ("A", "B")
    for bad in ("SwitchTransformersSparseMLP", ("",), (3,)):
        with pytest.raises(ValueError, match=r"Config.gather_units=.*expected a tuple of module class names"):
            chunkmem.Config(device="cpu", gather_units=bad)


def test_chunkmem_device_chooses_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the lent H100 a config that named no device went to CUDA with the simulation's tiny budgets; the
    # suite sets CHUNKMEM_DEVICE=cpu (conftest) so that its tests judge the simulation on any machine.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CHUNKMEM_DEVICE")
    assert chunkmem.config.default_device() == "cuda"
    monkeypatch.setenv("CHUNKMEM_DEVICE", "cpu")
    assert chunkmem.Config().device == "cpu"
    monkeypatch.setenv("CHUNKMEM_DEVICE", "gpu0")
    with pytest.raises(ValueError, match=r"CHUNKMEM_DEVICE='gpu0': expected 'cuda', 'cuda:N' or 'cpu', or unset it"):
        chunkmem.Config()


def test_a_manager_given_a_dict_for_its_config_says_what_it_expects():
    # An AttributeError ('dict' object has no attribute 'device') where prepare says what to do.
    with pytest.raises(TypeError, match=r"Manager's config is dict .*chunkmem.Config\(\*\*options\)"):
        chunkmem.Manager({"device": "cpu"})  # type: ignore[arg-type]
