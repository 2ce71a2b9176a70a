"""Where a prepared module says it is: `device`, as Hugging Face models (and modules written the same way) have it.

Their `device` is their first parameter's, which `generate` and some forwards (XLNet's) create tensors on and move
inputs to. A parameter whose chunk is not on the device views its host payload, so on CUDA a streaming model said
"cpu" after a step, and those tensors met CUDA ones. Prepared, such a module's class is a subclass of it, of the same
name, whose `device` is where chunkmem computes (as torch.nn.utils.parametrize subclasses the modules it changes).
The device is kept by weak reference: a manager's models move to each new runtime, and the old one's memory goes.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from chunkmem.memory.device import Device

_REPORTED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Device]] = weakref.WeakKeyDictionary()
_SUBCLASSES: dict[type, type] = {}
Report = tuple[type, "weakref.ref[Device] | None"]  # a module's class, and the device it says it is on


def report_device(module: nn.Module, device: Device) -> None:
    """Make every submodule of `module` whose class has a `device` property say `device`'s torch device."""
    where = weakref.ref(device)
    for sub in module.modules():
        cls = type(sub)
        if "_chunkmem_base" not in vars(cls):
            if not isinstance(inspect.getattr_static(cls, "device", None), property):
                continue
            if cls not in _SUBCLASSES:
                _SUBCLASSES[cls] = _subclass(cls)
            sub.__class__ = _SUBCLASSES[cls]
        _REPORTED[sub] = where


def report_of(module: nn.Module) -> Report:
    return type(module), _REPORTED.get(module)


def put_back(module: nn.Module, report: Report) -> None:
    """What `module` said before (report_of's): a prepare that failed changes nothing."""
    module.__class__, where = report
    if where is None:
        _REPORTED.pop(module, None)
    else:
        _REPORTED[module] = where


def plain_class(module: nn.Module) -> type:
    """The class `module` had before report_device (a deep copy is a plain module)."""
    return vars(type(module)).get("_chunkmem_base", type(module))


def _subclass(cls: type) -> type:
    own = inspect.getattr_static(cls, "device")

    def device(self: nn.Module) -> torch.device:
        reported = _REPORTED.get(self)
        where = reported() if reported is not None else None
        return where.torch_device if where is not None else own.__get__(self)  # a copy made some other way

    return type(cls.__name__, (cls,), {"device": property(device, own.fset, own.fdel, own.__doc__),
                                       "_chunkmem_base": cls, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
