"""The memory-traffic floor of one Adam step (benchmarks/adam_floor.cpp): its build and a typed wrapper.

Why: a step over a host chunk is bound by memory bandwidth, so the honest yardstick for chunkmem's kernel
is a sweep that moves Adam's exact bytes and computes nothing. It is built with the kernel's own flags
(`chunkmem.memory.native.CFLAGS`), so that the comparison is of the work, not of the compiler settings.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from chunkmem.memory import native

SOURCE = Path(__file__).resolve().with_name("adam_floor.cpp")


def bytes_per_param(grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> int:
    """What one Adam step must move per parameter: grad in, master and both states in and out, copy out."""
    out = 0 if out_dtype is None else torch.empty(0, dtype=out_dtype).element_size()
    return torch.empty(0, dtype=grad_dtype).element_size() + 3 * 4 * 2 + out


@functools.cache
def load() -> ModuleType:
    """The compiled floor (built on first call, about half a minute, cached beside the kernel's build)."""
    from torch.utils.cpp_extension import load as load_extension

    build_dir = native._build_directory("adam_floor")
    build_dir.mkdir(parents=True, exist_ok=True)
    return load_extension(name="chunkmem_adam_floor", sources=[str(SOURCE)], extra_cflags=native.CFLAGS,
                          extra_ldflags=native.LDFLAGS, build_directory=str(build_dir), verbose=False)


def adam_traffic(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 param_out: torch.Tensor | None, isa: str = "auto") -> None:
    """Read grad, master, exp_avg and exp_avg_sq, write the last three back unchanged and param_out.

    param_out receives bytes of the master chunk (the low half of the register that held them), not a
    rounded copy: the floor writes the copy without computing it. isa: 'auto' (the widest path chunkmem's kernel would pick) or
    one of `chunkmem.memory.native.supported_isas()`.
    """
    paths = native.supported_isas() or ["scalar"]
    chosen = paths[-1] if isa == "auto" else isa
    if chosen not in paths:
        raise ValueError(f"isa={isa!r}: this CPU runs {paths}")
    load().adam_traffic(master, grad, exp_avg, exp_avg_sq, param_out, chosen)
