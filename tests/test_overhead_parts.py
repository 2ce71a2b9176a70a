"""benchmarks/overhead_parts.py: each variant's steps run without exactly the mechanisms it names.

The benchmark takes mechanisms out by patching chunkmem where it calls them; a patch that stopped applying
(a renamed function, a hook installed another way) would leave a variant timing the full step and its
"saves" column reading zero. Here each mechanism is watched at its entry point while a variant steps.
"""

from __future__ import annotations

import random
from typing import Any
from unittest import mock

import pytest
import torch

from benchmarks import overhead_parts
from benchmarks.overhead import loss_fn, mlp
from chunkmem.chunks.chunk import Chunk
from chunkmem.runtime import hooks
from chunkmem.runtime.runtime import Runtime

MECHANISMS = {"mode": (hooks.FetchMode, "__torch_function__"), "saved": (Runtime, "pack"),
              "module": (Runtime, "enter"), "hooks": (hooks.Hooks, "_pre_forward"), "grad": (Runtime, "grad_ready")}
VARIANTS = {
    "full": {"mode", "saved", "module", "hooks", "grad"},
    "no mode": {"saved", "module", "hooks", "grad"},
    "no saved hooks": {"mode", "module", "hooks", "grad"},
    "no per-op Python": {"hooks", "grad"},  # the module hooks' calls are left, their work taken out
    "resident": {"saved"},
    "resident, module hooks kept": {"saved", "hooks"},
    "resident, gradient hooks kept": {"saved", "grad"},
}


@pytest.mark.parametrize("variant, used", VARIANTS.items())
def test_a_variant_steps_without_the_mechanisms_it_names(variant: str, used: set[str]) -> None:
    assert set(overhead_parts.VARIANTS) == set(VARIANTS)
    seen: set[str] = set()

    def watched(name: str, owner: type, attribute: str) -> Any:
        original = getattr(owner, attribute)

        def call(*args: object, **kwargs: object) -> object:
            seen.add(name)
            return original(*args, **kwargs)
        return mock.patch.object(owner, attribute, call)

    with overhead_parts._without(tuple(watched(name, *where) for name, where in MECHANISMS.items())):
        loss = loss_fn("mlp", torch.randn(4, 8), torch.float32)
        step = overhead_parts._variant_step(lambda: mlp(2, 8), loss, "fp32", overhead_parts.VARIANTS[variant],
                                            variant.startswith(overhead_parts.RESIDENT))
        seen.clear()
        step()
    assert seen == used



def test_streaming_rows_run_lean_one_without_the_saved_tensor_hooks_one_with_units_of_one_chunk(monkeypatch) -> None:
    # --share: every variant streams and runs lean after the first step on the plan; the second packs nothing, and the
    # third makes units of one chunk at most.
    monkeypatch.setattr("chunkmem.runtime.runtime.UNIT_CHUNK_SHARE", 1.0)  # units over two chunks at this budget too
    loss = loss_fn("mlp", torch.randn(4, 64), torch.float32)
    seen: dict[str, list[Any]] = {"lean": [], "packed": [], "uploads": [], "span": []}
    begin, pack, upload, units = Runtime.begin_forward, Runtime.pack, Chunk.upload, overhead_parts.units.access_units

    def recorded(*args: Any) -> Any:  # the units the runtime asks for: two chunks at most, or one (the patch)
        seen["span"].append(args[2] if len(args) > 2 else 1)
        return units(*args)
    with mock.patch.multiple(Runtime, begin_forward=lambda *a: seen["lean"].append(begin(*a)) or seen["lean"][-1],
                             pack=lambda *a, **k: seen["packed"].append(1) or pack(*a, **k)), \
            mock.patch.object(Chunk, "upload", lambda *a: seen["uploads"].append(1) or upload(*a)), \
            mock.patch.object(overhead_parts.units, "access_units", recorded), \
            mock.patch.object(overhead_parts.runtime_module, "access_units", recorded):
        extra = overhead_parts.measure(lambda: mlp(8, 64), loss, "fp32", rounds=2, order=random.Random(0), share=0.25)
        assert set(extra) == {"plain", *overhead_parts.STREAMING} and len(extra["lean, no saved hooks"]) == 2
        assert len(overhead_parts.STREAMING) == 3
        for variant, patches in overhead_parts.STREAMING.items():
            seen["span"].clear()
            step = overhead_parts._variant_step(lambda: mlp(8, 64), loss, "fp32", patches, True, memory=2 * 8 * 64 * 65)
            assert seen["span"] == [1 if variant == "lean, units of one chunk" else 2], "two chunks a small share"
            for values in seen.values():
                values.clear()
            step()
            assert seen["lean"] == [True] and seen["uploads"], "a lean forward, chunks moving"
            assert bool(seen["packed"]) == (variant != "lean, no saved hooks")
