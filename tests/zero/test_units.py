"""Which modules ZeRO gathers whole: the experts of a mixture of experts, and classes the Config names."""

from __future__ import annotations

from torch import nn

from chunkmem.zero.units import gather_units
from tests import zoo


class Routed(nn.Module):
    """Experts in a ModuleList (no forward of its own): the module holding them is the unit."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


def test_the_experts_of_each_layer_are_found_and_nothing_else():
    switch = next(a for a in zoo.DATA_DEPENDENT if a.name == "switch").build()
    units = gather_units(switch)
    assert units and {type(u).__name__ for u in units} == {"SwitchTransformersExperts"}
    assert len(units) == 4, "one per sparse layer: 2 encoder and 2 decoder blocks"
    for name in ("gpt2", "llama", "t5", "bart", "mixtral", "vit"):  # stacked experts (Mixtral) need no unit
        assert gather_units(zoo.by_name(name).build()) == [], name


def test_experts_without_a_forward_make_their_holder_the_unit():
    stack = nn.ModuleList(Routed() for _ in range(2))
    assert gather_units(stack) == list(stack)
    alone = Routed()
    assert gather_units(alone) == [], "a container of experts outside any stack of layers is the stack itself"


def test_named_classes_are_units_and_units_do_not_nest():
    stack = nn.ModuleList(Routed() for _ in range(2))
    assert gather_units(stack, ("ModuleList",)) == [stack], "the outermost only"
    model = nn.Sequential(nn.Linear(2, 2), Routed())
    assert gather_units(model, ("Routed",)) == [model[1]]
