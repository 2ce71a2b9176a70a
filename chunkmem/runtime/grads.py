"""`p.grad` as PyTorch shows it: after backward, every trainable parameter's gradient is a view into its gradient
chunk, so torch.nn.utils.clip_grad_norm_, gradient logging and `p.grad` hooks of a training loop work on a prepared
model as on the plain one.

[Note: gradients shown]
Backward writes each gradient into its chunk (runtime.grad_ready) and leaves `p.grad` None, since autograd
would otherwise add the next backward's gradient into it a second time (a resident backward leaves autograd's
`p.grad` where it is, and its end lends it to the chunk: Runtime.adopt_grads). When a backward ends, `show` points
each `p.grad` at its gradient, where it lives: the tensor lent to a chunk on the device, a view of the chunk's
device payload, or a view of its host payload once the downloads into it have landed (read fenced, like every
payload). A gradient and its parameter must be on one device: a group that streams has its gradient on the
host, so its parameters view their chunk's host payload until the next forward, as after a step. The device
copy stays (it is clean: the host payload holds the same values), and the next forward points the parameters
back at it (`restore`): under gradient accumulation, dropping it made every backward but the last cost an
upload of every streamed parameter chunk, which the plan does not foresee (benchmarks/placement.py
--accumulate 2: 1.30x the optimum's bytes). A parameter changed in place meanwhile (its `_version` moved:
`with torch.no_grad(): p.mul_(...)`) makes the device copy stale: it is dropped before anything reads the chunk
(a state_dict, a deep copy, the step: `drop_copies`), and the forward uploads the host payload. Changes made in
place through `p.grad` (clipping, scaling) are changes of the chunk. A `p.grad` the user replaces or sets to None
is taken at the next step (`take`), as torch.optim would read it, or when the gradients are hidden again: the next
forward (or zero_grad, or a backward reaching the model's outputs again: Runtime.backward_begins), after which the
next backward accumulates into the chunks, not into `p.grad`. Those on the device with their parameters stay shown
until that backward begins (`kept_through_forward`), so that a clear made meanwhile (`p.grad = None`) is seen, and
through a resident backward, which adds into them in place, as PyTorch's does (`hide_for_backward`); a
streamed group's `p.grad = None` there clears nothing (not yet: the README says to clear with zero_grad). A tensor
of the user's set as `p.grad` (a view of a flat gradient buffer, as apex and fairseq keep them; zeros_like) stays
`p.grad`, as in PyTorch (`users`): each show copies the chunk's gradient into it, a change made to it in place
(zeroing it, which is how such loops clear gradients) goes into the chunk when taken (and when a backward begins:
zeroed between the forward and the backward), model.clip_grad_norm_ takes them first and leaves the clipped values
in them, and one set before any backward, which autograd then adds into, is the whole gradient. Views of one flat
buffer share one version counter: versions are read before the copies into them and recorded after (`users_seen`).
Before, `p.grad` showed the chunk instead, and zeroing the buffer cleared nothing: a streamed model's gradients
added up from step to step. Where the parameter has moved between the host and the device since, its `p.grad` shows
the chunk, and the user's tensor is let go. So a forward with gradients enabled that no backward follows
before the step (a metric computed without torch.no_grad) leaves a streamed group's `p.grad` None until then, where
PyTorch still shows the gradients, and clipping through it clips nothing: step() warns (`hidden_by_forward`), as
after a backward that raised (its end, which shows them, never came). A `p.grad` the user assigns with no backward
(from torch.autograd.grad, say) is taken at the step as a gradient autograd left there would be
(Runtime.adopt_grads).
`zero_grad(set_to_none=False)` zeroes the gradients where they are and shows them, as PyTorch leaves zeros in
`p.grad`; those still zeros when hidden (nothing added into them) have their chunk freed, as set_to_none=True
frees it, where it reads as zeros: a parameter the next backward gives no gradient (a branch not taken, a layer
frozen since) shows them again, from a chunk made again beside its parameters (`_materialize`). Not a chunk on the
device whose zeros someone still holds once chunkmem's references are gone (weak references: a user's `p.grad` kept
across zero_grad, autograd's tensors lent to the chunk): PyTorch's next backward adds into those in place, and freed,
they read zeros for good. A payload's view shown again is the one shown before where something still holds it
(`_device_view`), so that those the user kept since the backward are the ones tracked. Not yet: a chunk the placer
evicts before that backward, or one assembled (chunk's Note on lent ranges: the step and clipping read lent tensors
where they are). A shown gradient whose chunk left the device (a step evicting it to update another group) is the
device memory it left, with its values: a change made to it in place goes into the chunk when gradients are taken
(`left_device`), as `p.grad.zero_()` after the step clears them. A shown
gradient set to None (by zero_grad(set_to_none=True) too) that the user still holds gets memory of its own, with its
values (`_keep_held`): in PyTorch the next backward makes new tensors and leaves it as it was, where here that
backward writes the chunk it viewed. A view of one kept (`p.grad.detach()`, a slice) is not that tensor: where
zero_grad(set_to_none=True) frees a gradient chunk whose host payload something else still views, the chunk takes
a fresh one (`keep_viewed`); so does one whose every `p.grad` was set to None by hand, freed when that is taken
(`free_cleared`). Past `p.grad = None` of only some of a chunk's parameters, such a view is still written (not yet).
Under a manager a model's forward hides its own gradients only: another model's stay shown, as PyTorch leaves them
(hidden, that model's clipping read None and clipped nothing), and so do its zeros left by zero_grad(set_to_none=False).
Not yet: the parameters of that model's streamed groups view their device copy again from that forward on, while
their `p.grad` still views the host payload.
Under ZeRO a rank holds only its share of each gradient: `p.grad` shows a `ShardedGrad` there, whose every use
raises, naming model.clip_grad_norm_ (which combines the shares) and zero_grad. With None there,
torch.nn.utils.clip_grad_norm_ would find no gradient and clip nothing, and a fast zero_grad (`p.grad = None`) would
clear nothing; set, it raises at the next forward or step.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Container
from typing import Any

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.residency import Residency
from chunkmem.chunks.state import ChunkState, TensorState
from chunkmem.chunks.store import ChunkGroup, ParamRecord, ParamStore
from chunkmem.errors import MemoryBudgetError


ZERO_GRADS = ("under ZeRO each rank holds a share of every gradient, so p.grad can be neither read nor set: clip "
              "with model.clip_grad_norm_(max_norm), clear with optimizer.zero_grad() or model.zero_grad()")


class ShardedGrad(torch.Tensor):
    """`p.grad` under ZeRO, from a backward until the gradients are hidden again (the Note): any use raises."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(ZERO_GRADS)


class ShownGrads:
    """The gradients a model shows in `p.grad` between a backward and the next forward (the Note)."""

    def __init__(self, store: ParamStore, residency: Residency) -> None:
        self.store = store
        self.residency = residency
        self.shown: dict[ParamRecord, torch.Tensor] = {}  # record -> the tensor its p.grad was set to
        self.versions: dict[ParamRecord, int] = {}  # record -> that tensor's version counter then (`edited`)
        self.addresses: dict[ParamRecord, int] = {}  # record -> that tensor's data_ptr then (`_taken`)
        # Parameter chunks on the device whose parameters view their host payload, with those parameters'
        # versions then (the Note).
        self.host_viewed: dict[ChunkGroup, list[int]] = {}
        # Gradient chunks zero_grad(set_to_none=False) zeroed, with the shown gradients and their versions then.
        self.zeroed: dict[ChunkGroup, list[tuple[torch.Tensor, int]]] = {}
        # Under ZeRO, each parameter's ShardedGrad, made once, with the device and dtype it was made for.
        self.sharded: dict[ParamRecord, tuple[torch.Tensor, torch.device, torch.dtype]] = {}
        # The gradients a backward showed that a forward with gradients enabled hid, no backward since: `p.grad` read
        # meanwhile (torch.nn.utils.clip_grad_norm_) saw None, where plain PyTorch shows them (their step() warns).
        self.hidden_by_forward: set[ParamRecord] = set()
        self.renewed = 0  # gradient chunks that left their host payload to the user's views (`keep_viewed`)
        # Tensors of the user's set as `p.grad` (a view of a flat gradient buffer), which stay `p.grad` (the Note).
        self.users: dict[ParamRecord, torch.Tensor] = {}
        self.device_views: dict[ParamRecord, weakref.ref] = {}  # each view of a device payload shown last (`show`)
        self.shown_on_device: dict[str, ChunkGroup] = {}  # gradient chunk name -> its group, shown on the device
        self.through_forward: set[ParamRecord] = set()  # shown through the forward running now (`kept_through_forward`)
        self.left: dict[ParamRecord, int] = {}  # shown gradients whose chunk left the device since: versions then

    def show(self, zeroed: Collection[ChunkGroup] | None = None) -> None:
        """Point every `p.grad` of a parameter with a gradient at it: at the end of a backward, or of a zero_grad
        that left zeros in those of the groups `zeroed` (the Note)."""
        self.through_forward = set()
        if zeroed is None:
            self.zeroed.clear()
            self.left.clear()
            self.shown_on_device.clear()
        edited = self._users_edited()
        for group in self.store.trainable_groups():
            held = [r for r in group.members if r.grad_state is TensorState.HOLD]
            chunk = group.grad
            if not held:
                continue
            if chunk.state is ChunkState.FREE:  # zeros since zero_grad(set_to_none=False) (`forget_zeros`): shown
                self._materialize(chunk, group.param)
            grads: list[torch.Tensor | None]
            if chunk.state.on_device:
                self.shown_on_device[chunk.name] = group
                lent = [chunk.lent_part(r.slot.offset) for r in held]
                flat = None if all(g is not None for g in lent) else chunk.device
                grads = lent if flat is None else [self._device_view(r, flat) for r in held]
            else:  # streamed: on the host, with its parameters (gradient chunks have no disk tier)
                # Zeros where nothing was written: a parameter that got no gradient since zero_grad(set_to_none=False)
                # (a branch not taken, a frozen layer) holds zeros, as in PyTorch, freed meanwhile (`forget_zeros`).
                host = chunk.host
                param = group.param
                self.store.note_writes(param)
                if param.state is ChunkState.DEVICE and not param.pins and param.tier is None:
                    self.store.point_views(param, at_host=True)
                    self.host_viewed.setdefault(group, group.versions())
                elif param.state.on_device and not param.pins:
                    # A disk tier's host buffer comes and goes (the tier's copy is read), and a device payload
                    # changed through the parameters is read back.
                    self.residency.evict(param)
                grads = [r.view(host) for r in held]
            for record, grad in zip(held, grads):
                if grad is not None and grad.device == record.param.device:
                    grad = self._into_users(record, grad, record in edited)
                    record.param.grad = grad
                    self.showing(record, grad)
            if zeroed is not None and group in zeroed:
                self.zeroed[group] = [(self.shown[r], self.shown[r]._version) for r in held if r in self.shown]
        self.users_seen()

    def left_device(self, chunk: Chunk) -> None:
        """`chunk` left the device: where it is a gradient chunk shown there, its `p.grad` is the device memory it left
        (a slot the arena keeps while viewed, with the values it had), and a change the user makes to it from now on
        (zeroing it in place after the step, as a loop without zero_grad does) goes into the chunk when gradients are
        taken (`_taken`): before, the next backward added into the old gradients (fp16 whose step evicted the gradient
        chunk of a homed group, to update another)."""
        group = self.shown_on_device.pop(chunk.name, None)
        if group is not None:
            for record in group.members:
                shown = self.shown.get(record)
                if shown is not None and record in self.through_forward:  # its slot would stay through the forward
                    record.param.grad = None
                    del self.shown[record]
                elif shown is not None and record not in self.users:
                    self.left[record] = shown._version

    def _device_view(self, record: ParamRecord, flat: torch.Tensor) -> torch.Tensor:
        """`record`'s view of device payload `flat`: the one shown before, where something still holds it (a user's
        `p.grad` kept across zero_grad(set_to_none=False), which `forget_zeros` must see held), else a new one."""
        view = record.view(flat)
        ref = self.device_views.get(record)
        before = ref() if ref is not None else None
        if before is not None and before.data_ptr() == view.data_ptr() and before.dtype == view.dtype:
            return before
        self.device_views[record] = weakref.ref(view)
        return view

    def _into_users(self, record: ParamRecord, grad: torch.Tensor, edited: bool) -> torch.Tensor:
        """What `p.grad` shows of gradient `grad`, chunk memory: the tensor of the user's that is `p.grad` (its
        values made `grad`'s), where that is on the parameter's device; else `grad` itself, the user's let go. One
        `edited` in place while it was `p.grad` through a backward that wrote no gradient of it (a penalty on some
        parameters alone; one that wrote it added into that tensor itself) is the gradient: into the chunk instead."""
        own = self.users.get(record)
        if own is None:
            return grad
        if own.device != grad.device or own.dtype != grad.dtype or own.shape != grad.shape:
            del self.users[record]  # the parameter moved between the host and the device since (streamed)
            return grad
        if own.data_ptr() == grad.data_ptr():  # the chunk's range itself (lent to the chunk)
            return own
        if edited:
            grad.copy_(own)
        else:
            own.copy_(grad)
        return own

    def refresh_users(self, records: Container[ParamRecord] | None = None) -> None:
        """The chunks' gradients (of `records`; None: all) were changed where they are (model.clip_grad_norm_): the
        users' tensors shown take them again."""
        for record, own in self.users.items():
            if self.shown.get(record) is own and (records is None or record in records):
                own.copy_(self._range(record))
        self.users_seen()

    def _users_edited(self) -> set[ParamRecord]:
        """The users' tensors changed in place since last shown or taken, read before any copy into one of them moves
        the version counter views of one flat buffer share."""
        return {r for r, own in self.users.items() if own._version != self.versions.get(r)}

    def users_seen(self) -> None:
        """The users' tensors shown hold what their chunks hold: their versions from now (after all copies into them,
        as views of one buffer share one counter)."""
        for record, own in self.users.items():
            if self.shown.get(record) is own:
                self.versions[record] = own._version

    def take_users(self) -> None:
        """A backward reaching the model's outputs begins: a tensor of the user's changed in place while hidden
        (zeroed between the forward and the backward, as a loop calling zero_grad there does) goes into the chunk
        that backward adds into, as PyTorch's backward adds into that tensor."""
        for record in self._users_edited():
            if record not in self.shown and record.grad_state is TensorState.HOLD:
                own = self.users[record]
                self._range(record).copy_(own)
                self.versions[record] = own._version

    def range_now(self, record: ParamRecord) -> torch.Tensor:
        """`record`'s gradient in its chunk, to read now: where the chunk is on the host, once its downloads landed."""
        chunk = record.group.grad
        return self._range(record) if chunk.state.on_device else record.view(self.residency.to_host(chunk))

    def _range(self, record: ParamRecord) -> torch.Tensor:
        """`record`'s range of its gradient chunk, where it is: the tensor lent for it, or a view of the payload."""
        chunk = record.group.grad
        if not chunk.state.on_device:
            return record.view(chunk.host)
        lent = chunk.lent_part(record.slot.offset)
        return lent if lent is not None else record.view(chunk.device)  # type: ignore[arg-type]

    def _materialize(self, chunk: Chunk, param: Chunk) -> None:
        """A FREE gradient chunk in memory beside its parameter chunk: on the device if that is there (and stays, in
        use: the parameter chunk of a group that got no gradient is the least recently used), else on the host."""
        if param.state.on_device:
            param.pins += 1
            try:
                self.residency.bring(chunk)
                return
            except MemoryBudgetError:  # no room left beside the chunks in use: on the host
                pass
            finally:
                param.pins -= 1
        self.residency.claim_host(chunk)

    def showing(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """`record.param.grad` is `grad` from now on, chunk memory (or a tensor lent to the chunk)."""
        self.shown[record] = grad
        self.versions[record] = grad._version
        self.addresses[record] = grad.data_ptr()

    def edited(self) -> bool:
        """Whether a shown gradient was changed in place since it was shown."""
        return any(grad._version != self.versions.get(record) for record, grad in self.shown.items())

    def show_sharded(self) -> None:
        """Under ZeRO, at the end of a backward: every parameter with a gradient shows a ShardedGrad (the Note)."""
        for record in self.store.records.values():
            if record.grad_state is not TensorState.HOLD:
                continue
            param, made = record.param, self.sharded.get(record)
            if made is None or made[1:] != (param.device, param.dtype):  # (reading the guard's own would raise)
                base = torch.empty((), dtype=param.dtype, device=param.device).expand(record.shape)
                made = self.sharded[record] = torch.Tensor._make_subclass(ShardedGrad, base), param.device, param.dtype
            param.grad = self.shown[record] = made[0]

    def restore(self) -> None:
        """Parameters that view their host payload beside a clean device copy view the device copy again, or, if
        changed in place since, the device copy is dropped (the Note)."""
        self.drop_copies(changed_only=True)
        for group in self.host_viewed:
            if group.param.state.on_device:  # else it left meanwhile (the step's host update claimed it): views follow
                self.store.point_views(group.param)
        self.host_viewed.clear()

    def drop_copies(self, changed_only: bool = False) -> None:
        """Parameters viewing their host payload beside a device copy (clean, or stale beside a change made in place)
        have it dropped, copying nothing: before a write into their chunk (a load), which then writes the payload they
        view (it made the copy newer than what they showed until the next forward, and a change made meanwhile was
        lost). `changed_only`: those changed in place since (`with torch.no_grad(): p.sub_(lr * p.grad)` after
        backward), before what reads the chunk (state_dict, a deep copy, a checkpoint, a step) reads the change, as the
        next forward would (the Note)."""
        for group, versions in list(self.host_viewed.items()):
            if group.param.state.on_device and (not changed_only or versions != group.versions()):
                self.residency.evict(group.param)
                del self.host_viewed[group]

    def forward_over(self) -> None:
        """The window of a forward no backward followed ends (a step): gradients shown through it stay shown as after
        any backward (`left_device`)."""
        self.through_forward = set()

    def hide(self, records: Container[ParamRecord] | None = None, edits: bool = True, dropped: bool = False) -> None:
        """`p.grad` None again, for all shown gradients (`records` None) or those in `records`, what the user put
        there taken first (a fast zero_grad that sets each `p.grad` to None, a gradient replaced between backwards),
        unless `edits` is False: autograd added into the shown one (Runtime._take_grad). `dropped`: the gradients
        are gone (zero_grad(set_to_none=True)), and one the user still holds keeps its values (`_keep_held`)."""
        if edits:
            self.take(records)
        zeros = self._zeros_left(records)
        self.restore()
        _keep_held(self._unshown(records, dropped))
        self.forget_zeros(zeros)

    def _unshown(self, records: Container[ParamRecord] | None, dropped: bool) -> list[torch.Tensor]:
        """`hide`'s own: `p.grad` None for the shown gradients of `records` (None: all); gives those of them that were
        chunk memory, if `dropped` (for `_keep_held`, which must find no reference of ours to them: this frame's die
        with it)."""
        gone = []
        for record in [r for r in self.shown if records is None or r in records]:
            record.param.grad = None
            shown = self.shown.pop(record)
            self.left.pop(record, None)
            if dropped and self._chunk_memory(record, shown):
                gone.append(shown)
        if dropped:  # the user's tensors of every record cleared, shown or not (set before any backward)
            for record in [r for r in self.users if records is None or r in records]:
                if record.param.grad is self.users.pop(record):
                    record.param.grad = None
        return gone

    def keep_viewed(self, chunk: Chunk) -> None:
        """`chunk`, a gradient chunk zero_grad(set_to_none=True) just freed: where a tensor of the user's still views
        its host payload (`p.grad.detach()` or a slice of `p.grad` kept past zero_grad, which `_keep_held` cannot find:
        not the shown tensor itself), the chunk takes a fresh payload and leaves the old to it, as PyTorch's next
        backward makes new gradients and leaves those as they were. A device payload needs nothing: the arena
        reuses no slot something else views."""
        if chunk.viewed_elsewhere():
            chunk.renew_host()
            self.renewed += 1

    def unseen(self, params: Container[torch.nn.Parameter] | None = None) -> bool:
        """Whether a gradient in its chunk (of one of `params`; None: any) shows nowhere: `p.grad` None, not set so by
        the user."""
        return any(r.grad_state is TensorState.HOLD and r.param.grad is None and r not in self.shown and
                   (params is None or r.param in params) for r in self.store.records.values())

    def hide_for_forward(self, records: Container[ParamRecord] | None = None, strays: bool = False) -> None:
        """A forward with gradients enabled begins: the gradients shown (of `records`, its model's parameters; None:
        all) are hidden, so that its backward adds into their chunks (the Note), but those `kept_through_forward`.
        Unless `strays` (autograd's own may wait in `p.grad`: Runtime.adopt_grads), a tensor in `p.grad` now that
        chunkmem does not show is the user's."""
        kept = self.through_forward = self.kept_through_forward(records)
        if kept:
            records = {r for r in self.store.records.values() if (records is None or r in records) and r not in kept}
        self.hidden_by_forward.update(r for r in self.shown if records is None or r in records)
        self.hide(records)
        if strays:
            return
        for record in self.store.records.values():  # set by the user, never shown: autograd adds into it (the Note)
            grad = record.param.grad
            if grad is not None and (records is None or record in records):
                self.users[record] = grad

    def hide_for_backward(self, resident: bool) -> None:
        """A backward reaching the model's outputs begins (Runtime.backward_begins): the gradients shown are hidden, so
        that it adds into their chunks (the Note). Not, in a `resident` backward, which moves nothing, those shown on
        the device with their parameters (`kept_through_forward`: any model's, and after a backward too, a retained
        graph's second): autograd adds into them in place, as into plain PyTorch's `p.grad`, and in its order. A
        parameter that reentrant checkpointing's inner backwards gave several gradients (DeBERTa's relative
        embeddings, a layer shared by the checkpointed blocks) had them summed apart, then added into the chunk once,
        1e-14 off plain PyTorch's under accumulation, and further at each step (helper-84)."""
        kept: set[ParamRecord] = set()
        if resident:
            self.through_forward = self.kept_through_forward(None)
            self.take(self.through_forward)  # what was done to them since the forward first (`p.grad = None`)
            kept = {r for r in self.through_forward if r in self.shown and r not in self.users}
        self.hide({r for r in self.store.records.values() if r not in kept} if kept else None)

    def kept_through_forward(self, records: Container[ParamRecord] | None) -> set[ParamRecord]:
        """The shown gradients (of `records`; None: all) that stay shown until the backward begins (Runtime.
        backward_begins hides them), as in PyTorch: views of a device payload, their parameters' device, so that a
        clear made meanwhile (`p.grad = None`, a submodule's or another optimizer's zero_grad) is seen. Not zeros
        zero_grad(set_to_none=False) left, whose chunk the forward frees, nor the user's tensors (the Note); those
        whose chunk leaves the device before the backward are hidden then (`left_device`)."""
        kept: set[ParamRecord] = set()
        for group in self.shown_on_device.values():
            if group in self.zeroed or not group.grad.state.on_device:
                continue
            for record in group.members:
                shown = self.shown.get(record)
                if shown is not None and record not in self.users and (records is None or record in records) and \
                        shown.device == record.param.device:
                    kept.add(record)
        return kept

    def _zeros_left(self, records: Container[ParamRecord] | None) -> list[tuple[ChunkGroup, list[weakref.ref]]]:
        """Gradient chunks still holding only the zeros zero_grad(set_to_none=False) left, of groups whose every member
        is in `records` (None: all), no longer tracked: each with weak references to the zeros it showed."""
        left = []
        for group, shown in list(self.zeroed.items()):
            if records is not None and not all(r in records for r in group.members):
                continue
            del self.zeroed[group]
            if all(grad._version == version for grad, version in shown):
                left.append((group, [weakref.ref(grad) for grad, _ in shown]))
        return left

    def forget_zeros(self, zeros: list[tuple[ChunkGroup, list[weakref.ref]]]) -> None:
        """`_zeros_left`'s chunks are freed, as set_to_none=True frees them: the next backward writes them afresh (the
        Note). Not one on the device whose zeros are still held once chunkmem's own references are gone (a user's
        `p.grad` kept across zero_grad, autograd's tensors lent to it): PyTorch's next backward adds into those."""
        for group, refs in zeros:
            if not group.grad.state.on_device or all(ref() is None for ref in refs):
                self.residency.reset(group.grad)

    def take(self, records: Container[ParamRecord] | None = None) -> None:
        """Before a step, or before the gradients are hidden: a `p.grad` the user replaced since it was shown (of
        `records`, None: all) is copied into its chunk's range, and one set to None is the parameter's gradient no
        longer (the step leaves it, the next backward writes it afresh), as torch would see them."""
        cleared: set[ChunkGroup] = set()
        _keep_held(self._taken(records, cleared))
        for group in cleared:
            self.free_cleared(group)

    def _taken(self, records: Container[ParamRecord] | None, cleared: set[ChunkGroup]) -> list[torch.Tensor]:
        """`take`'s own; gives the shown gradients set to None that were chunk memory (for `_keep_held`, as
        `_unshown`), and adds their groups to `cleared`."""
        gone = []
        addresses, left = self.addresses, self.left
        for record, shown in list(self.shown.items()):
            if records is not None and record not in records:
                continue
            grad = record.param.grad
            if grad is shown:
                address = addresses.get(record)  # none for a ShardedGrad, which has no address
                if record in self.users:
                    if grad._version != self.versions[record] or grad.data_ptr() != address:  # changed: into the chunk
                        self._range(record).copy_(grad)
                        self.showing(record, grad)
                elif address is not None and grad.data_ptr() != address:
                    self._moved(record, grad)
                elif left and record in left and grad._version != left[record]:  # its chunk left: `left_device`
                    self._range(record).copy_(grad)
                    left[record] = grad._version
                continue
            if type(shown) is ShardedGrad:
                raise RuntimeError(ZERO_GRADS)
            if grad is None:
                record.move_grad("free")
                if self._chunk_memory(record, self.shown.pop(record)):
                    gone.append(shown)
                self.users.pop(record, None)
                cleared.add(record.group)
            else:  # a tensor of the user's: into the chunk, and p.grad stays that tensor (the Note)
                self._range(record).copy_(grad)
                self.users[record] = grad
                self.showing(record, grad)
        return gone

    def free_cleared(self, group: ChunkGroup) -> None:
        """A gradient chunk none of whose members holds a gradient any more (each `p.grad` set to None by hand) is
        freed, as zero_grad(set_to_none=True) frees it, and leaves its host payload to a view of it the user kept
        (`keep_viewed`): the next backward wrote the payload that view still showed."""
        chunk = group.grad
        if chunk.state is not ChunkState.FREE and group not in self.zeroed and \
                all(r.grad_state is not TensorState.HOLD for r in group.members):
            self.residency.reset(chunk)
            self.keep_viewed(chunk)

    def _moved(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """The shown `p.grad` was given other storage (`p.grad.data = t`, older code's clipping): its values go into
        the chunk's range, which it shows again, as a `p.grad` replaced whole does. A tensor lent to the chunk is the
        chunk's range itself, wherever its storage is."""
        chunk = record.group.grad
        if chunk.state.on_device and chunk.lent_part(record.slot.offset) is grad:
            self.addresses[record] = grad.data_ptr()
            return
        target = record.view(chunk.device if chunk.state.on_device else chunk.host)  # type: ignore[arg-type]
        target.copy_(grad)
        grad.data = target
        self.addresses[record] = grad.data_ptr()

    def _chunk_memory(self, record: ParamRecord, shown: torch.Tensor) -> bool:
        """Whether gradient `shown` is memory of its chunk that a later backward writes: not a ShardedGrad (no values),
        not a tensor lent to the chunk (autograd's own, which the chunk lets go), not a tensor of the user's."""
        return type(shown) is not ShardedGrad and shown is not record.group.grad.lent_part(record.slot.offset) and \
            shown is not self.users.get(record)

    def accumulated(self, record: ParamRecord, grad: torch.Tensor) -> bool:
        """Whether `grad`, a gradient autograd just produced, is the shown one it added into in place (a second
        backward before any forward): then the chunk holds the sum already."""
        return self.shown.get(record) is grad and record not in self.users




def _keep_held(gradients: list[torch.Tensor]) -> None:
    """Shown gradients set to None (zero_grad(set_to_none=True), `p.grad = None`) that the user still holds (a list
    kept for gradient surgery or for logging) get memory of their own, with their values: in PyTorch the next backward
    makes new tensors and leaves those as they were, where here it writes the chunk they view. Found by weak
    references once chunkmem's own are gone: those the user dropped cost nothing. Empties `gradients`."""
    refs = [weakref.ref(g) for g in gradients]
    gradients.clear()
    for ref in refs:
        held = ref()
        if held is not None:
            held.data = held.clone()
