"""The tensors `optimizer.state[p]` gives for a prepared optimizer (ChunkStates).

[Note: optimizer states read by parameter]
torch.optim's `state[p]["exp_avg"]` is the state itself: a step changes it, and a change made in place through it
(`.zero_()`, `.mul_(0.5)`, `[...] = 0`: ReLoRA and loss-spike recovery reset Adam's moments so) is the optimizer's. A
prepared optimizer keeps its states in chunks, in whatever tier they are, so it gives fp32 copies on the host
instead, which behave as the states themselves: before each use, one a step (or a load, or a change made through
another copy) left behind is read again from its chunk, and an in-place change made through it, or through a view of
it (`.data` too), is written into the chunk at once. Not its `.numpy()` arrays (numpy's changes are not seen), nor its
clones or deep copies, which are plain tensors, as torch.optim's are. A copy refers to its optimizer and parameter
weakly: one kept after they are gone (a logged value) is a plain tensor with the value last read, and keeps none of
their memory.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map

from chunkmem.chunks.store import ParamRecord

if TYPE_CHECKING:
    from chunkmem.runtime.optim import ChunkOptimizer


class States(Protocol):
    """What a StateCopy reads and writes: the prepared optimizer (optim.ChunkOptimizer)."""

    state_writes: int  # steps, loads and changes made through its copies so far

    def read_state(self, record: Any, kind: str) -> torch.Tensor: ...

    def write_state(self, record: Any, kind: str, value: torch.Tensor) -> None: ...


class StateCopy(torch.Tensor):
    """An optimizer state as `optimizer.state[p]` gives it (the Note): an fp32 copy on the host of its part of a
    chunk (a root), or a view of one (`_root` names it)."""

    _root: StateCopy | None
    # A root's: its optimizer, its parameter's record (both weakly) and the state's kind; the optimizer's count of
    # state writes its value is from.
    _source: tuple[weakref.ref[States], weakref.ref[Any], str]
    _seen: int

    @staticmethod
    def made(states: States, record: Any, kind: str) -> StateCopy:
        """A copy of `record`'s state `kind` ("step": its step count) in `states`."""
        with torch.inference_mode(False):  # one read inside inference_mode is a tensor like any other
            made = states.read_state(record, kind).as_subclass(StateCopy)
        made._root, made._source, made._seen = None, (weakref.ref(states), weakref.ref(record), kind), \
            states.state_writes
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        copies = [a for a in tree_flatten((args, kwargs))[0] if type(a) is StateCopy]
        roots = list({id(root): root for root in map(_root, copies)}.values())
        with torch._C.DisableTorchFunctionSubclass():
            for root in roots:
                _fresh(root)
            # A view shares its base's version counter; `.data` has one of its own: each copy given is asked.
            versions = [c._version for c in copies]
            out = func(*args, **kwargs)
            changed = {id(_root(c)): _root(c) for c, version in zip(copies, versions) if c._version != version}
            for root in changed.values():
                _write(root)
            return tree_map(lambda o: _view_of(o, roots), out)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        """A plain tensor with the state's value, as a deep copy of torch.optim's state is."""
        with torch._C.DisableTorchFunctionSubclass():
            _fresh(_root(self))
            return copy.deepcopy(self.as_subclass(torch.Tensor), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (torch.save, pickle) as a plain tensor: loading it needs nothing of chunkmem's."""
        with torch._C.DisableTorchFunctionSubclass():
            _fresh(_root(self))
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def _root(tensor: StateCopy) -> StateCopy:
    return tensor if tensor._root is None else tensor._root


def _fresh(root: StateCopy) -> None:
    """`root` read again from its chunk if a step, a load or another copy changed the state since it was read."""
    states, record, kind = root._source[0](), root._source[1](), root._source[2]
    if states is None or record is None or root._seen == states.state_writes:
        return
    with torch.inference_mode(False), torch.no_grad():
        root.copy_(states.read_state(record, kind))
    root._seen = states.state_writes


def _write(root: StateCopy) -> None:
    """`root`, changed in place, into its chunk."""
    states, record, kind = root._source[0](), root._source[1](), root._source[2]
    if states is None or record is None:
        return
    with torch.inference_mode(False), torch.no_grad():
        states.write_state(record, kind, root)
    root._seen = states.state_writes


def _view_of(out: Any, roots: list[StateCopy]) -> Any:
    """`out`, an op's result, as a StateCopy of the root whose memory it views, if any (its in-place changes are the
    state's too); else as it is (a plain tensor: a clone, a sum)."""
    if type(out) is not torch.Tensor or out.layout is not torch.strided:
        return out
    for root in roots:
        if out.untyped_storage().data_ptr() == root.untyped_storage().data_ptr():
            view = out.as_subclass(StateCopy)
            view._root = root
            return view
    return out


class ChunkStates(Mapping):
    """A prepared optimizer's `state`: torch.optim's per-parameter states read from their chunks, as fp32 copies on the
    host that behave as the states themselves (Adam's step, exp_avg and exp_avg_sq; SGD's momentum_buffer, once a step
    with momentum made it): statecopy's Note. A state or a parameter's entry is not added, replaced or removed (the
    empty dict torch.optim's own would have been took those and did nothing). Not under ZeRO, where each rank holds a
    share of every state."""

    def __init__(self, optimizer: ChunkOptimizer) -> None:
        self.optimizer = optimizer

    def _stepped(self) -> dict[Any, ParamRecord]:
        self._not_sharded()
        return {r.param: r for r in self.optimizer.steps if self._has_stepped(r)}

    def _record(self, param: Any) -> ParamRecord | None:
        """`param`'s record if it has stepped (one lookup: a loop over the parameters reads each)."""
        self._not_sharded()
        record = self.optimizer.runtime.store.records.get(param)
        return record if record in self.optimizer.steps and self._has_stepped(record) else None

    def _has_stepped(self, record: ParamRecord) -> bool:
        """Whether `record`'s parameter has states: a step counted, or a count set back to 0 (torch keeps those)."""
        return self.optimizer.steps[record].item() > 0 or record in self.optimizer.restarted

    def _not_sharded(self) -> None:
        if self.optimizer.runtime.shards is not None:
            raise RuntimeError("optimizer.state is not read under ZeRO, where each rank holds a share of every state: "
                               "save the states with chunkmem.save_checkpoint(path, model, optimizer)")

    def __getitem__(self, param: Any) -> Mapping[str, torch.Tensor]:
        record = self._record(param)
        if record is None:
            return MappingProxyType({})  # as torch.optim's defaultdict reads a parameter that has not stepped
        return MappingProxyType({kind: StateCopy.made(self.optimizer, record, kind) for kind in self._kinds()})

    def snapshot(self, param: Any) -> dict[str, torch.Tensor]:
        """`param`'s states as plain tensors, copies of their values now (a state dict's: `ChunkOptimizer.state_dict`);
        {} before it has stepped."""
        record = self._record(param)
        return {} if record is None else {kind: self.optimizer.read_state(record, kind) for kind in self._kinds()}

    def _kinds(self) -> tuple[str, ...]:
        return (("step",) if self.optimizer.steps_adam else ()) + self.optimizer.runtime.store.families.saved

    def __contains__(self, param: Any) -> bool:
        return self._record(param) is not None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._stepped())

    def __len__(self) -> int:
        return len(self._stepped())

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a chunkmem optimizer keeps its states in chunks: optimizer.state[p] gives them, and takes "
                        "changes made in place (optimizer.state[p]['exp_avg'].zero_()), not states added, replaced or "
                        "removed; to save or restore them use chunkmem.save_checkpoint / load_checkpoint")

    __setitem__ = __delitem__ = clear = pop = update = setdefault = _refuse
