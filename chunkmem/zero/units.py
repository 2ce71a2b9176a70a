"""Modules ZeRO gathers whole: those inside which which modules run depends on the data.

[Note: units]
Under ZeRO every rank must issue the same collectives in the same order (shards.py's Note on one
order), and a collective is issued when a module that needs an ungathered group runs. A mixture of
experts calls only the experts its router picked for this rank's tokens, so ranks would gather
different groups and hang, or pair up the wrong groups and mix their data. So the module that chooses
among its children is a unit: its pre-forward gathers the groups of its whole subtree (sorted by key,
the same on every rank) and the modules inside it gather nothing; in backward the first saved tensor
of the unit that is unpacked gathers them all again and holds them until backward leaves the unit (its
next gather outside it), and the unit's gradient groups are reduce-scattered then, every group of the
unit on every rank, zeros where a rank's experts got no tokens. That costs the unit's whole parameters
and gradients at once on the device, as FSDP's wrapping of a mixture-of-experts block does.
Found by structure: a container (ModuleList/ModuleDict) of at least two parameterised modules of one
class, inside another container (the stack of layers): the experts of a layer. The unit is the
container itself when it has a forward of its own, else the module that holds it. `Config.gather_units`
names more classes (DeepSpeed calls these leaf modules).
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _experts(module: nn.Module) -> bool:
    children = list(module.children())
    return isinstance(module, CONTAINERS) and len(children) >= 2 and len({type(c) for c in children}) == 1 \
        and all(any(True for _ in c.parameters()) for c in children)


def _own_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def gather_units(module: nn.Module, classes: Collection[str] = ()) -> list[nn.Module]:
    """The units of `module`, outermost only (see the Note)."""
    found: list[nn.Module] = []

    def walk(sub: nn.Module, parent: nn.Module | None, in_stack: bool) -> None:
        if type(sub).__name__ in classes:
            found.append(sub)
            return
        if in_stack and _experts(sub):
            found.append(sub if _own_forward(sub) or parent is None else parent)
            return
        for child in sub.children():
            walk(child, sub, in_stack or isinstance(sub, CONTAINERS))

    walk(module, None, False)
    units = list(dict.fromkeys(found))  # a holder of two expert containers is one unit
    inside = {id(m) for unit in units for m in unit.modules() if m is not unit}
    return [unit for unit in units if id(unit) not in inside]
