"""The Adam floor of benchmarks/cpu_adam.py (benchmarks/adam_floor.cpp): the bytes it moves, on every path.

The floor must touch every element of every stream Adam touches (or it would undercut the kernel by
moving less) and compute nothing (so master, states and grad come back bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from chunkmem.memory import native

if native.load() is None:
    pytest.skip("no C++ build here: the floor is built like the native kernel", allow_module_level=True)

from benchmarks import adam_floor  # noqa: E402  (after the skip: importing it needs nothing, building does)

SIZES = [1, 7, 1023, 100003]  # 100003: several OpenMP blocks, and a tail for every vector width
SENTINEL = -1  # 0xFFFF: a NaN pattern that no half of the master values below can have


def _isa(isa: str) -> str:
    if isa not in native.supported_isas():
        pytest.skip(f"this CPU has no {isa} (it supports {native.supported_isas()})")
    return isa


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "auto"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.slow
def test_floor_reads_and_writes_every_element_unchanged(isa: str, n: int, grad_dtype: torch.dtype,
                                                         out_dtype: torch.dtype | None) -> None:
    gen = torch.Generator().manual_seed(n)
    # Small integers as floats: neither 16-bit half of their bits is ever 0xFFFF.
    master = torch.arange(1, n + 1, dtype=torch.float32)
    exp_avg, exp_avg_sq = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    before = [t.clone() for t in (master, grad, exp_avg, exp_avg_sq)]
    out = None if out_dtype is None else torch.full((n,), SENTINEL, dtype=torch.int16).view(out_dtype)
    adam_floor.adam_traffic(master, grad, exp_avg, exp_avg_sq, out, isa=isa if isa == "auto" else _isa(isa))
    for name, now, then in zip(["master", "grad", "exp_avg", "exp_avg_sq"], (master, grad, exp_avg, exp_avg_sq),
                               before):
        assert torch.equal(now, then), f"the floor changed {name}: it must move bytes, not compute"
    if out is not None:
        missed = (out.view(torch.int16) == SENTINEL).nonzero().flatten().tolist()
        assert not missed, f"param_out elements never written: {missed[:10]}"


def test_bytes_per_param_are_adams() -> None:
    # grad in; master, exp_avg, exp_avg_sq in and out; the low-precision copy out.
    assert adam_floor.bytes_per_param(torch.float32, None) == 4 + 24
    assert adam_floor.bytes_per_param(torch.bfloat16, torch.bfloat16) == 2 + 24 + 2
    assert adam_floor.bytes_per_param(torch.float32, torch.float16) == 4 + 24 + 2


def test_an_isa_the_cpu_lacks_is_an_error() -> None:
    with pytest.raises(ValueError, match="isa='sse9'"):
        adam_floor.adam_traffic(*(torch.zeros(4) for _ in range(4)), None, isa="sse9")
