"""Parameters as views into chunks: the records, the chunk groups, and the views that follow moves.

Trainable and frozen parameters are packed into separate chunk lists, so frozen chunks carry no
gradient, master or optimizer storage. Chunk group `i` is chunk `i` of every family of one list:
its parameter chunk, gradient chunk, fp32 master chunk and optimizer-state chunks share one layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from chunkmem.chunks.chunk import Chunk, HostTier
from chunkmem.chunks.family import Families, Family
from chunkmem.chunks.layout import Layout, Slot, pack
from chunkmem.chunks.state import TENSOR_MOVES, ChunkState, TensorState, next_tensor_state
from chunkmem.memory.device import Device

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(eq=False)
class ParamRecord:
    """One managed parameter: where it lives and the states of its value and its gradient."""

    name: str  # its name in its model (a ModelSet's member: not the set's "<i>." prefixed one)
    aliases: tuple[str, ...]  # every name it has in its model (tied weights have several)
    param: nn.Parameter
    shape: torch.Size
    slot: Slot
    group: ChunkGroup
    state: TensorState = TensorState.HOLD
    uses: int = 0  # nested COMPUTE uses (a module called inside another that shares the weight)
    grad_state: TensorState = TensorState.FREE
    # The parameter's version counter when its master last took its value: a change made in place since, which moves
    # it, goes into the master too (Runtime.adopt_data).
    version: int = 0

    def move(self, move: str) -> None:
        # The hot path (every module call): a lookup, the message only for an illegal move.
        self.state = TENSOR_MOVES.get((self.state, move)) or \
            next_tensor_state(self.state, move, f"parameter {self.name}")

    def move_grad(self, move: str) -> None:
        self.grad_state = TENSOR_MOVES.get((self.grad_state, move)) or \
            next_tensor_state(self.grad_state, move, f"gradient of {self.name}")

    def __post_init__(self) -> None:
        self.strides = torch.empty(self.shape, device="meta").stride()  # contiguous, in its shape

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's slice of a chunk payload (`flat`: [numel], contiguous), in its shape. One strided view,
        not a slice then a view: this runs for every parameter at every move and optimizer step."""
        return flat.as_strided(self.shape, self.strides, flat.storage_offset() + self.slot.offset)


@dataclasses.dataclass(eq=False)
class ChunkGroup:
    """Chunk `index` of every family of one chunk list, and the parameters packed into it."""

    index: int
    trainable: bool
    chunks: dict[str, Chunk]  # family name -> chunk: "param", "grad", "master", "exp_avg", ...
    members: list[ParamRecord] = dataclasses.field(default_factory=list)

    @property
    def param(self) -> Chunk:
        return self.chunks["param"]

    @property
    def grad(self) -> Chunk:
        return self.chunks["grad"]

    @property
    def owned(self) -> bool:
        return bool(self.chunks)

    @property
    def master(self) -> Chunk:
        """The fp32 copy the optimizer updates (the parameter chunk itself in fp32)."""
        return self.chunks.get("master", self.chunks["param"])

    def versions(self) -> list[int]:
        """Its parameters' version counters: they move on every in-place write a user or autograd can see."""
        return [r.param._version for r in self.members]


class ParamStore:
    """All chunk groups of one model and the parameters in them. With a disk tier (`host_tier`), the chunks only
    the optimizer touches (fp32 master weights and optimizer states) are disk-backed (hostcache's Note)."""

    def __init__(self, module: nn.Module, families: Families, device: Device, chunk_size: int,
                 world: int = 1, rank: int = 0, host_tier: HostTier | None = None) -> None:
        self.families = families
        self.dtype = families.dtype
        self.device = device
        self.chunk_size = chunk_size
        self.host_tier = host_tier
        self.world, self.rank = world, rank
        self.groups: list[ChunkGroup] = []
        self.records: dict[nn.Parameter, ParamRecord] = {}
        aliases = _aliases(module)
        params = dict(module.named_parameters())
        for layout, is_trainable in zip(layouts(module, chunk_size, world), (True, False)):
            self._add_groups(layout, params, is_trainable, aliases)
        self._group_of_param_chunk = {g.param.name: g for g in self.owned_groups()}
        MANAGED.add(self)
        # Parameter chunks whose parameters view the device payload -> their versions then (`note_writes`).
        self.device_views: dict[Chunk, list[int]] = {}

    def _add_groups(self, layout: Layout, params: dict[str, nn.Parameter], trainable: bool,
                    aliases: dict[nn.Parameter, tuple[str, ...]]) -> None:
        families = self.families.trained if trainable else self.families.frozen
        for index in range(layout.num_chunks):
            owned = index % self.world == self.rank  # other ranks' chunks have records but no storage here
            group = ChunkGroup(index, trainable, {f.name: self._chunk(f, index, trainable)
                                                  for f in families if owned})
            for slot in layout.members(index):
                param = params[slot.name]
                record = ParamRecord(aliases[param][0], aliases[param], param, param.shape, slot, group,
                                     version=param._version)
                group.members.append(record)
                self.records[param] = record
            self.groups.append(group)

    def _chunk(self, family: Family, index: int, trainable: bool) -> Chunk:
        return Chunk(family.chunk_name(index, trainable), self.chunk_size, family.dtype, self.device,
                     self.host_tier if family.disk_backed else None, family.lends, family.name)

    def states(self, group: ChunkGroup) -> list[Chunk]:
        """The group's chunks kept with the optimizer's state: its states and other parameter versions."""
        return [group.chunks[name] for name in self.families.saved]

    def swap_param_chunk(self, group: ChunkGroup, kind: str) -> None:
        """Exchange the group's "param" chunk with its chunk of `kind`, a second version of the parameters in the
        same layout and dtype: from now on the parameters view that one, and compute acquires it."""
        old, other = group.param, group.chunks[kind]
        if other.numel != old.numel or other.dtype != old.dtype:
            raise ValueError(f"{other.name} ({other.numel} x {other.dtype}) cannot stand in for {old.name} "
                             f"({old.numel} x {old.dtype}): a parameter version needs the same layout and dtype")
        self.note_writes(old)  # the parameters' changes stay with the version they were made to
        self.device_views.pop(old, None)
        group.chunks["param"], group.chunks[kind] = other, old
        del self._group_of_param_chunk[old.name]
        self._group_of_param_chunk[other.name] = group
        self.point_views(other)

    def owned_groups(self) -> Iterator[ChunkGroup]:
        """Groups whose chunks this rank stores (all of them without sharding)."""
        return (g for g in self.groups if g.chunks)

    def trainable_groups(self) -> Iterator[ChunkGroup]:
        return (g for g in self.owned_groups() if g.trainable)

    def chunks(self) -> Iterator[Chunk]:
        return (c for g in self.groups for c in g.chunks.values())

    def load_initial_values(self) -> None:
        """Copy each parameter's current value into its chunks (skipped for meta tensors)."""
        for group in self.owned_groups():
            for kind in ("param", "master"):
                if kind in group.chunks:
                    group.chunks[kind].materialize_host()
            for record in group.members:
                if record.param.device.type != "meta":
                    record.view(group.param.host).copy_(record.param.detach())
                    if "master" in group.chunks:
                        record.view(group.master.host).copy_(record.param.detach())

    def group_of(self, chunk: Chunk) -> ChunkGroup | None:
        """The group whose parameters view `chunk` (None: not a parameter chunk of this rank)."""
        return self._group_of_param_chunk.get(chunk.name)

    def point_views(self, chunk: Chunk, at_host: bool = False) -> None:
        """Point parameters at their chunk's device payload when resident (unless `at_host`), else at the host one."""
        group = self.group_of(chunk)
        if group is None:
            return
        # Pointing views moves no bytes: compute waits for an upload where it uses the chunk (Chunk's Note).
        flat = chunk.device_unfenced if chunk.device_unfenced is not None and not at_host else chunk.host_unfenced
        if flat is chunk.host_unfenced:
            self.device_views.pop(chunk, None)
        elif chunk not in self.device_views:
            self.device_views[chunk] = group.versions()
        # Already there (the step's host update claims a chunk whose parameters the backward's end pointed at the host):
        # a view set again costs as much as a new one, twice a group a step.
        # Read without torch-function modes: FetchMode would take these reads for uses of the parameters.
        base, size = flat.data_ptr(), flat.element_size()
        with torch._C.DisableTorchFunction():
            if all(r.param.data_ptr() == base + r.slot.offset * size and r.param.dtype is flat.dtype and
                   r.param.stride() == r.strides and r.param.shape == r.shape for r in group.members):
                return
        for record in group.members:
            if record.param.device.type == "meta":
                # `.data =` cannot move a meta tensor to a real device; swapping keeps the Parameter
                # object (the optimizer's and the records' key) and gives it the chunk view once.
                # A tensor of its own over the view: a view shares its chunk payload's version counter, which
                # chunkmem's writes into the chunk move, and the parameter's must move for the user's writes alone.
                view = record.view(flat)
                own = torch.empty(0, dtype=view.dtype, device=view.device)
                own.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
                torch.utils.swap_tensors(record.param, nn.Parameter(own, record.param.requires_grad))
                record.version = record.param._version
            else:
                record.param.data = record.view(flat)

    def written(self, record: ParamRecord) -> None:
        """`record`'s parameter was changed in place where its version counter did not move (through `p.data` in a
        forward: FetchMode._through_data): the versions that find such changes see one, so the master takes its value
        (Runtime._adopt_edits) and a device payload it views is dirty before it leaves (`note_writes`)."""
        record.version = -1
        if record.group.param in self.device_views:
            self.device_views[record.group.param] = []

    def note_writes(self, chunk: Chunk) -> None:
        """A clean device payload that parameters viewing it changed in place since they were pointed there (`with
        torch.no_grad(): p.mul_(0.9)` after a step, or `p.data.clamp_(-c, c)`: a weight constraint, EMA weights swapped
        in) is dirty: the host payload no longer holds its values (the Note on writes through `p.data`)."""
        versions = self.device_views.get(chunk)
        if versions is None:
            return
        now = self._group_of_param_chunk[chunk.name].versions()
        if now != versions:
            self.device_views[chunk] = now
            if chunk.state is ChunkState.DEVICE:
                chunk.write_device()

    def model_data_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks())


def layouts(module: nn.Module, chunk_size: int, multiple_of: int = 1) -> tuple[Layout, Layout]:
    """The layouts of the trainable and of the frozen parameters, each in module order."""
    named = list(module.named_parameters())
    return (pack([(n, p.numel()) for n, p in named if p.requires_grad], chunk_size, multiple_of),
            pack([(n, p.numel()) for n, p in named if not p.requires_grad], chunk_size, multiple_of))


# Note on writes through `p.data`
#
# PyTorch gives `p.data` a version counter of its own, so that autograd does not see a change made through it.
# chunkmem finds the user's changes to a parameter by its version counter (ParamStore.note_writes: a device payload
# they make dirty; Runtime._adopt_edits: a master that takes the new value), and lost those made through `p.data`
# outside a forward: WGAN's `p.data.clamp_(-c, c)` after a step, hand-made weight decay, Lookahead, weights copied
# in. So outside a forward, `p.data` of a parameter chunkmem manages is `p.detach()`, which shares the counter: the
# change is seen as one made through `p` is (nn.Parameter's `data` property, set below; other parameters' `p.data`,
# and `p.data = t`, are PyTorch's). The one difference from PyTorch: made between a forward and its backward, such a
# change raises the error autograd gives for `p.detach().mul_(2)` there, rather than backward silently reading the
# new values. Inside a forward (and inside a module run on its own or re-computed in backward, where chunkmem's
# torch-function mode runs too) `p.data` is PyTorch's, and that mode follows what is written through it
# (FetchMode._through_data): a module called several times in one forward whose pre-hook prunes its weight through
# `p.data`, or Gemma3n clamping its AltUp coefficients in each of two forwards before one backward, would otherwise
# raise where PyTorch trains. A torch-function mode of the user's changes nothing: `torch.set_default_device` keeps
# one on for good, and under it every change through `p.data` was lost where the chunk was on the device. The class
# of a parameter is left as it is: a subclass with its own `data` broke `nn.Parameter(p)` and
# `torch.utils.swap_tensors`.


class _Managed:
    """The parameters of every live ParamStore, by identity. Not held weakly themselves: torch.utils.swap_tensors
    refuses a tensor with a weak reference (and a WeakSet compares tensors with `==`, elementwise)."""

    def __init__(self) -> None:
        self._stores: dict[int, weakref.ref[ParamStore]] = {}  # id(param) -> the store that manages it

    def add(self, store: ParamStore) -> None:
        def forget(ref: weakref.ref[ParamStore]) -> None:  # that store is gone: so are its entries
            for key in keys:
                if self._stores.get(key) is ref:
                    del self._stores[key]
        keys = [id(p) for p in store.records]
        ref = weakref.ref(store, forget)
        self._stores.update(dict.fromkeys(keys, ref))

    def entries(self, params: Iterable[nn.Parameter]) -> dict[int, weakref.ref[ParamStore] | None]:
        """What these parameters' entries are now, for `put_back` (a prepare that raises changes nothing)."""
        return {id(p): self._stores.get(id(p)) for p in params}

    def put_back(self, entries: dict[int, weakref.ref[ParamStore] | None]) -> None:
        for key, ref in entries.items():
            if ref is None:
                self._stores.pop(key, None)
            else:
                self._stores[key] = ref

    def __contains__(self, param: object) -> bool:
        ref = self._stores.get(id(param))
        store = ref() if ref is not None else None
        return store is not None and param in store.records  # a live store keeps its parameters, and so their ids


MANAGED = _Managed()
_DATA: Any = vars(torch._C.TensorBase)["data"]  # PyTorch's `p.data` and `p.data = t`
_forwards = 0  # forwards of prepared models running, and modules run outside them (`forward_running`)


def _data(param: nn.Parameter) -> torch.Tensor:
    if _forwards or param not in MANAGED:
        return _DATA.__get__(param)
    return param.detach()


nn.Parameter.data = property(_data, _DATA.__set__, doc=_DATA.__doc__)  # type: ignore[assignment]


@contextlib.contextmanager
def forward_running() -> Iterator[None]:
    """The context of a prepared model's forward: `p.data` is PyTorch's inside it (the Note above)."""
    global _forwards
    _forwards += 1
    try:
        yield
    finally:
        _forwards -= 1


def outside_inference_mode(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` run outside torch.inference_mode, where it makes chunkmem's tensors (chunks, views, a load's stand-ins):
    made inside, they would be inference tensors, which no training step can use. Grad mode stays the caller's (leaving
    inference mode alone turns gradients on: a module's own loading that writes a parameter in place under the caller's
    torch.no_grad would raise)."""
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        grads = torch.is_grad_enabled()
        with torch.inference_mode(False), torch.set_grad_enabled(grads):
            return fn(*args, **kwargs)
    return run


def put_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """`param.data = data`, also between the meta device and a real one (which `.data =` refuses)."""
    if param.device.type != data.device.type and "meta" in (param.device.type, data.device.type):
        torch.utils.swap_tensors(param, nn.Parameter(data, param.requires_grad))  # as point_views
    else:
        param.data = data


def pinned_chunks(module: nn.Module, chunk_size: int
                  ) -> tuple[frozenset[tuple[bool, int]], list[tuple[str, nn.Module]]]:
    """The parameter chunks pinned at once at most under this chunk size, as (trainable, index), and the
    modules that pin them (`pinned_at_once`)."""
    trainable, frozen = layouts(module, chunk_size)
    where = {s.name: (True, s.chunk) for s in trainable.slots} | {s.name: (False, s.chunk) for s in frozen.slots}
    name_of = {p: n for n, p in module.named_parameters()}
    # Around a checkpointed layer (it too), a module's parameters in a ParameterList or ParameterDict of its own are
    # held through the layer's re-computation as its direct ones are (Hooks._enclosing)
    trained = trained_modules(module)
    around_layers = {m for m in module.modules() if any(checkpointed(sub, sub in trained) for sub in m.modules())}

    def params(m: nn.Module) -> list[nn.Parameter]:
        if recomputed_whole(m, m in trained):
            return list(m.parameters())
        own = list(m.parameters(recurse=False))
        if m in around_layers:
            own += listed_parameters(m)
        if checkpointed(m, m in trained):  # those of its modules around others, held through its re-computation
            own += [p for sub in m.modules() if sub is not m and next(sub.children(), None) is not None
                    for p in (*sub.parameters(recurse=False), *listed_parameters(sub))]
        return own
    return pinned_at_once(module, lambda m: {where[name_of[p]] for p in params(m)})


def listed_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters in `module`'s ParameterList and ParameterDict children."""
    return [p for child in module.children() if isinstance(child, (nn.ParameterList, nn.ParameterDict))
            for p in child.parameters()]


def trained_modules(module: nn.Module) -> set[nn.Module]:
    """The modules of those models among `module` (a ModelSet's, or itself) that train something."""
    models = list(module.children()) if isinstance(module, ModelSet) else [module]
    return {sub for model in models if any(p.requires_grad for p in model.parameters()) for sub in model.modules()}


def checkpointed(module: nn.Module, trained: bool | None = None) -> bool:
    """Whether `module` is a transformers layer that backward re-computes (activation checkpointing on, something to
    train: `trained`, whether its model trains anything, as transformers' checkpointing makes the inputs require
    gradients, so that a trained model's frozen layers are re-computed too (GPT-2 with its last block alone trained
    was refused nothing at prepare, and died re-computing a frozen one); None: whether it trains something itself).
    Transformers checkpoints its forward, so it and the modules whose methods it calls directly (Gemma3n's AltUp:
    predict, correct) run there without their hooks, and the parameters of every module around the one a
    re-computation starts in come to the device then and stay until it is done (hooks.py's Note on re-computation):
    those of its modules that call others are pinned beside every module of it (Gemma3n's AltUp owns its output
    scale and calls its router, and the layer's attention found no room beside it at the least budget prepare
    accepted, under the reentrant kind). Counted so for modules called through their hooks too, which hold nothing
    then: a budget a little above what the layer needs."""
    layers = sys.modules.get("transformers.modeling_layers")
    layer = getattr(layers, "GradientCheckpointingLayer", None)
    return layer is not None and isinstance(module, layer) and getattr(module, "gradient_checkpointing", False) and \
        (trained if trained is not None else any(p.requires_grad for p in module.parameters()))


def recomputed_whole(module: nn.Module, trained: bool | None = None) -> bool:
    """Whether `module` is a transformers layer checkpointed by torch's non-reentrant kind (transformers 5's default):
    what its re-computation saves views the chunks of all its parameters until its backward is done, so they are
    pinned together then (hooks.py's Note on re-computation), as a module's own are while it runs. Not the reentrant
    kind, whose re-computation streams them module by module, nor a layer with nothing to train (`checkpointed`: a
    frozen reference model's, which no backward re-computes)."""
    if not checkpointed(module, trained):
        return False
    checkpoint = getattr(module, "_gradient_checkpointing_func", None)
    return isinstance(checkpoint, functools.partial) and checkpoint.keywords.get("use_reentrant") is False


def working_set_chunks(module: nn.Module, chunk_size: int) -> int:
    """The most parameter chunks pinned at once under this chunk size (`pinned_at_once`)."""
    return len(pinned_chunks(module, chunk_size)[0])


def planned_model_data_bytes(module: nn.Module, chunk_size: int, families: Families, world: int = 1) -> int:
    """The bytes of chunks a ParamStore of `module` holds on each rank, computed before it allocates them (its
    `model_data_bytes()` afterwards)."""
    trainable, frozen = layouts(module, chunk_size, world)
    return (trainable.num_chunks * families.group_bytes(chunk_size)
            + frozen.num_chunks * families.group_bytes(chunk_size, trainable=False)) // world


K = TypeVar("K", bound=Hashable)


def pinned_at_once(module: nn.Module, keys: Callable[[nn.Module], set[K]]
                   ) -> tuple[frozenset[K], list[tuple[str, nn.Module]]]:
    """The largest set of keys (chunks, groups) pinned at once, and the modules that pin it, outermost
    first, by qualified name ("" for `module` itself).

    A module's chunks stay pinned from its pre-hook to its post-hook, and its children run in between:
    so what is pinned while a module runs is its own and that of every module it runs inside (a module
    that owns parameters and calls children, as ViT's embeddings or a LoRA adapter around its base do).
    """
    best: tuple[frozenset[K], list[tuple[str, nn.Module]]] = (frozenset(), [])

    def walk(sub: nn.Module, name: str, above: frozenset[K], chain: list[tuple[str, nn.Module]]) -> None:
        nonlocal best
        own = keys(sub)
        here = above | own
        if own - above:
            chain = chain + [(name, sub)]
        if len(here) > len(best[0]):
            best = (here, chain)
        for child_name, child in sub.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, here, chain)

    walk(module, "", frozenset(), [])
    return best


def most_pinned(module: nn.Module, keys: Callable[[nn.Module], set[K]]) -> int:
    """The most keys pinned at once: a module's own, and those of the modules it runs inside."""
    return len(pinned_at_once(module, keys)[0])


class ModelSet(nn.Module):
    """Several models laid out in one store (chunkmem.Manager): the set's parameter names are "<i>.<name>", and
    each record's names are those in its own model."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        for index, model in enumerate(models):
            self.add_module(str(index), model)


def _aliases(module: nn.Module) -> dict[nn.Parameter, tuple[str, ...]]:
    if isinstance(module, ModelSet):
        return {p: names for model in module.children() for p, names in _aliases(model).items()}
    names: dict[nn.Parameter, tuple[str, ...]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names[param] = names.get(param, ()) + (name,)
    return names
