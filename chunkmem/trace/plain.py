"""Observer mode: the moments of a plain PyTorch model, made by hooks that only watch.

The runtime of a prepared model announces its moments itself; a plain model does not, so this
module installs the same points with PyTorch's public hooks: module pre/post forward, a
gradient landing in `.grad`, and the optimizer's step pre/post hooks (a step ends after the
optimizer). On a CPU run the non-model data is what autograd saves for backward, counted once per
storage by the same meter the runtime uses (chunkmem.runtime.activations); a saved-tensor hook installed by
the user's code inside the forward (activation checkpointing) takes precedence over it there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from chunkmem.chunks.observe import Moment, Observer
from chunkmem.runtime.activations import ActivationMeter, Saved


class PlainWatcher:
    """Emits Moments of one plain model (and its optimizer) to `observer`."""

    def __init__(self, model: nn.Module, observer: Observer) -> None:
        self.model = model
        self.observer = observer
        self.meter = ActivationMeter()
        self.step = 0
        self.index = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.handles: list[RemovableHandle] = []
        self._saving: Any = None  # the saved_tensors_hooks context while the root module runs
        self._depth = 0
        self._params: set[int] = set()
        names = {sub: name or type(model).__name__ for name, sub in model.named_modules()}
        for sub, name in names.items():
            self.handles.append(sub.register_forward_pre_hook(lambda m, a, name=name: self._pre(m, name)))
            self.handles.append(sub.register_forward_hook(lambda m, a, o, name=name: self._post(m, name),
                                                          always_call=True))
        param_names = {p: n for n, p in model.named_parameters()}
        for param, name in param_names.items():
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(
                    lambda _p, name=name: self.emit("grad", "bwd", name)))

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.optimizer is not None:
            return
        self.optimizer = optimizer
        self.handles.append(optimizer.register_step_pre_hook(lambda *_: self.emit("pre_optimizer", "optim", "step")))
        self.handles.append(optimizer.register_step_post_hook(lambda *_: self._stepped()))

    def emit(self, name: str, stage: str, where: str) -> None:
        self.observer.moment(Moment(self.step, self.index, name, stage, where, self.step == 0))
        self.index += 1

    def _stepped(self) -> None:
        self.emit("post_optimizer", "optim", "step")
        self.step += 1
        self.index = 0

    def _pre(self, module: nn.Module, name: str) -> None:
        if module is self.model:
            self._depth += 1
            if self._depth == 1 and torch.is_grad_enabled() and self._count_saved():
                self._params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
                self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                self._saving.__enter__()
        self.emit("pre_forward", "fwd", name)

    def _post(self, module: nn.Module, name: str) -> None:
        self.emit("post_forward", "fwd", name)
        if module is self.model:
            self._depth -= 1
            if self._depth == 0 and self._saving is not None:
                saving, self._saving = self._saving, None
                saving.__exit__(None, None, None)

    def _count_saved(self) -> bool:
        first = next(self.model.parameters(), None)
        return first is None or first.device.type != "cuda"  # on CUDA the allocator reading is used

    def _pack(self, tensor: torch.Tensor) -> Saved | torch.Tensor:
        try:
            is_param = tensor.untyped_storage().data_ptr() in self._params
        except (RuntimeError, NotImplementedError):  # tensors without storage
            return tensor
        return tensor if is_param else self.meter.wrap(tensor)  # weights are model data, not activations

    def _unpack(self, saved: Saved | torch.Tensor) -> torch.Tensor:
        return saved.get(self.meter) if isinstance(saved, Saved) else saved

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
