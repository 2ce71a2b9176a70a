"""The tensors `optimizer.state[p]` gives for a prepared optimizer (optim.ChunkStates).

[Note: optimizer states read by parameter]
torch.optim's `state[p]["exp_avg"]` is the state itself: a step changes it, and a change made in place through it
(`.zero_()`, `.mul_(0.5)`, `[...] = 0`: ReLoRA and loss-spike recovery reset Adam's moments so) is the optimizer's. A
prepared optimizer keeps its states in chunks, in whatever tier they are, so it gives fp32 copies on the host
instead, which behave as the states themselves: before each use, one a step (or a load, or a change made through
another copy) left behind is read again from its chunk, and an in-place change made through it, or through a view of
it, is written into the chunk at once. Not its `.numpy()` arrays (numpy's changes are not seen), nor its clones or
deep copies, which are plain tensors, as torch.optim's are.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map


class StateCopy(torch.Tensor):
    """An optimizer state as `optimizer.state[p]` gives it (the Note): an fp32 copy on the host of its part of a
    chunk, or a view of one."""

    # The copy `optimizer.state[p]` gave (a view's base); and of that copy only: how to read its value from the chunk
    # and write it there, and the optimizer's count of state writes its value is from (`ChunkOptimizer.state_writes`).
    _root: StateCopy
    _read: Callable[[], torch.Tensor]
    _write: Callable[[torch.Tensor], None]
    _writes: Callable[[], int]
    _seen: int

    @staticmethod
    def made(read: Callable[[], torch.Tensor], write: Callable[[torch.Tensor], None],
             writes: Callable[[], int]) -> StateCopy:
        """A copy of the state `read()` gives; `write(value)` puts a changed one into its chunk, and `writes()` counts
        the state writes so far (a step's, a load's, a copy's)."""
        made = read().as_subclass(StateCopy)
        made._root, made._read, made._write, made._writes, made._seen = made, read, write, writes, writes()
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        roots = list({id(a._root): a._root for a in tree_flatten((args, kwargs))[0] if type(a) is StateCopy}.values())
        with torch._C.DisableTorchFunctionSubclass():
            for root in roots:
                if root._seen != root._writes():  # a step, a load or another copy changed the state since
                    root.copy_(root._read())
                    root._seen = root._writes()
            versions = [root._version for root in roots]  # a view shares its base's version counter
            out = func(*args, **kwargs)
            for root, version in zip(roots, versions):
                if root._version != version:
                    root._write(root)
                    root._seen = root._writes()
            return tree_map(lambda o: _view_of(o, roots), out)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        """A plain tensor with the state's value, as a deep copy of torch.optim's state is."""
        with torch._C.DisableTorchFunctionSubclass():
            return copy.deepcopy(self.as_subclass(torch.Tensor), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (torch.save, pickle) as a plain tensor: loading it needs nothing of chunkmem's."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def _view_of(out: Any, roots: list[StateCopy]) -> Any:
    """`out`, an op's result, as a StateCopy of the root whose memory it views, if any (its in-place changes are the
    state's too); else as it is (a plain tensor: a clone, a sum)."""
    if type(out) is not torch.Tensor:
        return out
    for root in roots:
        if out.untyped_storage().data_ptr() == root.untyped_storage().data_ptr():
            view = out.as_subclass(StateCopy)
            view._root = root
            return view
    return out
