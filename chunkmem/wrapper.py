"""`chunkmem.prepare`: the two lines a training loop adds, and the module it gets back."""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import re
import typing
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from chunkmem.chunks.family import Families
from chunkmem.chunks.store import MANAGED, ParamRecord, outside_inference_mode, put_data
from chunkmem.config import Config
from chunkmem.errors import DiskTierError
from chunkmem.runtime.hooks import Hooks, already_hooked
from chunkmem.runtime.loading import load_values
from chunkmem.runtime.optim import ChunkOptimizer, retire
from chunkmem.runtime.reporting import Report, plain_class, put_back, report_device, report_of
from chunkmem.runtime.rules import SUPPORTED, rule_for
from chunkmem.runtime.runtime import Runtime
from chunkmem.zero.agreement import fingerprints
from chunkmem.zero.collectives import default_group

LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # floating inputs a forward takes in the compute dtype


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` in backward (the fp16 loss scale on the model's outputs,
    its inverse on its inputs)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float, copy: bool = False) -> torch.Tensor:
        ctx.scale = scale
        # A view made inside a Function may not be changed in place: a model may change its input so (`x += pos`).
        return tensor.clone() if copy else tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.scale, None, None


_LOOKING_AS: dict[tuple[type, type], type] = {}  # (ChunkedModel class, wrapped class) -> `_looking_as`'s


def _looking_as(own: type[ChunkedModel], wrapped: type[nn.Module]) -> type:
    """`own` (ChunkedModel or a subclass) whose forward has the signature of `wrapped`'s and whose name names it, for
    code that reads them: a Hugging Face Trainer keeps the dataset columns a model's forward names, and finds its labels
    and whether it returns a loss there (a question-answering model's labels by its class name)."""
    if (own, wrapped) in _LOOKING_AS:
        return _LOOKING_AS[own, wrapped]
    method = inspect.getattr_static(wrapped, "forward", None)
    try:
        signature = inspect.signature(method) if inspect.isfunction(method) else None
    except (TypeError, ValueError):  # one Python cannot read
        signature = None
    if signature is None:  # not a plain method (a staticmethod, a partial): its signature would lose a parameter
        return own
    base = own.forward

    def forward(self: ChunkedModel, *args: Any, **kwargs: Any) -> Any:
        return base(self, *args, **kwargs)
    forward.__signature__ = signature  # type: ignore[attr-defined]
    name = f"{own.__name__}[{wrapped.__name__}]"
    _LOOKING_AS[own, wrapped] = type(name, (own,), {"forward": forward, "__module__": own.__module__,
                                                     "__qualname__": name, "__doc__": own.__doc__})
    return _LOOKING_AS[own, wrapped]


# CUDA's errors for an op given tensors on two devices: most ops' (the simulation's for all: simmemory._refuse_mixed),
# and a convolution's.
TWO_DEVICES = re.compile(r"Expected all tensors to be on the same device|Input type \(.*\) and weight type \(.*\) "
                         r"should be the same")


class ChunkedModel(nn.Module):
    """The user's module (at `.module`) with its model data in chunks.

    Inputs are moved to the compute device and floating-point inputs cast to the compute dtype.
    Attributes the wrapper lacks are looked up on the wrapped module (`model.config`, ...).
    """

    def __init__(self, module: nn.Module, runtime: Runtime) -> None:
        super().__init__()
        self.module = module
        self.runtime = runtime
        compute = runtime.config.torch_dtype
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None:
                    # Buffers keep their precision (fp32 rotary frequencies and BatchNorm statistics stay fp32
                    # under bf16; hooks._affine_like_statistics), and are raised to the compute dtype if below it.
                    dtype = torch.promote_types(buffer.dtype, compute) if buffer.is_floating_point() else None
                    sub._buffers[name] = buffer.to(runtime.device.torch_device, dtype)
        report_device(module, runtime.device)
        self.__class__ = _looking_as(type(self), plain_class(module))
        self.hooks = Hooks(module, runtime)  # last: a constructor that raises leaves no hook behind

    @property
    def own_records(self) -> frozenset[ParamRecord] | None:
        """Its parameters' records where the runtime holds other models' too (a manager's), else None: all of them."""
        return self.hooks.own

    def _get_name(self) -> str:
        """The wrapped model's class name (a PEFT model's base model's), as code that asks a model what it is reads it:
        a Hugging Face Trainer shifts a causal LM's labels when it smooths them, by this name (`repr` still says
        ChunkedModel)."""
        base = getattr(self.module, "get_base_model", None)
        return typing.cast(nn.Module, base() if callable(base) else self.module)._get_name()

    def __repr__(self) -> str:
        inner = repr(self.module).replace("\n", "\n  ")
        return f"ChunkedModel(\n  (module): {inner}\n)"

    @property
    def device(self) -> torch.device:
        """Where the model computes (`inputs.to(model.device)`), whichever tier its parameters are in now."""
        return self.runtime.device.torch_device

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        scaler = self.runtime.scaler if torch.is_grad_enabled() else None
        if scaler is not None:
            # The gradient the model hands back to an input (an encoder's `inputs_embeds` outside it) carries the loss
            # scale: it comes off at the boundary, in the input's own dtype, before the cast to the compute dtype.
            leaves = [_ScaleGrad.apply(leaf, 1.0 / scaler.scale, True) if isinstance(leaf, torch.Tensor) and
                      leaf.requires_grad else leaf for leaf in leaves]
        leaves = [self._to_compute(leaf) for leaf in leaves]
        args, kwargs = tree_unflatten(leaves, spec)
        inputs = (spec, *[_signature(leaf) for leaf in leaves])
        restore: Callable[[], None] | None = None
        lean = rerun = False
        out_of_memory: torch.OutOfMemoryError | None = None

        def again() -> Any:  # under the torch-function mode, from the random state it started from
            restore()  # type: ignore[misc]
            with self.hooks.forward(inputs):
                return self.module(*args, **kwargs)
        try:
            with self.hooks.forward(inputs) as modeless:
                restore = _random_state(self.runtime.device.torch_device) if modeless else None
                lean = modeless and not self.runtime.placer.resident
                output = self.module(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            if restore is None:
                raise
            # Resident or lean, no torch-function mode was there to retry the op that failed (runtime's Notes on
            # them): the forward runs again under it, once out of this block. The error's traceback holds the failed
            # forward's frames and activations: only its message goes on.
            out_of_memory = torch.OutOfMemoryError(str(error))
        except RuntimeError as error:
            if not lean or not TWO_DEVICES.search(str(error)):
                raise
            rerun = True  # once out of this block, as above
        if lean and (out_of_memory is not None or rerun):  # it did not run lean
            self.runtime.lean_forwards -= 1
        if out_of_memory is not None:
            output = self.runtime.placer.out_of_memory(out_of_memory, again)
        elif rerun:
            # A lean forward used a parameter outside its module for the first time, its chunk on the host (runtime's
            # Note on lean forwards): it runs again under the mode, which fetches it, as the model's forwards will.
            # What the failed part did runs twice (a BatchNorm's running statistics: as after an out-of-memory retry).
            self.runtime.lean_allowed = False
            self.runtime.placer.diverge("a forward without the torch-function mode gave an op a parameter whose chunk "
                                        "was on the host: it runs again under the mode")
            output = again()
        if not torch.is_grad_enabled():
            return output
        if scaler is not None:
            # One scaling node after the module on each output: every backward path crosses exactly one,
            # even when one output is computed from another inside the module (loss from logits).
            output = tree_map(lambda t: _ScaleGrad.apply(t, scaler.scale)
                              if isinstance(t, torch.Tensor) and t.requires_grad else t, output)
        self.runtime.mark_outputs(output)
        return output

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's `generate` (transformers), between training steps: its forwards (one per token, of
        growing shapes) are served off the plan, within the budget, as evaluation is (placement's Placer)."""
        leaves, spec = tree_flatten((args, kwargs))
        args, kwargs = tree_unflatten([self._to_compute(leaf) for leaf in leaves], spec)
        with self.hooks.forward(None, in_step=False):
            return typing.cast(Any, self.module).generate(*args, **kwargs)

    def _to_compute(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        # Floating inputs in the compute dtype, but for float64 (features a model wants in double precision).
        dtype = self.runtime.config.torch_dtype if value.dtype in LOW_FLOATS else value.dtype
        return value.to(self.runtime.device.torch_device, dtype)

    # A prepared model's parameters are views into chunks in the compute dtype, moved by the runtime: casting or moving
    # them (nn.Module._apply) would be undone by the next step. Asking for what they are already is a no-op (training
    # loops call model.to(device) out of habit); asking for anything else is refused, with what to do instead.
    def to(self, *args: Any, **kwargs: Any) -> ChunkedModel:  # type: ignore[override]
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return self._keep(device, dtype)

    def cuda(self, device: int | torch.device | None = None) -> ChunkedModel:
        where = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        return self._keep(where, None)

    def cpu(self) -> ChunkedModel:
        return self._keep(torch.device("cpu"), None)

    def half(self) -> ChunkedModel:
        return self._keep(None, torch.float16)

    def bfloat16(self) -> ChunkedModel:
        return self._keep(None, torch.bfloat16)

    def float(self) -> ChunkedModel:
        return self._keep(None, torch.float32)

    def double(self) -> ChunkedModel:
        return self._keep(None, torch.float64)

    def _keep(self, device: torch.device | None, dtype: torch.dtype | None) -> ChunkedModel:
        """`self`, if a cast to `device` and `dtype` leaves the model as it is; else a ValueError saying how."""
        compute, where = self.runtime.config.torch_dtype, self.runtime.device.torch_device
        if dtype is not None and dtype != compute:
            raise ValueError(f"this model was prepared by chunkmem to compute in {compute}; casting it to {dtype} "
                             "would be undone by the next step (its parameters are views into chunks). Choose the precision "
                             "with chunkmem.Config(dtype='fp32'|'bf16'|'fp16') when you prepare the model")
        if device is not None and (device.type != where.type or device.index not in (None, where.index)):
            raise ValueError(f"this model was prepared by chunkmem on {where}; moving it to {device} would be undone "
                             "by the next step (chunkmem moves its chunks itself). Choose the device with "
                             "chunkmem.Config(device=...) when you prepare the model")
        return self

    def memory_stats(self) -> dict[str, int]:
        return self.runtime.memory_stats()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.zero_grad(set_to_none, only=self.own_records)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: builtins.float, norm_type: builtins.float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """Clip all gradients by their global norm and return that norm, as torch.nn.utils does."""
        runtime = self.runtime
        runtime.adopt_grads(assigned=True)
        runtime.grads.take(self.own_records)  # `p.grad` as the user left it: replaced, or changed in place
        grads = runtime.data.grad_views(self.own_records)
        if runtime.scaler is not None and runtime.grads_scaled:
            # (an fp32 tensor: CPU's foreach ops cast a number to fp16, where 1 / 2**25 is 0: Runtime.zero_grad)
            torch._foreach_mul_(grads, torch.tensor(1.0 / runtime.scaler.scale, dtype=torch.float32, device="cpu"))
            runtime.grads_scaled = False
        total = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach) if grads \
            else torch.zeros((), device=runtime.device.torch_device)
        if runtime.shards is not None:  # each rank holds a share of the gradients: combine the norms
            total = _global_norm(runtime, total, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):  # on every rank alike, as the norm is global
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        # torch.nn.utils.clip_grads_with_norm_ reads `p.grad`; these are views, so apply its rule here.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Host gradients need the coefficient on the host anyway. Multiplied by 1 they keep every bit, so they are
        # left unwritten: an update made ahead from them stays adoptable (runtime/ahead.py's Note).
        scales_host = any(g.device.type == "cpu" for g in grads) and coef.item() != 1.0
        for grad in grads:
            if grad.device.type != "cpu" or scales_host:
                grad.mul_(coef.to(grad.device))
        runtime.grads.refresh_users(self.own_records)  # tensors of the user's shown as `p.grad` show the clipped ones
        return total

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's context for gradient accumulation, so that a DDP loop runs unchanged: it does nothing. Under ZeRO
        every backward reduce-scatters its gradients to their owners, which add them up across micro-batches (the
        same sum, in another order: equal to DDP's within rounding); a rank cannot hold every whole gradient until
        the last micro-batch, which is what sharding them saves."""
        yield

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Every parameter holds its whole value while the context lasts, under ZeRO too, where outside `forward` a
        rank holds a share of each parameter group and the others read NaN: an EMA, a weight average, a log line
        of all weights (FSDP's summon_full_params, DeepSpeed's GatheredParameters). Under ZeRO a collective that
        every rank enters: each holds the whole model on the host in the compute dtype until the block ends, and
        no forward runs inside it. A change made in place or by `p.data =` is kept, each rank writing the part it
        owns (so make the same change on every rank). Without ZeRO it does nothing: parameters hold their values
        outside `forward` already."""
        runtime = self.runtime
        shards = runtime.shards
        if shards is None:
            yield
            return
        if self.hooks.forwarding or shards.summoned:
            raise RuntimeError("model.gathered_parameters() inside a forward or inside another "
                               "gathered_parameters(): enter it between steps")
        shards.drop_all()
        values = runtime.data.gathered(self.own_records)
        for record, value in values.items():
            record.param.data = value
        marks = {record: (record.param._version, record.param.data_ptr()) for record in values}
        shards.summoned = True
        try:
            yield
        finally:
            shards.summoned = False
            changed = [r for r, mark in marks.items() if (r.param._version, r.param.data_ptr()) != mark]
            try:
                for record in changed:  # every shape checked before any value is written
                    if record.param.shape != record.shape:
                        raise ValueError(f"{record.name} was given shape {tuple(record.param.shape)} inside "
                                         f"gathered_parameters(), expected {tuple(record.shape)}: nothing was kept")
                with torch.no_grad():
                    for record in changed:  # the owner keeps the change
                        runtime.data.set_value(record, record.param.detach())
            finally:
                shards.point_all_home()

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped Hugging Face model's (or PEFT model's) save_pretrained, of `state_dict`'s values: fp32 from the
        master weights, under ZeRO gathered from every rank (so every rank calls it; `is_main_process` says which
        writes). The model's own would write its parameters as chunks hold them: in the compute dtype, and under ZeRO
        NaN for the groups other ranks own."""
        save = getattr(self.module, "save_pretrained", None)
        if save is None:
            raise AttributeError(f"{type(self.module).__name__} has no save_pretrained: save model.state_dict() "
                                 "or use chunkmem.save_checkpoint")
        if "state_dict" in kwargs or len(args) >= 2:  # (is_main_process, state_dict, ...) by position
            return save(save_directory, *args, **kwargs)
        config = getattr(self.module, "config", None)
        kept = getattr(config, "dtype", None)
        file = Path(save_directory) / "config.json"
        before = file.stat().st_mtime_ns if file.is_file() else None
        written = save(save_directory, *args, state_dict=self.state_dict(), **kwargs)
        if config is None:
            return written
        config.dtype = kept
        # transformers records the model's dtype, its chunks' compute dtype, as the one to load the values in: fp32
        # (in the config.json this save wrote: a PEFT model's writes only its adapter's).
        if file.is_file() and file.stat().st_mtime_ns != before:
            saved = json.loads(file.read_text())
            if saved.get("dtype") not in (None, "float32"):
                saved["dtype"] = "float32"
                part = file.with_name(file.name + ".tmp")
                part.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
                part.replace(file)
        return written

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling (torch.save(model)) would take the runtime along: its chunks, threads and device streams."""
        raise TypeError("pickling a model chunkmem prepared (torch.save(model), pickle.dumps, copy.copy): save "
                        "model.state_dict() or chunkmem.save_checkpoint(...), or pickle copy.deepcopy(model), the "
                        "wrapped module as plain PyTorch holds it")

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """A copy of the wrapped module as plain PyTorch would hold it (an EMA model: timm's ModelEmaV2 deep-copies the
        model it is given): on the host, parameters in fp32 from the master weights (tied stay tied), with none of
        chunkmem's hooks. Prepare it to train it under a budget. Under ZeRO a collective (state_dict's)."""
        values = self.state_dict()
        for name, param in self.module.named_parameters():
            memo[id(param)] = nn.Parameter(values[name], param.requires_grad)
        for buffer in self.module.buffers():
            memo[id(buffer)] = buffer.detach().to("cpu", copy=True)
        memo[id(self.hooks)] = hooks = object()  # the copies of our hooks are bound to it, and taken off below
        module = copy.deepcopy(self.module, memo)
        for sub in module.modules():
            sub.__class__ = plain_class(sub)
            for table in (sub._forward_pre_hooks, sub._forward_hooks):
                for key in [k for k, hook in table.items() if getattr(hook, "__self__", None) is hooks]:
                    del table[key]
                    sub._forward_hooks_always_called.pop(key, None)
        return module.to("cpu")

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The consolidated fp32 state dict on CPU, with the original module's keys (tied stay tied): copies, so a
        change made to a value is not the model's (load_state_dict it)."""
        if keep_vars:
            raise ValueError("state_dict(keep_vars=True) of a prepared model: its values are fp32 copies read from the "
                             "chunks, not its parameters (views into chunks, in the compute dtype): use "
                             "model.named_parameters() for the parameters themselves")
        out = OrderedDict() if destination is None else destination
        out.update((prefix + name, value) for name, value in self.consolidated().items())
        return out

    def consolidated(self, root: int | None = None) -> dict[str, Any]:
        """state_dict's values, on every rank, or under ZeRO on rank `root` alone (empty elsewhere). Under ZeRO a
        collective: every rank calls it."""
        records = self.runtime.store.records
        if self.runtime.step_failed is not None:
            raise DiskTierError(f"a step failed ({self.runtime.step_failed}): it may have updated some parameters and "
                                "not others, whose values then mix two steps, and the disk tier holds no more; load "
                                "the last checkpoint in a new process")
        self.runtime.adopt_data()
        by_record = self.runtime.data.values(root=root)
        if not self.runtime.data.receives(root):
            return {}
        values: dict[torch.Tensor, torch.Tensor] = {p: by_record[r] for p, r in records.items()}
        return {name: _consolidated(value, values) for name, value in self.module.state_dict(keep_vars=True).items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """torch's load_state_dict, each module's own loading and the user's load hooks included, into the chunks (fp32
        into the master weights): a failed load changes nothing (chunkmem/runtime/loading.py)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the parameters chunkmem laid out in chunks: "
                             "load the values into them (assign=False)")
        return load_values(self.module, self.runtime, state_dict, strict)


def _consolidated(value: Any, values: dict[torch.Tensor, torch.Tensor]) -> Any:
    """A state dict entry: a parameter's value from its chunks, a buffer's copy on the host, and a module's extra state
    (`get_extra_state`) as it gave it."""
    if not isinstance(value, torch.Tensor):
        return value
    return values[value] if value in values else value.detach().to("cpu", copy=True)


def _signature(value: Any) -> Any:
    """What of a forward's input decides its activations: a tensor's shape and dtype, a plain value itself."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype
    return value if value is None or isinstance(value, (bool, int, float, str)) else type(value)


def _random_state(device: torch.device) -> Callable[[], None]:
    """What puts the random state of the host and of `device` back as it is now."""
    host = torch.get_rng_state()
    if device.type != "cuda":
        return lambda: torch.set_rng_state(host)
    on_device = torch.cuda.get_rng_state(device)

    def restore() -> None:
        torch.set_rng_state(host)
        torch.cuda.set_rng_state(on_device, device)
    return restore


LOCAL = "local"  # `prepare(..., group=LOCAL)`: no sharding, even under an initialised process group


def _global_norm(runtime: Runtime, local: torch.Tensor, norm_type: float) -> torch.Tensor:
    if norm_type == float("inf"):
        return runtime.shards.all_reduce(local.clone(), dist.ReduceOp.MAX)  # type: ignore[union-attr]
    summed = runtime.shards.all_reduce(local.double() ** norm_type)  # type: ignore[union-attr]
    return (summed ** (1.0 / norm_type)).to(local.dtype)


CHUNK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # parameter dtypes chunks hold without loss


def check_fresh(model: nn.Module, optimizer: Optimizer | None) -> None:
    """Check that `model` and `optimizer` (if any) are ones prepare can take: neither prepared nor used before."""
    if isinstance(model, ChunkedModel):
        raise ValueError("this model was already prepared by chunkmem: pass the original module once")
    if not isinstance(model, nn.Module):
        raise TypeError(f"chunkmem.prepare expects an nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
        raise TypeError(f"chunkmem.prepare got a module compiled by torch.compile ({type(model).__name__} of "
                        f"{type(model._orig_mod).__name__}): prepare the module itself, then torch.compile(model) "
                        "what prepare returns (or compile its blocks in place, block.compile(), before prepare)")
    if isinstance(optimizer, ChunkOptimizer):
        raise ValueError("this optimizer was already prepared by chunkmem: pass the original torch.optim one")
    # Not an optimizer chunkmem refuses anyway (Adagrad fills its state as it is made: rule_for says why), nor the
    # empty entries a read of torch.optim's defaultdict leaves (`optimizer.state[p].get("step")`).
    if type(optimizer) in SUPPORTED and any(typing.cast(Optimizer, optimizer).state.values()):
        raise ValueError("the optimizer already holds state (it has stepped or loaded a state dict): "
                         "prepare before training, and restore with chunkmem.load_checkpoint")
    trained = model.named_modules() if optimizer is not None else ()  # a frozen model's embedding makes no gradient
    embeddings = (nn.Embedding, nn.EmbeddingBag)
    sparse = next((name or type(sub).__name__ for name, sub in trained
                   if isinstance(sub, embeddings) and sub.sparse and sub.weight.requires_grad), None)
    if sparse is not None:
        raise ValueError(f"module {sparse} is an embedding with sparse=True, whose gradients are sparse tensors, and "
                         "chunks hold dense ones: make it with sparse=False before prepare")
    odd = next(((n, p.dtype) for n, p in model.named_parameters() if p.dtype not in CHUNK_DTYPES), None)
    if odd is not None:
        name, dtype = odd
        lost = "rounded" if dtype.is_floating_point else "cast"
        raise ValueError(f"parameter {name} is {dtype}, and chunks hold parameters as float32 master weights and "
                         f"copies in Config.dtype: its values would be {lost}. Cast it to float32 before prepare "
                         "(model.float()), or, if it is not trained, make it a buffer (register_buffer), which keeps "
                         "its dtype")
    empty = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if empty:
        more = f", nor have {len(empty) - 1} more" if len(empty) > 1 else ""
        raise ValueError(f"buffer {empty[0]} of this model is on the meta device (it has no values{more}), and "
                         "prepare moves buffers to the compute device as they are: give them values first (build the "
                         "model under accelerate's init_empty_weights(include_buffers=False), which leaves them real, "
                         "or make them again, as a rotary embedding's inv_freq from its config); meta parameters are "
                         "fine, loaded after prepare")
    hooked = already_hooked(model)
    if hooked is not None:
        raise ValueError(f"{hooked} of this model is already managed by an earlier chunkmem.prepare (its parameters "
                         "are views into that call's chunks): train through the model that call returned, or "
                         "prepare a copy made before the first call (copy.deepcopy)")


def shard_group(group: Any, config: Config) -> Any:
    """The process group `prepare(..., group=group)` shards over (its docstring), None for no sharding."""
    group = None if group == LOCAL else default_group(group, config.device)
    return None if group is None or dist.get_world_size(group) == 1 else group


@outside_inference_mode
def prepare(model: nn.Module, optimizer: Optimizer, config: Config | None = None,
            group: Any = None, *, versions: tuple[str, ...] = ()) -> tuple[ChunkedModel, ChunkOptimizer]:
    """Put `model`'s parameters, gradients and `optimizer`'s states into chunks. See SPEC section 3.

    group: the process group to shard model data over (ZeRO data parallel). None: the default group
    when one is initialised (or torchrun's environment says there is one), else no sharding.
    `chunkmem.LOCAL`: no sharding (each pipeline stage, for instance, holds its own model data).
    versions: names of chunk families holding other versions of the parameters (pipeline/versions.py).
    """
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"chunkmem.prepare's config is {type(config).__name__} {config!r:.80}: expected a "
                        "chunkmem.Config (chunkmem.Config(**options) makes one from a dict of its fields)")
    # The process group first: a rank that refuses its model or optimizer then ends its peers' rendezvous at once,
    # where they would otherwise wait for it until the group's timeout.
    group = shard_group(group, config)
    check_fresh(model, optimizer)
    rule = rule_for(optimizer)
    _say_if_wider(model, config)
    before = Snapshot.of(model)
    wrapped: ChunkedModel | None = None
    try:
        families = Families.declare(config.torch_dtype, rule.states, versions)
        runtime = Runtime(model, config, families, group, fingerprints(model, config, optimizer))
        wrapped = ChunkedModel(model, runtime)
        prepared = wrapped, ChunkOptimizer(runtime, optimizer, rule)
        for watcher in _WATCHERS:  # `chunkmem trace`'s recorder, which may fail to write its directory
            watcher(*prepared)
    except BaseException:  # SPEC: a prepare that raises leaves the model as it was
        if wrapped is not None:
            wrapped.hooks.remove()
        before.restore()
        raise
    retire(optimizer, prepared[1])
    return prepared


def _say_if_wider(model: nn.Module, config: Config) -> None:
    """A model cast to low precision before prepare (`model.to(torch.bfloat16)`) and prepared in a wider compute dtype
    (Config's default, fp32) computes and trains in that dtype: twice its memory, and other losses than its own."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes and all(d.itemsize < config.torch_dtype.itemsize for d in dtypes):
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        logging.getLogger("chunkmem").warning(
            "chunkmem: the model's parameters are %s, and Config.dtype=%r computes and trains them in %s (more "
            "memory, other losses): pass Config(dtype='bf16') or 'fp16' to compute in low precision, from fp32 master "
            "weights", names, config.dtype, str(config.torch_dtype).removeprefix("torch."))


Watcher = Callable[[ChunkedModel, ChunkOptimizer], None]
_WATCHERS: list[Watcher] = []  # told of every model prepare returns (the tracer: chunkmem/trace/api.py)


def watch_prepare(watcher: Watcher) -> None:
    """Call `watcher(model, optimizer)` with every pair `prepare` returns from now on (once per watcher)."""
    if watcher not in _WATCHERS:
        _WATCHERS.append(watcher)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What prepare changes in a module (parameter data, buffers), kept to put back if prepare fails."""

    data: dict[nn.Parameter, torch.Tensor]
    managed: dict[int, Any]  # the store that managed each parameter (store.MANAGED), if one did
    buffers: dict[tuple[nn.Module, str], torch.Tensor | None]
    requires_grad: dict[nn.Parameter, bool]
    reports: dict[nn.Module, Report]  # report_device's

    @classmethod
    def of(cls, module: nn.Module) -> Snapshot:
        return cls({p: p.data for p in module.parameters()}, MANAGED.entries(module.parameters()),
                   {(sub, name): b for sub in module.modules() for name, b in sub._buffers.items()},
                   {p: p.requires_grad for p in module.parameters()},
                   {sub: report_of(sub) for sub in module.modules()})

    def restore(self) -> None:
        for sub, report in self.reports.items():
            put_back(sub, report)
        for param, data in self.data.items():
            param.requires_grad_(self.requires_grad[param])
            put_data(param, data)
        MANAGED.put_back(self.managed)
        for (sub, name), buffer in self.buffers.items():
            sub._buffers[name] = buffer
