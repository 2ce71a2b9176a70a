"""Which modules bring parameters to the device when they start (runtime's Note on how parameters reach the device).

[Note: access units]
Every module's pre- and post-forward hook acquiring its own parameters cost a streaming step of the launch-bound
20-layer LLaMA (benchmarks/overhead.py) about 37 us of host time per module call, 266 calls a forward: a fifth of
the host time a streaming step added, and all of it what a GPU waits for when kernels are short. Yet most modules
lie, with their siblings, inside one parameter chunk: a decoder layer, an attention block. So the outermost module
whose parameters all lie in one chunk, and that is called (not a ModuleList), is a unit: its pre-forward acquires
every parameter of its subtree and its post-forward releases them, and the hooks of the modules inside it return at
once. Any other module acquires its own parameters (none, for a module without any: it still has its moments), and
its children are looked at in turn. A unit pins the chunk the modules inside it would have pinned one after the
other, from the unit's start to its end rather than between its modules, where the plan keeps it anyway (it is used
next). The modules inside a unit keep their moments (without an access) where moments decide something: in the
warm-up and in a step that gave way, where chunks give way to activations at every moment (placement's Notes), and
when an observer wants them (a trace). A steady step's moments only read memory, which the next access reads again:
there the hooks inside a unit cost two Python calls that return at once.

A unit holds its chunk through the activations of its modules, and no moment inside it can make the chunk give way
to them: where the plan has room for that chunk beside the step's peak, that is no loss, but where a chunk is large
against the budget (BERT and RoBERTa in fp32 at a twentieth of their model data, in chunks of three times their
largest parameter: a chunk 29% of the budget), a later step whose batch held more activations than the plan's record
found no room beside the held chunk, and was refused in its fifth or sixth step. So units are made only where a chunk
is at most UNIT_CHUNK_SHARE of the device budget: the margin the plan keeps for what it cannot foresee (planning's
SAFETY_FRACTION). Elsewhere every module acquires its own parameters, as before units.

A layer that lies across a chunk boundary (a third of a 1.16B LLaMA's layers in 250 MiB chunks) was no unit: each of
its modules acquired its own, 7 calls of ours where a layer in one chunk has one. Where two chunks together are at most
that share of the budget, a module whose parameters lie in two chunks is a unit too (`span`). It holds both chunks
from its start to its end; its modules one by one would have let the first go after its last module in that chunk,
and brought the second only for its first module in it: at most one chunk more, through part of the layer, within the
margin. The launch-bound 20-layer LLaMA streaming at half its model data, in chunks of its largest parameter: 1.7 ms
less host time a step (benchmarks/overhead_parts.py's "units of one chunk" row, 9a8d5ec).

A module inside a unit that runs outside a forward (called on its own, recomputed in backward under activation
checkpointing) acquires the parameters of its subtree, as a unit would. One that runs inside another module's forward
(shared with a module elsewhere) acquires nothing: the torch-function mode fetches its parameters op by op (FetchMode),
as it does any parameter used outside its module, and forwards stop running lean. Under ZeRO every module acquires its
own parameters (its gather units are zero/units.py's).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from torch import nn

from chunkmem.chunks.planning import SAFETY_FRACTION

UNIT_CHUNK_SHARE = SAFETY_FRACTION  # units only where their chunks are at most this share of the budget (the Note)


def access_units(module: nn.Module, chunk_of: Callable[[nn.Parameter], str], span: int = 1
                 ) -> tuple[dict[nn.Module, list[nn.Parameter]], set[nn.Module]]:
    """The parameters each module of `module` acquires when it starts (`chunk_of` names a parameter's chunk), and the
    modules that acquire nothing in a forward: those inside a unit, a module whose parameters lie in at most `span`
    chunks (see the Note). One of those run outside a forward acquires its subtree's parameters, as a unit would."""
    acquires: dict[nn.Module, list[nn.Parameter]] = {}
    idle: set[nn.Module] = set()
    places = collections.Counter(m for _, m in module.named_modules(remove_duplicate=False))

    def walk(sub: nn.Module) -> None:
        if sub in acquires or sub in idle:  # a module reached again through another parent
            return
        chunks = len({chunk_of(p) for p in sub.parameters()})
        # Not over two chunks around a module called elsewhere too: idle in it, it acquires nothing there, and the
        # torch-function mode's fetch there ends lean forwards (a block Zamba2 shares between layers: helper-72)
        shared = chunks > 1 and any(places[m] > 1 for m in sub.modules() if m is not sub)
        if 0 < chunks <= span and not shared and type(sub).forward is not nn.Module.forward:
            idle.update(m for m in sub.modules() if m is not sub and m not in acquires)  # not one met elsewhere
            acquires.update({m: list(m.parameters()) for m in sub.modules() if m not in acquires})
            return
        acquires[sub] = list(sub.parameters(recurse=False))
        for child in sub.children():
            walk(child)

    walk(module)
    return acquires, idle
