"""`chunkmem.prepare` as a contract: a call that raises changes nothing, a model is managed by one call."""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import io
import weakref

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem import wrapper
from chunkmem.errors import CheckpointError
from tests import zoo
from tests.helpers import mlp, mlp_batches, mlp_loss, param_bytes, train

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def hook_count(model: nn.Module) -> int:
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return modules + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


FAILURES = {  # how prepare is made to fail, after it has started changing the model
    "device budget, bf16": lambda m: (ADAMW(m.parameters()), chunkmem.Config(device="cpu", dtype="bf16",
                                                                           device_memory=1000)),
    "host budget, fp16": lambda m: (ADAMW(m.parameters()), chunkmem.Config(device="cpu", dtype="fp16",
                                                                          host_memory=param_bytes(m))),
    "optimizer over another model, bf16": lambda m: (ADAMW(list(m.parameters()) + [nn.Parameter(torch.ones(3))]),
                                                      chunkmem.Config(device="cpu", dtype="bf16")),
    # torch.optim updates it once per listing, chunkmem once: training went on apart from plain PyTorch's, silently
    "a parameter listed twice": lambda m: (ADAMW([*m.parameters(), next(m.parameters())]),
                                           chunkmem.Config(device="cpu")),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_prepare_leaves_the_model_as_it_was(failure: str) -> None:
    model = zoo.by_name("resnet").build()  # parameters and BatchNorm buffers
    batch = zoo.by_name("resnet").batches(1)[0]
    original = copy.deepcopy(model)
    data = {name: p.data for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    optimizer, config = FAILURES[failure](model)
    with pytest.raises((chunkmem.MemoryBudgetError, ValueError)):
        chunkmem.prepare(model, optimizer, config)
    for name, param in model.named_parameters():
        assert param.data is not data[name] and param.data.data_ptr() == data[name].data_ptr(), name
        assert param.dtype == torch.float32 and torch.equal(param, original.get_parameter(name)), name
    assert all(model.get_buffer(name) is buffer for name, buffer in buffers.items())
    assert hook_count(model) == 0
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]  # `device` as it was
    torch.testing.assert_close(model(**batch).logits, original(**batch).logits, rtol=0, atol=0)
    # and a second try trains as PyTorch does
    batches = zoo.by_name("resnet").batches(3)
    expected = train(original, ADAMW(original.parameters()), batches, zoo.loss)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()),
                               chunkmem.Config(device="cpu", device_memory=param_bytes(model) // 2))
    assert train(cm, opt, batches, zoo.loss) == expected


def test_a_failed_prepare_of_a_meta_model_leaves_it_on_meta() -> None:
    with torch.device("meta"):
        model = mlp()
    with pytest.raises(chunkmem.MemoryBudgetError):
        chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", device_memory=1000))
    assert all(p.device.type == "meta" and isinstance(p, nn.Parameter) for p in model.parameters())
    assert hook_count(model) == 0


def test_a_meta_model_with_meta_buffers_is_refused_naming_one_and_trains_once_they_have_values() -> None:
    """A LLaMA built under torch.device("meta") has its rotary frequencies there too, which prepare cannot move (torch's
    NotImplementedError from inside it before): a ValueError names the buffer, and the model is as it was. Given
    values, it prepares, loads and trains as the plain model does."""
    pytest.importorskip("transformers")
    arch = zoo.by_name("llama")
    plain = arch.build()
    with torch.device("meta"):
        model = arch.build()
    with pytest.raises(ValueError, match="buffer model.rotary_emb.inv_freq of this model is on the meta device"):
        chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    assert hook_count(model) == 0 and all(p.is_meta for p in model.parameters())
    for name, buffer in plain.named_buffers():
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, buffer.clone())
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    cm.load_state_dict(plain.state_dict())
    batches = arch.batches(3)
    assert train(cm, opt, batches, zoo.loss) == train(plain, ADAMW(plain.parameters()), batches, zoo.loss)


def test_preparing_the_original_model_again_is_refused_and_the_first_keeps_training() -> None:
    model, batches = mlp(), mlp_batches(4)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, mlp_loss)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    for again in (model, model[2]):  # the whole model, or a part of it
        with pytest.raises(ValueError, match=r"(module|parameter) .* is already managed by an earlier chunkmem."
                                             r"prepare .*copy.deepcopy"):
            chunkmem.prepare(again, ADAMW(again.parameters()), chunkmem.Config(device="cpu"))
    shared = nn.Linear(32, 32)
    shared.weight = model[0].weight  # a parameter of the prepared model inside another one
    with pytest.raises(ValueError, match="parameter weight of this model is already managed"):
        chunkmem.prepare(shared, ADAMW(shared.parameters()), chunkmem.Config(device="cpu"))
    assert train(cm, opt, batches, mlp_loss) == expected
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_load_state_dict_checks_every_shape_before_writing_any() -> None:
    model = zoo.by_name("resnet").build()
    cm, _ = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    before = cm.state_dict()
    bad = {k: v + 1 for k, v in before.items()}
    last_param = list(dict(model.named_parameters()))[-1]
    bad[last_param] = torch.zeros(5)
    with pytest.raises(RuntimeError, match=rf"size mismatch for {last_param}: .*\[5\].*\[3\]"):
        cm.load_state_dict(bad)
    running = "resnet.embedder.embedder.normalization.running_mean"
    bad[last_param], bad[running] = before[last_param], torch.zeros(1)  # would broadcast into the buffer
    with pytest.raises(RuntimeError, match=rf"size mismatch for {running}: .*\[1\].*\[16\]"):
        cm.load_state_dict(bad)
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in before.items())


def test_load_state_dict_leaves_the_callers_dict_and_tensors_as_they_were_and_refuses_values_without_data() -> None:
    # torch's loader, run with assign=True on the caller's dict, marked its metadata so that every later plain load of it
    # assigned its tensors (two models loaded from it shared their parameters), and set the requires_grad of the
    # Parameters in it; a value a write would fail on (sparse) failed after the values before it were written, and a
    # meta one was skipped with no error.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    cm, _ = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    source[1].weight.requires_grad_(False)
    given = source.state_dict(keep_vars=True)
    metadata = copy.deepcopy(given._metadata)
    cm.load_state_dict(given)
    assert given._metadata == metadata
    assert [p.requires_grad for p in source.parameters()] == [True, True, False, True]
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in source.state_dict().items())
    twin = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    twin.load_state_dict(given)  # plain PyTorch copies: it shares nothing with the dict
    assert twin[0].weight.data_ptr() != source[0].weight.data_ptr()
    before = cm.state_dict()
    with torch.device("meta"):
        meta_values = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).state_dict()
    sparse = {**{k: v + 1 for k, v in before.items()}, "1.bias": before["1.bias"].to_sparse()}
    for bad, what in ((meta_values, "meta device"), (sparse, "sparse_coo")):
        with pytest.raises(RuntimeError, match=f"value for .* is .*{what}.*nothing was loaded"):
            cm.load_state_dict(bad)
        assert all(torch.equal(cm.state_dict()[k], v) for k, v in before.items())
    ints = {k: torch.ones_like(v, dtype=torch.int64) for k, v in before.items()}  # cast, as plain PyTorch casts them
    cm.load_state_dict(ints)
    assert all(torch.equal(v, torch.ones_like(v)) for v in cm.state_dict().values())
    rotary = nn.Linear(4, 4)  # a complex buffer (rotary frequencies as torchtitan keeps them) loads as it is
    rotary.register_buffer("freqs", torch.polar(torch.ones(3), torch.arange(3.0)))
    cm, _ = chunkmem.prepare(rotary, ADAMW(rotary.parameters()), chunkmem.Config(device="cpu"))
    cm.load_state_dict({**cm.state_dict(), "freqs": torch.polar(torch.ones(3), -torch.arange(3.0))})
    assert torch.equal(cm.state_dict()["freqs"], torch.polar(torch.ones(3), -torch.arange(3.0)))


class _Counted(nn.Linear):
    """A module with extra state (`get_extra_state`), as quantized and transformer-engine layers have."""

    def __init__(self, extra: object) -> None:
        super().__init__(4, 4)
        self.extra = extra

    def get_extra_state(self) -> object:
        return self.extra

    def set_extra_state(self, state: object) -> None:
        self.extra = state


def test_a_modules_extra_state_is_in_the_state_dict_and_in_checkpoints(tmp_path) -> None:
    # Two modules whose extra states are one object (an int, a string: Python shares them) keep both.
    model = nn.Sequential(_Counted({"calls": 3, "scales": [0.5, 2.0]}), _Counted("v1"), _Counted("v1"), nn.Linear(4, 2))
    plain = copy.deepcopy(model).state_dict()
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    assert list(cm.state_dict()) == list(plain) and cm.state_dict()["0._extra_state"] == plain["0._extra_state"]
    chunkmem.save_checkpoint(tmp_path / "c", cm, opt)
    model[0].extra, model[2].extra = {"calls": 4}, "v2"
    chunkmem.load_checkpoint(tmp_path / "c", cm, opt)
    assert (model[0].extra, model[1].extra, model[2].extra) == ({"calls": 3, "scales": [0.5, 2.0]}, "v1", "v1")
    bad = {**cm.state_dict(), "0._extra_state": {"calls": 5}, "3.bias": torch.zeros(2).to_sparse()}
    with pytest.raises(RuntimeError, match="nothing was loaded"):  # nor the extra state
        cm.load_state_dict(bad)
    del bad["0._extra_state"], bad["3.bias"]
    with pytest.raises(RuntimeError, match='Missing key.*"0._extra_state".*"3.bias"'):  # as plain PyTorch's
        cm.load_state_dict(bad)
    assert model[0].extra == {"calls": 3, "scales": [0.5, 2.0]}
    model[0].extra = object()  # not JSON: refused, the checkpoint there intact
    with pytest.raises(CheckpointError, match="model/0._extra_state is a module's extra state"):
        chunkmem.save_checkpoint(tmp_path / "c", cm, opt)
    chunkmem.load_checkpoint(tmp_path / "c", cm, opt)
    assert model[0].extra == {"calls": 3, "scales": [0.5, 2.0]}


def test_casting_or_moving_a_prepared_model_is_refused_and_asking_for_what_it_is_changes_nothing():
    # Its parameters are views into chunks: a cast or a move would be undone by the next step, silently.
    import copy as _copy

    from tests.helpers import mlp, mlp_batches, mlp_loss, param_bytes, train

    model = mlp()
    ref = _copy.deepcopy(model)
    cm, opt = chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               chunkmem.Config(device="cpu", device_memory=param_bytes(model)))
    for cast in (cm.half, cm.bfloat16, lambda: cm.to(torch.float16), lambda: cm.to("cpu", torch.float64)):
        with pytest.raises(ValueError, match=r"Config\(dtype="):
            cast()
    with pytest.raises(ValueError, match=r"Config\(device="):
        cm.to("meta")
    assert cm.to("cpu") is cm and cm.float() is cm and cm.cpu() is cm and cm.to(torch.float32) is cm
    batches = mlp_batches(2)
    assert train(cm, opt, batches, mlp_loss) == train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches, mlp_loss)


def test_a_dropped_model_is_freed_and_its_budget_goes_with_it(sim_memory) -> None:
    # A parameter's gradient hook is held by autograd's C++ side, out of the collector's sight: when it held the
    # prepared model, a dropped model kept its chunks, pinned memory and allocator cap for good (the lent H200's
    # self-test: the next model, without a budget, met the last one's cap of 0.67 MiB).
    memory = sim_memory(1)
    model = mlp(64)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", device_memory=8 << 20))
    train(cm, opt, mlp_batches(2, 64), mlp_loss)
    assert memory.allocator.allowed is not None and memory.allocator.allocated > 0
    runtime = weakref.ref(cm.runtime)
    del cm, opt, model  # the module too: its parameters are views into the chunks
    while gc.collect():  # a second pass frees what the first let go of on autograd's side
        pass
    assert runtime() is None
    assert memory.allocator.allowed is None and memory.allocator.allocated == 0


def test_a_budgeted_prepare_frees_dropped_models_first(sim_memory) -> None:
    # A dropped model without a budget set no cap, and its runtime's cycles kept its chunks on the device until the
    # collector ran: the lent H200's budget check found 258 MB of such a model's memory beside the next model, over
    # that model's budget. One pass of the collector is not enough (the finalizers it runs let go of more).
    memory = sim_memory(1)
    model = mlp(64)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    train(cm, opt, mlp_batches(2, 64), mlp_loss)
    dropped, runtime = memory.allocator.allocated, weakref.ref(cm.runtime)
    del cm, opt, model
    assert runtime() is not None and memory.allocator.allocated == dropped, "reference cycles keep it"
    model = mlp(32)
    chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", device_memory=8 << 20))
    assert runtime() is None and memory.allocator.allocated < dropped


def test_what_the_device_holds_at_prepare_leaves_less_room_for_chunks(sim_memory) -> None:
    # A plain twin already on the device (the self-test's overlap check) holds memory the budget counts: the model's
    # data fits the budget but not beside it, so prepare must not home every group (on the lent H200 it did, the
    # chunks went up before the allocator's cap, and the first step ran out of memory at 1.09 GiB against 621 MiB).
    memory = sim_memory(16)  # the allocator's segments scaled down with the model
    twin = mlp(512, 12)
    for param in twin.parameters():
        memory.charge(param.data)
    model = mlp(512, 4)
    budget = 4 * param_bytes(model) + (8 << 20)  # fp32 AdamW's model data, and room for activations
    assert memory.allocator.allocated > 8 << 20
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", device_memory=budget))
    assert not cm.runtime.placer.all_homed
    assert cm.runtime.largest_rise == 0, "what the device held at the first reading is no rise between two readings"
    train(cm, opt, mlp_batches(3, 512), mlp_loss)
    assert cm.memory_stats()["oom_fallbacks"] == 0 and memory.allocator.peak_reserved <= budget


@pytest.mark.parametrize("budget", [None, 0.3])
def test_load_state_dict_runs_each_modules_own_loading_and_the_users_hooks_as_pytorch(budget) -> None:
    """A pre-hook renaming a legacy key, BatchNorm's filling in num_batches_tracked (checkpoints written without it) and
    a post-hook: the prepared model's load did its own matching of keys and refused both checkpoints."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()) for _ in range(4)])

    def rename(module, state_dict, prefix, *args) -> None:
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")

    model = build()
    plain = copy.deepcopy(model)
    cm, _ = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", device_memory=budget and int(param_bytes(model) * budget)))
    old = {k: v * 0.5 if v.is_floating_point() else v for k, v in build().state_dict().items()
           if "num_batches_tracked" not in k}
    old["2.0.w"] = old.pop("2.0.weight")
    seen = []
    for target in (plain, cm.module):
        target[2][0].register_load_state_dict_pre_hook(rename)
        target.register_load_state_dict_post_hook(lambda module, keys: seen.append(list(keys.missing_keys)))
    assert cm.load_state_dict(old) == plain.load_state_dict(old)
    assert seen == [[], []]
    want, got = plain.state_dict(), cm.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    x = torch.randn(8, 16)
    assert torch.equal(cm(x), plain(x))
    with pytest.raises(ValueError, match=r"assign=True\) would replace .* load the values into them"):
        cm.load_state_dict(old, assign=True)


def test_a_sparse_embedding_and_state_dicts_of_the_parameters_themselves_are_refused_with_what_to_do() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="module 0 is an embedding with sparse=True.* sparse=False before prepare"):
        chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), chunkmem.Config(device="cpu"))
    assert hook_count(model) == 0
    model[0].sparse = False
    cm, _ = chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), chunkmem.Config(device="cpu"))
    with pytest.raises(ValueError, match=r"keep_vars=True.*model.named_parameters\(\)"):
        cm.state_dict(keep_vars=True)  # they were copies, not the parameters


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_a_parameter_chunks_would_round_or_cast_is_refused_at_prepare_naming_it(dtype) -> None:
    # A float64 temperature went into fp32 chunks, rounded (1 + 1e-12 read 1.0), with no word; a .double() Linear
    # failed in its first forward with torch's dtype error; an integer one would have computed as a float.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].weight = nn.Parameter(model[1].weight.detach().to(dtype), requires_grad=dtype.is_floating_point)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"parameter 1.weight is {dtype}.*model.float\(\).*register_buffer"):
        chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), chunkmem.Config(device="cpu"))
    assert hook_count(model) == 0 and model[1].weight.dtype == dtype
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("budget", [None, 0.3])
def test_deep_copying_or_pickling_a_module_inside_a_prepared_model_says_to_copy_the_model(budget) -> None:
    # It raised "cannot pickle '_thread.lock' object", from the runtime its hooks hold.
    model = mlp()
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", device_memory=budget and int(param_bytes(model) * budget)))
    train(cm, opt, mlp_batches(1), mlp_loss)
    for inner in (cm.module, next(iter(cm.module.children()))):
        with pytest.raises(TypeError, match=r"module inside a model chunkmem prepared.*copy.deepcopy\(model\)"):
            copy.deepcopy(inner)
    with pytest.raises(TypeError, match="module inside a model chunkmem prepared"):
        torch.save(cm.module, io.BytesIO())
    with pytest.raises(TypeError, match=r"pickling a model chunkmem prepared.*model.state_dict\(\)"):
        torch.save(cm, io.BytesIO())  # "cannot pickle '_thread.lock'" once its steps ran resident
    plain = copy.deepcopy(cm)
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), cm.state_dict().values()))
    for save in (copy.deepcopy, lambda o: torch.save(o, io.BytesIO())):  # a copy that could not step
        with pytest.raises(TypeError, match=r"optimizer chunkmem prepared.*optimizer.state_dict\(\)"):
            save(opt)


class FusedQKV(nn.Module):
    """One parameter saved as three keys, and loaded by a loading of its own (in place, not through torch's)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.qkv.t()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for name, part in zip("qkv", (self.qkv if keep_vars else self.qkv.detach()).chunk(3)):
            destination[prefix + name] = part

    def _load_from_state_dict(self, state_dict, prefix, metadata, strict, missing, unexpected, errors) -> None:
        keys = [prefix + name for name in "qkv"]
        missing.extend(k for k in keys if k not in state_dict)
        if all(k in state_dict for k in keys):
            with torch.no_grad():
                self.qkv.copy_(torch.cat([state_dict.pop(k) for k in keys]))


@pytest.mark.parametrize("budget", [None, 1.0])  # of the parameters' bytes: a quarter of the model data
def test_load_state_dict_takes_what_a_modules_own_loading_writes_in_place(budget) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 4), FusedQKV(), nn.Linear(6, 2))
    plain = copy.deepcopy(model)
    cm, _ = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", device_memory=budget and int(param_bytes(model) * budget), chunk_size=256))
    state = {k: v + 1 for k, v in plain.state_dict().items()}
    assert cm.load_state_dict(state) == plain.load_state_dict(state)  # keys as the module saves them
    x = torch.randn(3, 4)
    assert torch.equal(cm(x), plain(x))


def test_a_prepared_model_shows_the_wrapped_forwards_signature_and_name() -> None:
    # A Hugging Face Trainer keeps the dataset columns the model's forward names and finds its labels there, and shifts
    # a causal LM's labels for label smoothing by the model's name: a prepared model's forward took anything, as
    # "ChunkedModel", and the Trainer dropped every column, evaluated without a loss, smoothed unshifted labels.
    class Labelled(nn.Linear):
        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            return super().forward(x)

    class Static(nn.Linear):
        forward = staticmethod(lambda x, labels=None: x)  # not a method: its signature would lose a parameter

    model = Labelled(4, 4)
    cm, _ = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    assert inspect.signature(cm.forward) == inspect.signature(model.forward)
    assert type(cm).__name__ == "ChunkedModel[Labelled]" and isinstance(cm, chunkmem.ChunkedModel)
    assert cm._get_name() == "Labelled" and repr(cm).startswith("ChunkedModel(\n  (module): Labelled(")
    static = Static(4, 4)
    cs, _ = chunkmem.prepare(static, ADAMW(static.parameters()), chunkmem.Config(device="cpu"))
    assert type(cs) is chunkmem.ChunkedModel and "labels" not in inspect.signature(cs.forward).parameters


def test_a_config_that_is_not_a_config_is_refused_by_name() -> None:
    model = mlp()
    with pytest.raises(TypeError, match=r"config is dict \{'device': 'cpu'\}: expected a chunkmem.Config"):
        chunkmem.prepare(model, torch.optim.AdamW(model.parameters()), {"device": "cpu"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"config is dict \{\}: expected"):  # not taken for no config
        chunkmem.prepare(model, torch.optim.AdamW(model.parameters()), {})  # type: ignore[arg-type]
    cm, _ = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()), chunkmem.Config(device="cpu"))
    assert cm.module is model, "the refused call left the model as it was"


def test_a_model_cast_to_low_precision_and_prepared_in_fp32_is_told_so(caplog) -> None:
    # Its parameters silently became fp32 (twice the memory, other losses than the bf16 model's): helper-80.
    for dtype, said in (("fp32", True), ("bf16", False)):
        model = torch.nn.Linear(4, 4).to(torch.bfloat16)
        caplog.clear()
        with caplog.at_level("WARNING", logger="chunkmem"):
            chunkmem.prepare(model, torch.optim.AdamW(model.parameters()), chunkmem.Config(device="cpu", dtype=dtype))
        assert ("parameters are bfloat16, and Config.dtype='fp32'" in caplog.text) == said


def test_a_prepare_whose_watcher_fails_leaves_the_model_and_its_optimizer_as_they_were(monkeypatch) -> None:
    # `chunkmem trace`'s recorder, unable to write its directory, failed after the optimizer was retired and the model
    # hooked: prepare raised, and the model and optimizer it left could not train.
    def fails(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise OSError("cannot write the trace")
    monkeypatch.setattr(wrapper, "_WATCHERS", [fails])
    model, batches = mlp(), mlp_batches(2)
    original = copy.deepcopy(model)
    optimizer = ADAMW(model.parameters())
    with pytest.raises(OSError, match="cannot write the trace"):
        chunkmem.prepare(model, optimizer, chunkmem.Config(device="cpu"))
    assert hook_count(model) == 0
    expected = train(original, ADAMW(original.parameters()), batches, mlp_loss)
    assert train(model, optimizer, batches, mlp_loss) == expected
