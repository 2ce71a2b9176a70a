"""The hooks that connect a model's execution to the runtime (see runtime's Note on parameters).

Installing them is the only change made to the user's modules; `remove()` takes them all off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.hooks import RemovableHandle

from chunkmem.runtime import Runtime


_DESCRIPTOR_CALL = type(torch.Tensor.data.__set__)  # type: ignore[attr-defined]


class FetchMode(TorchFunctionMode):
    """Brings a managed parameter to the device when a torch function receives it unannounced, and
    retries a forward op that ran out of device memory once chunks not in use have left."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # The hot path: every op of a forward comes here, and almost every one either gets no parameter or
        # parameters its module's hook already acquired; it pays one scan of its arguments.
        params = _parameters(args, kwargs) if type(func) is not _DESCRIPTOR_CALL else None
        records = self.runtime.unannounced(params) if params else None
        if records:
            self.runtime.acquire(records)
        try:
            return func(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            # Activations outgrew the warm-up's record: make room with the chunks nobody uses and run
            # the op again (forward ops only: backward's kernels do not pass through this mode).
            self.runtime.placer.out_of_memory(error)
            return func(*args, **kwargs)
        finally:
            if records:
                self.runtime.release(records)


def _parameters(args: tuple, kwargs: dict) -> list[nn.Parameter]:
    found = []
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, nn.Parameter):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found.extend(item for item in arg if isinstance(item, nn.Parameter))
    return found


class Hooks:
    """Module, gradient and saved-tensor hooks of one prepared model."""

    def __init__(self, module: nn.Module, runtime: Runtime) -> None:
        self.runtime = runtime
        self.handles: list[RemovableHandle] = []
        self.names = {sub: name or type(module).__name__ for name, sub in module.named_modules()}
        for sub in module.modules():
            self.handles.append(sub.register_forward_pre_hook(self._pre_forward))
            self.handles.append(sub.register_forward_hook(self._post_forward))
        for param, record in runtime.store.records.items():
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(
                    lambda _p, record=record: runtime.grad_ready(record)))

    def _pre_forward(self, module: nn.Module, _args: Any) -> None:
        self.runtime.emit("pre_forward", "fwd", self.names[module])
        self.runtime.acquire(self.runtime.module_records[module])

    def _post_forward(self, module: nn.Module, _args: Any, _output: Any) -> None:
        self.runtime.release(self.runtime.module_records[module])
        self.runtime.emit("post_forward", "fwd", self.names[module])

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The context of one forward pass of the whole model."""
        runtime = self.runtime
        # A forward without gradients (evaluation) is not part of the training step the plan follows.
        runtime.placer.off_path = not torch.is_grad_enabled()
        if runtime.shards is not None:  # nor of the order of gathers the next step follows
            runtime.shards.off_path = runtime.placer.off_path
        try:
            # Re-computation under activation checkpointing must run whole: stopping early (torch's default)
            # skips the post-forward hooks that release parameters, leaving their chunks pinned.
            with torch.autograd.graph.saved_tensors_hooks(runtime.pack, runtime.unpack), FetchMode(runtime), \
                    set_checkpoint_early_stop(False):
                yield
        finally:
            if runtime.shards is not None and runtime.shards.off_path:
                # Nor may it leave gathered groups behind: the next step would find them and gather (and
                # so access chunks) otherwise than the warm-up recorded.
                runtime.shards.drop_all()
                runtime.shards.off_path = False
            runtime.placer.off_path = False
            runtime.release_all()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
