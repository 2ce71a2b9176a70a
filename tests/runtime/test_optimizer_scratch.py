"""What torch.optim allocates on the device for a run of parameters updated together (rules.run_scratch)."""

from __future__ import annotations

import torch

from chunkmem.runtime.rules import run_scratch

MiB = 2**20


def segment_for(nbytes: int) -> int:  # CUDA's pools: requests up to 1 MiB from 2 MiB segments, larger from 20 MiB
    return 2 * MiB if nbytes <= MiB else 20 * MiB


def test_a_run_reserves_what_its_kernels_allocate_none_fused_each_with_foreach_two_of_each_pool_else() -> None:
    params = [torch.empty(n) for n in (1000, 60_000, 300_000, 500_000)]  # 4 KB, 240 KB, 1.2 MB, 2 MB
    sizes = [p.numel() * 4 for p in params]
    assert run_scratch({"fused": True, "foreach": None}, params, segment_for) == []
    assert run_scratch({"fused": None, "foreach": True}, params, segment_for) == sizes
    single = run_scratch({"fused": None, "foreach": False}, params, segment_for)
    assert sorted(single) == [240_000, 240_000, 2_000_000, 2_000_000], "the largest small and large temporaries, twice"
    # Neither flag set: torch's own default for where the parameters are (single-tensor for host tensors).
    assert run_scratch({"fused": None, "foreach": None}, params, segment_for) == single
