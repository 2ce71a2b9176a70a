"""The hooks that connect a model's execution to the runtime (see runtime's Note on parameters).

Installing them is the only change made to the user's modules; `remove()` takes them all off.

[Note: re-computation]
Under activation checkpointing, backward re-computes a checkpointed module before the ops of its backward run. Torch's
non-reentrant kind re-computes under saved-tensor hooks of its own, which keep what the re-computation saves on the
device for those ops, views of the module's parameter chunks among them: none of chunkmem's unpacks runs there, so
no access says that backward still reads the chunks. Released at the re-computation's end, as a forward releases
them, they left the device without a byte freed (the arena reuses no slot something else still views) and the next
chunk took a new slot: a tiny GPT-2 checkpointed per layer died of CUDA's error inside a layer's backward at budgets
prepare accepted. So the modules a re-computation under hooks not chunkmem's releases are held back (Runtime.holding)
until a re-computation begins for another node of backward, an op of that backward reads a tensor chunkmem's own
hooks saved (Runtime.unpack: none of a checkpointed segment's ops did, so backward has left it; autograd runs the
nodes of one ready queue latest first, so every node of the segment that runs has run: not a node on the host, which
CUDA's backward runs on another thread, in its own order; nor the backward the reentrant kind runs inside one of its
nodes, another), or the backward's graph task ends (whether or not a parameter's gradient comes: torch.autograd.grad
of the inputs), when that module's backward is done, or, after a backward that raised, the next forward begins: the
warm-up records its chunks as held there, and the plan keeps them. Not to the backward's end once the first layer is
re-computed: Gemma3n's model-level AltUp and per-layer projections, which run before that layer, read their weights'
chunks in backward after it, and beside its chunks found no room at budgets prepare accepted, which counts a layer's
chunks alone. Not at the next re-computation for the same node: a checkpointed function may call several modules in
turn (transformers 5 checkpoints a decoder layer's forward, not its call, so its norms, attention and MLP are
re-computed one after the other, its own hooks never running), and all of them are re-computed for the node that
first reads what they saved. Chunkmem's own hooks re-compute under the reentrant kind, whose unpacks access the
chunks as a forward's do. Not under ZeRO, where parameters view gathered copies, not chunks.

The modules around the first one re-computed run their forwards there without their hooks, under either kind, and
some read parameters of their own between their modules (BEiT's layer scales, between its attention and its MLP): with
no hook to bring them, a re-computation whose chunk had left died of a device mismatch. So those parameters come to
the device when the re-computation begins and stay until the modules held back are released (Runtime.hold_enclosing):
theirs directly or in a ParameterList, of every module around it (a module shared by several layers has several),
under ZeRO too (their groups stay gathered meanwhile). Prepare counts those of a transformers layer's modules that
call others as pinned beside each of its modules (store.checkpointed). Not one read before the first module runs:
nothing of chunkmem's runs there (the README's limit).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.hooks import RemovableHandle

from chunkmem.chunks.store import ParamRecord, forward_running, listed_parameters
from chunkmem.errors import MemoryBudgetError
from chunkmem.runtime.runtime import Runtime

_log = logging.getLogger("chunkmem")

_DESCRIPTOR_CALL = type(torch.Tensor.data.__set__)  # type: ignore[attr-defined]
# Attributes that give a view of the tensor's values (`h @ self.embed.weight.T`, an output layer tied to an embedding):
# read from a parameter, it is used.
_VIEWS = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
# Python's in-place operators and item assignment on a tensor (torch's in-place methods end in "_").
_IN_PLACE_CALLS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                             "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})
# Those of torch's in-place methods that change only what a tensor says of itself, not its values.
_METADATA_ONLY = frozenset({"requires_grad_", "detach_", "share_memory_", "t_", "transpose_", "squeeze_",
                            "unsqueeze_", "as_strided_", "swapdims_", "swapaxes_", "rename_"})


class FetchMode(TorchFunctionMode):
    """Brings a managed parameter to the device when a torch function receives it unannounced, and
    retries a forward op that ran out of device memory once chunks not in use have left."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.runtime = runtime
        # What `p.data` gave for a parameter `p` of the model in this forward, and views of it: id -> (it, p). Held
        # weakly: a view of a chunk's device payload kept here would keep its slot from the next chunk.
        self.data_of: dict[int, tuple[weakref.ref[torch.Tensor], nn.Parameter]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        data = False
        if type(func) is _DESCRIPTOR_CALL:
            view = getattr(func.__self__, "__name__", None) if func.__name__ == "__get__" else None
            if view not in _VIEWS:
                return func(*args, **kwargs)  # attribute accesses (.shape, .data =): nothing to fetch or retry
            data = view == "data"
        of_data = self._param_of_data(args, kwargs) if self.data_of else None
        # The hot path: every op of a forward comes here, and almost every one either gets no parameter or
        # parameters its module's hook already acquired; it pays one scan of its arguments.
        params = _parameters(args, kwargs)
        records = self.runtime.unannounced(params) if params else None
        if records:
            self.runtime.lean_allowed = False  # a forward without this mode would miss the fetch
            self.runtime.acquire_elsewhere(records)
        if func is F.batch_norm:
            cast_args, cast_kwargs = _affine_like_statistics(args, kwargs)
            if cast_args is not args or cast_kwargs is not kwargs:  # a step without this mode would miss the cast
                self.runtime.resident_allowed = False
                args, kwargs = cast_args, cast_kwargs
        try:
            out = func(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            # Activations outgrew the warm-up's record: make room with the chunks nobody uses and run
            # the op again (forward ops only: backward's kernels do not pass through this mode).
            out = self.runtime.placer.out_of_memory(error, lambda: func(*args, **kwargs))
        finally:
            if records:
                self.runtime.release(records)
        if data:
            managed = self.runtime.store.records
            param = args[0] if args[0] in managed else args[0]._base  # `.data` of a parameter, or of a view of one
            if param is not None and param in managed:
                self.data_of[id(out)] = (weakref.ref(out), param)
        elif of_data is not None:
            self._through_data(func, args, kwargs, out, of_data)
        return out

    def _param_of_data(self, args: tuple, kwargs: dict) -> nn.Parameter | None:
        """The parameter whose `p.data` (or a view of it) an op gets first, or as its `out`."""
        for given in (args[0] if args else None, kwargs.get("out")):
            known = self.data_of.get(id(given))
            if known is not None and known[0]() is given:
                return known[1]
        return None

    def _through_data(self, func: Any, args: tuple, kwargs: dict, out: Any, param: nn.Parameter) -> None:
        """`func` ran on what `param.data` gave in this forward (or a view of it). One that wrote it in place
        (Gemma3n clamps its AltUp coefficients so, in every forward) moved no version counter, and chunkmem would lose
        the change where the chunk is on the device: it is kept as a write through `param` is
        (Runtime.written_through_data). A view of it (or views, from `chunk` or `split`) is known as `param`'s too.
        Not torch's foreach functions, nor a write after the chunk moved (the README's limits). Outside a forward,
        `param.data` shares the parameter's version counter (chunks/store.py's Note on writes through `p.data`)."""
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.startswith("__") and name not in _METADATA_ONLY) or \
                name in _IN_PLACE_CALLS or "out" in kwargs or kwargs.get("inplace") is True:
            self.runtime.written_through_data(param)
            return
        given = args[0]
        if not isinstance(given, torch.Tensor) or given.layout is not torch.strided:
            return
        for view in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(view, torch.Tensor) and view.layout is torch.strided and \
                    view.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
                self.data_of[id(view)] = (weakref.ref(view), param)


def _affine_like_statistics(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """BatchNorm's weight and bias in the dtype of its running statistics.

    Buffers keep their precision (ChunkedModel), so under a bf16/fp16 compute dtype BatchNorm gets a
    low-precision input and weight beside fp32 running statistics. PyTorch's mixed-precision kernel
    takes a low-precision input with fp32 statistics, weight and bias, normalises in fp32 and returns
    the input's dtype; the cast is differentiable, so the gradient reaches the chunk in its own dtype.
    """
    positional = list(args)
    given = positional[0] if positional else kwargs.get("input")
    statistics = positional[1] if len(positional) > 1 else kwargs.get("running_mean")
    if statistics is None or given is None or statistics.dtype == given.dtype:
        return args, kwargs
    for index, name in ((3, "weight"), (4, "bias")):
        if index < len(positional):
            positional[index] = _cast(positional[index], statistics.dtype)
        elif name in kwargs:
            kwargs = kwargs | {name: _cast(kwargs[name], statistics.dtype)}
    return tuple(positional), kwargs


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _parameters(args: tuple, kwargs: dict) -> list[nn.Parameter]:
    """The parameters among an op's arguments (and in its list arguments). This runs for every argument of
    every op: a plain tensor's type answers first, before isinstance (Parameter's check runs Python code)."""
    found = []
    for arg in (*args, *kwargs.values()) if kwargs else args:
        kind = type(arg)
        if kind is torch.Tensor:
            continue
        if _is_parameter(arg, kind):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found.extend(item for item in arg if _is_parameter(item, type(item)))
    return found


def _is_parameter(arg: Any, kind: type) -> bool:
    """isinstance(arg, nn.Parameter), answered by `kind`, its type, for plain tensors and non-tensors."""
    return kind is nn.Parameter or (kind is not torch.Tensor and isinstance(arg, torch.Tensor)
                                     and isinstance(arg, nn.Parameter))


_LIVE: weakref.WeakSet[Hooks] = weakref.WeakSet()  # every prepared model's hooks (already_hooked)


def _grad_ready(hooks: weakref.ref[Hooks], param: nn.Parameter) -> None:
    owner = hooks()
    if owner is not None:
        owner.runtime.grad_ready(owner.runtime.store.records[param])


def _sum_for_users(hooks: weakref.ref[Hooks], param: nn.Parameter) -> None:
    owner = hooks()
    if owner is not None:
        owner.runtime.sum_for_users(owner.runtime.store.records[param])


class Hooks:
    """Module, gradient and saved-tensor hooks of one prepared model."""

    def __init__(self, module: nn.Module, runtime: Runtime) -> None:
        self.runtime = runtime
        self.handles: list[RemovableHandle] = []  # the gradient hooks, while they are on
        self.hooked: list[nn.Parameter] = []  # their parameters (those last hooked, while off)
        self.names = {sub: name or type(module).__name__ for name, sub in module.named_modules()}
        self.parents: dict[nn.Module, list[nn.Module]] = {}  # a module shared by several has them all
        for sub in module.modules():
            for child in sub.children():
                self.parents.setdefault(child, []).append(sub)
        self.enclosing: dict[nn.Module, list[ParamRecord]] = {}  # `_enclosing`'s, as first asked
        self.forwarding = False  # inside `forward()`, the model's own forward pass
        # A module running outside it, and the contexts it entered.
        self.outside: tuple[nn.Module, contextlib.ExitStack] | None = None
        self.refused: nn.Module | None = None  # a module whose pre-hook raised before acquiring (`_pre_forward`)
        # Whether its forwards without gradients are part of the training step (a frozen model's under a manager:
        # manager's Note), rather than evaluation off the plan.
        self.scores_in_step = False
        # A manager's model: its parameters' records, the gradients its forwards hide (one model's forward leaves
        # another's `p.grad` shown, as PyTorch does); None: all of the runtime's, its only model's.
        self.own: frozenset[ParamRecord] | None = None
        self.warned_unscaled = False  # that an fp16 model's module was called on its own to train (`_enter_outside`)
        self.module = module
        self.module_handles: list[RemovableHandle] = []  # the modules' forward hooks, while they are on
        # Those of the modules inside units (idle: they acquire nothing) that a lean forward takes off (`_idle_hooks`).
        self.idle_handles: list[tuple[nn.Module, RemovableHandle, RemovableHandle]] = []
        self.idle_off = False
        self._module_hooks(True)
        # A parameter's hooks are held by autograd's C++ side, where the collector cannot follow them: one that held
        # this object would keep the prepared model (its chunks, pinned memory and budget) alive for good. Once the
        # model is gone, its hook does nothing.
        self.ready = functools.partial(_grad_ready, weakref.ref(self))
        self.summing = functools.partial(_sum_for_users, weakref.ref(self))
        # `_grad_hooks_last`'s, on the parameters users hooked: kept while the others are off (a resident backward
        # leaves gradients in `p.grad`, where a forward hid the sum: Runtime.adopt_grads takes them all at its end).
        self.firsts: dict[nn.Parameter, RemovableHandle] = {}
        self._grad_hooks(True)
        runtime.hooks_last.append(weakref.WeakMethod(self._grad_hooks_last))
        _LIVE.add(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A module inside a prepared model, deep-copied or pickled, would take these hooks (and the runtime) along: its
        parameters are views into this model's chunks, in the compute dtype. ChunkedModel.__deepcopy__ makes the copy
        as plain PyTorch holds it."""
        raise TypeError("copy.deepcopy or pickling of a module inside a model chunkmem prepared: its parameters are "
                        "views into chunkmem's chunks and its hooks serve that model. Copy the prepared model itself "
                        "(copy.deepcopy(model) gives a plain module, fp32 values on the host, and its submodules), or "
                        "save model.state_dict()")

    def _module_hooks(self, on: bool) -> None:
        """Put the forward hooks on every module, or take them off. A resident step needs none (they would return at
        once), and a module with no hook takes PyTorch's short call path: 1.9 ms of a 39 ms launch-bound step of a
        20-layer LLaMA (benchmarks/overhead_parts.py's resident rows). Taken off when a forward runs resident, put
        back when one does not or a resident step gives way; between resident steps every parameter stays on the
        device (placement's can_stay), so a module called on its own meanwhile needs no fetch. Ours run first before
        the module (a user's pre-hook may read its parameters) and last after it (so may a user's post-hook),
        however often put back."""
        if on == bool(self.module_handles):
            return
        self._idle_hooks(True)
        if on:
            for sub in self.module.modules():
                handles = (sub.register_forward_pre_hook(self._pre_forward, prepend=True),
                           sub.register_forward_hook(self._post_forward, always_call=True))
                self.module_handles.extend(handles)
                if sub in self.runtime.idle_modules:
                    self.idle_handles.append((sub, *handles))
        else:
            _drop(self.module_handles)
            self.idle_handles.clear()

    def _idle_hooks(self, on: bool) -> None:
        """Put our forward hooks back on the modules inside units, or take them off for a lean forward that follows its
        plan steadily and has no observer (runtime's Note on lean forwards): they would return at once (an idle module
        acquires nothing, and has no moment then: `_moment_inside`), and a module with no hook takes PyTorch's short
        call path. A user's hooks on those modules stay. Back on when the forward ends, and as soon as its step gives way
        (`_pre_forward`), where the moments inside units make room again."""
        if on == (not self.idle_off):
            return
        self.idle_off = not on
        before, after = self._pre_forward, self._post_forward
        for sub, pre, post in self.idle_handles:
            if on:  # ours first before the module and last after it, as registered (the handles hold these dicts)
                hooks = sub._forward_pre_hooks
                if hooks:  # a user's: ours goes in front
                    users = dict(hooks)
                    hooks.clear()
                    hooks[pre.id] = before
                    hooks.update(users)
                else:
                    hooks[pre.id] = before
                sub._forward_hooks[post.id] = after
            else:  # a user may have cleared the dicts: nothing of ours to take off then
                sub._forward_pre_hooks.pop(pre.id, None)
                sub._forward_hooks.pop(post.id, None)

    def _grad_hooks(self, on: bool) -> None:
        """Put the gradient hooks on every trainable parameter of the model, or take them off. A resident backward
        needs none: autograd leaves each gradient in `p.grad` and the backward's end takes them all into their chunks
        at once (Runtime.adopt_grads): 2.3 ms less host time in a 39 ms launch-bound step of a 20-layer LLaMA
        (benchmarks/overhead_parts.py's resident rows)."""
        if on == bool(self.handles):
            return
        if on:  # its own parameters: a manager's runtime holds other models' too
            self.hooked = [param for param in self.module.parameters() if param.requires_grad]
            self.handles = [param.register_post_accumulate_grad_hook(self.ready) for param in self.hooked]
        else:
            _drop(self.handles)  # `hooked` stays, for `_grad_hooks_last`'s first hooks
        self.runtime.grads_unhooked(self, not on)

    def _grad_hooks_last(self) -> None:
        """A user's post-accumulate-grad hook, registered after `prepare`, runs before ours: it sees `p.grad` (and may
        change it in place) as on the plain model, before ours takes it into the chunk. Under accumulation that is the
        sum of the micro-batches' gradients so far, as autograd leaves it: a hook of ours runs first on the parameters
        users hooked (Runtime.sum_for_users); before, theirs saw each micro-batch's own."""
        # Autograd calls them in the order of insertion into the dict beneath the OrderedDict (PyDict_Next), which
        # move_to_end leaves as it was: ours are taken out and put in again.
        for param, handle in itertools.zip_longest(self.hooked, self.handles):  # no handles while off (resident)
            hooks = param._post_accumulate_grad_hooks
            if not hooks:
                continue
            if handle is not None and next(reversed(hooks)) != handle.id:
                hooks[handle.id] = hooks.pop(handle.id)
            first = self.firsts.get(param)
            if len(hooks) > (handle is not None) + (first is not None) and \
                    (first is None or next(iter(hooks)) != first.id):  # a user's among them, ours not first
                if first is None:
                    first = self.firsts[param] = param.register_post_accumulate_grad_hook(self.summing)
                others = {k: v for k, v in hooks.items() if k != first.id}
                ours = hooks[first.id]
                hooks.clear()
                hooks[first.id] = ours
                hooks.update(others)

    def _hooks_follow_residency(self) -> None:
        """This model's module and gradient hooks off while its runtime serves a resident step; once it does not, on
        for every model of the runtime (a manager's): one whose forward ran resident earlier in the step may recompute
        a checkpointed module in backward, after another's forward took the full path and moved chunks."""
        if self.runtime.placer.resident:
            self._module_hooks(False)
            self._grad_hooks(False)
            return
        for hooks in list(_LIVE):
            if hooks.runtime is self.runtime:
                hooks._module_hooks(True)
                hooks._grad_hooks(True)

    def _pre_forward(self, module: nn.Module, _args: Any) -> None:
        if self.runtime.placer.resident:  # nothing to bring, pin or measure (runtime's Note on resident steps)
            return
        try:  # until it acquires: raising before (torch.func refuses saved-tensor hooks, a moment found no room), the
            # module is `refused`, and the post-hook, run all the same, has nothing to release
            if not self.forwarding and self.outside is None:
                self._enter_outside(module)
            acquires = self._acquires(module)
            if acquires or self._moment_inside():
                nonmodel = self.runtime.emit("pre_forward", "fwd", self.names[module])
        except BaseException:
            self.refused = module
            raise
        if acquires:
            try:
                self.runtime.enter(module, nonmodel)
            except MemoryBudgetError as error:
                if not _in_backward():
                    raise
                held = "under torch's non-reentrant kind the chunks of the modules re-computed before it in the " \
                    "same checkpointed segment stay on the device until that segment's backward is done (what the " \
                    "re-computation saved views them: hooks' Note on re-computation), so " if self.runtime.holding else ""
                raise MemoryBudgetError(f"{error}. This was backward re-computing {self.names[module]} under "
                                        f"activation checkpointing: {held}checkpointing smaller segments also helps"
                                        ) from None
            if self.idle_off and not self.runtime.placer.steady:  # gave way: moments inside units make room again
                self._idle_hooks(True)

    def _post_forward(self, module: nn.Module, _args: Any, _output: Any) -> None:
        """Also when the module raised (always_call): its parameters are released and a mode it entered exits."""
        if self.runtime.placer.resident:
            return
        if self.refused is module:  # its pre-hook raised before it acquired
            self.refused = None
        elif self._acquires(module):
            self.runtime.leave(module)
            self.runtime.emit("post_forward", "fwd", self.names[module])
        elif self._moment_inside():
            self.runtime.emit("post_forward", "fwd", self.names[module])
        if self.outside is not None and self.outside[0] is module:
            self._leave_outside()
            held, self.runtime.holding = self.runtime.holding, False
            if held:
                self.runtime.recomputed(self.names[module])
            elif not _in_backward():  # called on its own, as the model's forward is: its ends are the forward's
                self.runtime.fence_params()
                if torch.is_grad_enabled():
                    self.runtime.mark_outputs(_output)

    def _enter_outside(self, module: nn.Module) -> None:
        """Backward re-computes a checkpointed module (or a module is called on its own): its ops need FetchMode as
        in the forward (weights used outside their module, BatchNorm's statistics), and the parameters autograd
        saves meanwhile are packed by chunk address, as in the forward, unless saved-tensor hooks are on (torch's
        non-reentrant checkpointing re-computes under its own, which keep what they save on the device). Reentrant
        checkpointing re-computes with none, and its backward, inside the model's, would otherwise read a
        parameter where it is then: on the host once its chunk has left. A module called on its own (a loss on
        `model.model(x)`'s hidden states) is a forward of the model's as its own forward is, from the gradients it hides
        before (grads.py's Note: the backward adds into their chunks) to the parameters it fences and the outputs whose
        backward hides them again after (`_post_forward`); not a re-computation, which backward runs."""
        backward = _in_backward()
        if backward:
            self.runtime.recomputing(torch._C._current_autograd_node())
            self.runtime.hold_enclosing(self._enclosing(module))
        if torch.is_grad_enabled() and not backward:
            self.runtime.grads.hide_for_forward(self.own, self.runtime.strays)
            if self.runtime.scaler is not None and not self.warned_unscaled:
                self.warned_unscaled = True
                _log.warning("chunkmem: %s, a module of a dtype='fp16' model, was called on its own with gradients "
                             "enabled: its outputs do not carry the loss scale the model's outputs carry, and step() "
                             "divides every gradient by it, so the gradients of a loss on them come out %g times too "
                             "small: compute it from the model's own forward, or use dtype='bf16'", self.names[module],
                             self.runtime.scaler.scale)
        with contextlib.ExitStack() as contexts:  # closed if entering raises (torch.func refuses saved-tensor hooks)
            contexts.enter_context(FetchMode(self.runtime))
            contexts.enter_context(forward_running())  # `p.data` PyTorch's, for the mode to follow (store.py's Note)
            if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
                contexts.enter_context(torch.autograd.graph.saved_tensors_hooks(
                    functools.partial(self.runtime.pack, metered=False), self.runtime.unpack))
            elif backward and self.runtime.shards is None:
                self.runtime.holding = True
            self.outside = (module, contexts.pop_all())

    def _leave_outside(self) -> None:
        """Exit what `_enter_outside` entered."""
        contexts, self.outside = self.outside[1], None  # type: ignore[index]  # (set: the callers check)
        contexts.close()

    def _enclosing(self, module: nn.Module) -> list[ParamRecord]:
        """The parameters of the modules around `module` that are theirs, not a child's that runs (BEiT's layer scales;
        those in a ParameterList), around every module `module` is shared by."""
        found = self.enclosing.get(module)
        if found is None:
            around: dict[nn.Module, None] = {}
            parents = list(self.parents.get(module, ()))
            while parents:
                parent = parents.pop()
                if parent not in around:
                    around[parent] = None
                    parents += self.parents.get(parent, ())
            params = {p: None for sub in around for p in (*sub.parameters(recurse=False), *listed_parameters(sub))}
            records = self.runtime.store.records
            found = self.enclosing[module] = [records[p] for p in params if p in records]
        return found

    def _acquires(self, module: nn.Module) -> bool:
        """Whether `module` acquires parameters when it runs (units.py's Note): a unit, a module outside every unit,
        and one inside a unit that runs outside a forward."""
        return module not in self.runtime.idle_modules or (self.outside is not None and self.outside[0] is module)

    def _moment_inside(self) -> bool:
        """Whether a module that acquires nothing has its moments (units.py's Note): where they decide something (the
        warm-up, a step that gave way) or an observer wants them (a trace)."""
        return self.runtime.observed or not self.runtime.placer.steady

    @contextlib.contextmanager
    def forward(self, inputs: Any = None, in_step: bool = True) -> Iterator[bool]:
        """The context of one forward pass of the whole model, whose inputs have the signature `inputs`; it
        gives whether the forward runs without the torch-function mode (runtime's Notes on resident steps and
        lean forwards). Not `in_step`: served off the plan (generation between steps). Under torch.inference_mode it runs
        as under torch.no_grad: what the forward makes of chunkmem's own (device payloads, parameters' views) outlives
        it, and an inference tensor can never be saved for a backward."""
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad(), self.forward(inputs, in_step) as modeless:
                yield modeless
            return
        if self.outside is not None and not _in_backward():
            # A module run on its own was interrupted (torch runs no always_call hook after a KeyboardInterrupt): what it
            # entered ends here, or the modules run on their own after it would run without (`_pre_forward`).
            self._leave_outside()
        runtime = self.runtime
        if runtime.shards is not None and runtime.shards.summoned:
            raise RuntimeError("a forward inside model.gathered_parameters(): under ZeRO a forward gathers the "
                               "parameters itself; run it after the `with` block")
        runtime.adopt_data()
        if runtime.held_back or runtime.held_params:  # a backward that raised left them (the Note on re-computation)
            runtime.release_held_back()
        training = torch.is_grad_enabled()
        if training:  # the gradients shown since the last backward: the next one accumulates into their chunks
            runtime.grads.hide_for_forward(self.own, self.runtime.strays)
        modeless = runtime.begin_forward(inputs, training)
        resident = runtime.placer.resident
        self._hooks_follow_residency()
        self._grad_hooks_last()
        # A forward without gradients (evaluation) is not part of the training step the plan follows, but for a
        # frozen model's under a manager.
        runtime.placer.off_path = not in_step or not (training or self.scores_in_step)
        if runtime.shards is not None:  # nor of the order of gathers the next step follows
            runtime.shards.off_path = runtime.placer.off_path
        self.forwarding = True
        runtime.metering = not (modeless and runtime.device.reads_memory)  # runtime's Note on lean forwards
        try:
            self._idle_hooks(not (modeless and not resident and not runtime.observed))
            # Re-computation under activation checkpointing must run whole: stopping early (torch's default)
            # skips the post-forward hooks that release parameters, leaving their chunks pinned.
            unmetered = resident and runtime.device.reads_memory  # runtime's Note on resident steps
            with contextlib.nullcontext() if unmetered else torch.autograd.graph.saved_tensors_hooks(
                    runtime.pack, runtime.unpack), \
                    contextlib.nullcontext() if modeless else FetchMode(runtime), set_checkpoint_early_stop(False), \
                    forward_running():
                yield modeless
            if resident and training:
                runtime.end_resident_forward(inputs)
                self._hooks_follow_residency()  # outgrown: the rest of the step gives way
            runtime.fence_params()  # the caller may read parameters before backward (a penalty, a log line)
        finally:
            self.forwarding = False
            self._idle_hooks(True)
            runtime.metering = True
            if runtime.shards is not None and runtime.shards.off_path:
                # Nor may it leave gathered groups behind: the next step would find them and gather (and
                # so access chunks) otherwise than the warm-up recorded.
                runtime.shards.drop_all()
                runtime.shards.off_path = False
            runtime.placer.off_path = False
            runtime.release_all()

    def remove(self) -> None:
        _LIVE.discard(self)
        self._module_hooks(False)
        self.runtime.adopt_grads()  # a gradient autograd left in `p.grad` while the hooks were off
        _drop(self.handles)
        _drop(list(self.firsts.values()))
        self.runtime.grads_unhooked(self, False)  # removed for good, not off


def _in_backward() -> bool:
    """Whether a backward is running on this thread (a checkpointed module re-computed)."""
    return torch._C._current_graph_task_id() != -1


def _drop(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def already_hooked(module: nn.Module) -> str | None:
    """The name of the first submodule or parameter of `module` that another prepared model's hooks
    manage (its parameters are views into that model's chunks), or None."""
    # Every live prepared model's modules and trainable parameters, their hooks on or off (a model whose hooks are on
    # is kept alive by them); a parameter may sit in a module of another model (a manager names frozen ones).
    live = list(_LIVE)
    hooked = {id(sub) for hooks in live for sub in hooks.module.modules()}
    for name, sub in module.named_modules():
        if id(sub) in hooked:
            return f"module {name or type(module).__name__}"
    for name, param in module.named_parameters():
        if param.requires_grad and any(param in hooks.runtime.store.records for hooks in live):
            return f"parameter {name}"
    return None
