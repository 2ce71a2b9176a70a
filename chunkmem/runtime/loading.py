"""A prepared model's load_state_dict: torch's own loader, run on stand-ins, then the values into the chunks.

torch's loader does what a module asks of its load (its own `_load_from_state_dict`, BatchNorm filling in
num_batches_tracked, the user's load hooks) and says in torch's words what is missing and what fails; chunkmem's part
is where the values go: the master weights in fp32, and only once every value held, so a failed load changes nothing.
"""

from __future__ import annotations

import copy
import typing
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX, _IncompatibleKeys

from chunkmem.chunks.store import ParamRecord, outside_inference_mode
from chunkmem.runtime.runtime import Runtime


@outside_inference_mode
def load_values(module: nn.Module, runtime: Runtime, state_dict: Mapping[str, Any], strict: bool) -> _IncompatibleKeys:
    """Load `state_dict` into prepared `module` (ChunkedModel.load_state_dict): torch's loader assigns what it loads
    to stand-ins (meta ones, no copy of the model, but for modules with a loading of their own, which may write in
    place); a tied parameter's value may come under any of its names. The caller's `state_dict` is left as it was."""
    state_dict = _own_copy(state_dict)
    # Modules' extra state (`set_extra_state`) is set once every value is checked, as the values are written: torch's
    # loader would set it at once, and a load that then failed would have changed it.
    extra = {f"{name}.{_EXTRA_STATE_KEY_SUFFIX}" if name else _EXTRA_STATE_KEY_SUFFIX: sub
             for name, sub in module.named_modules() if type(sub).set_extra_state is not nn.Module.set_extra_state}
    held = {key: state_dict.pop(key) for key in extra if key in state_dict}
    records = typing.cast(Mapping[torch.Tensor, ParamRecord], runtime.store.records)  # buffers look up too
    modules = list(module.modules())
    own_loading = {t for sub in modules if type(sub)._load_from_state_dict is not nn.Module._load_from_state_dict
                   for t in sub._parameters.values()}
    tables: list[dict[str, Any]] = [t for sub in modules for t in (sub._parameters, sub._buffers)]
    slots = [(table, name, tensor) for table in tables for name, tensor in table.items() if tensor is not None]
    stand_ins = {tensor: _stand_in(tensor, tensor in records and tensor not in own_loading)
                 for _, _, tensor in slots}
    versions = {tensor: stand_in._version for tensor, stand_in in stand_ins.items()}
    given: dict[torch.Tensor, torch.Tensor] = {}  # what was loaded for each (a tied parameter: its last slot's)
    try:
        for table, name, tensor in slots:
            table[name] = stand_ins[tensor]
        result = module.load_state_dict(state_dict, strict=False, assign=True)
        for table, name, tensor in slots:
            now = table[name]
            if now is not stand_ins[tensor] or now._version != versions[tensor]:
                given[tensor] = now
    finally:
        for table, name, tensor in slots:
            table[name] = tensor
    found = {alias for tensor in given if tensor in records for alias in records[tensor].aliases}
    missing = [name for name in result.missing_keys if name not in found and name not in held]
    if strict and (missing or result.unexpected_keys):
        raise _load_error(type(module).__name__, missing, result.unexpected_keys)
    for tensor, value in given.items():  # a module's own loading may assign what torch's would not
        if value.shape != tensor.shape:
            raise ValueError(f"load_state_dict gave {_name_of(module, tensor)} a value of shape "
                             f"{tuple(value.shape)}, not its {tuple(tensor.shape)}: nothing was loaded")
        # What would fail in the writes below fails here, before any: a failed load changes nothing.
        if value.is_meta or value.layout is not torch.strided:
            kind = "on the meta device (no data)" if value.is_meta else f"of layout {value.layout}"
            raise RuntimeError(f"load_state_dict got a value for {_name_of(module, tensor)} that is {kind}: nothing was "
                               "loaded (give dense tensors with data: materialize meta ones, .to_dense() sparse "
                               "ones)")
    runtime.grads.drop_copies()  # a parameter viewing its host payload sees the values written there
    try:
        with torch.no_grad():
            for tensor, value in given.items():
                if tensor in records:
                    runtime.data.set_value(records[tensor], value)
                else:
                    tensor.copy_(value)
        runtime.rewrote([records[t] for t in given if t in records])  # as torch's copy_ into each parameter
        for key, value in held.items():  # after the values, as torch's loader: one that raises leaves them loaded
            extra[key].set_extra_state(value)
    finally:
        if runtime.shards is not None:  # gathered copies hold the values from before
            runtime.shards.drop_all()
    return _IncompatibleKeys(missing, result.unexpected_keys)


def _own_copy(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """`state_dict` as torch's loader may use it with assign=True, which writes into the dict's metadata (so that every
    later load of the caller's dict would assign, not copy) and sets the requires_grad of a Parameter it assigns."""
    own = OrderedDict((k, v.detach() if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        own._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
    return own


def _stand_in(tensor: torch.Tensor, meta: bool) -> torch.Tensor:
    """What load_state_dict loads into in place of a parameter or buffer: of its shape, on the meta device (a parameter
    whose module loads as torch does: assigned, never read), else a copy (fp32 for a parameter)."""
    if not isinstance(tensor, nn.Parameter):
        return tensor.detach().clone()
    if meta:  # torch's assign gives the value it loads this requires_grad: an integer one is then cast, as by a copy
        return nn.Parameter(torch.empty(tensor.shape, device="meta"), requires_grad=False)
    return nn.Parameter(tensor.detach().to("cpu", torch.float32, copy=True), tensor.requires_grad)


def _name_of(module: nn.Module, tensor: torch.Tensor) -> str:
    return next((n for n, t in [*module.named_parameters(), *module.named_buffers()] if t is tensor), "a tensor")


def _load_error(model: str, missing: list[str], unexpected: list[str]) -> RuntimeError:
    """load_state_dict's error, in torch's words."""
    lines = [what + " key(s) in state_dict: " + ", ".join('"' + key + '"' for key in keys) + ". "
             for what, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys]
    return RuntimeError(f"Error(s) in loading state_dict for {model}:\n\t" + "\n\t".join(lines))
