"""The facts of this machine that decide what fits and how fast chunks move (`chunkmem env`)."""

from __future__ import annotations

import platform
import resource
import sys
import time
from typing import Any

import psutil
import torch


def memlock_limit() -> str:
    """RLIMIT_MEMLOCK (soft/hard): CUDA pinned memory is page-locked, and some container limits bite."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    show = lambda v: "unlimited" if v == resource.RLIM_INFINITY else f"{v / 2**20:.1f} MiB"  # noqa: E731
    return f"{show(soft)} (hard {show(hard)})"


def pinned_bandwidth(mib: int) -> str:
    """Host-to-device and device-to-host GB/s of one pinned copy of `mib` MiB (after one warm-up copy)."""
    if not torch.cuda.is_available():
        return "skipped: no CUDA device (the CPU simulation copies within host memory)"
    host = torch.empty(mib * 2**20, dtype=torch.uint8, device="cpu", pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    rates = []
    for src, dst in ((host, device), (device, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(host.nbytes / (time.perf_counter() - start) / 1e9)
    return f"h2d {rates[0]:.1f} GB/s, d2h {rates[1]:.1f} GB/s ({mib} MiB pinned)"


def describe(probe_mib: int = 256) -> dict[str, Any]:
    from chunkmem.version import __version__

    info: dict[str, Any] = {"chunkmem": __version__, "python": sys.version.split()[0],
                            "platform": platform.platform(), "torch": torch.__version__,
                            "cuda (torch built)": torch.version.cuda or "none"}
    for name in ("transformers", "safetensors", "matplotlib"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "not installed"
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            info[f"cuda:{index}"] = f"{props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)"
    else:
        info["devices"] = "no CUDA device: chunkmem runs the CPU simulation (Config(device='cpu'))"
    memory = psutil.virtual_memory()
    info["host RAM"] = f"{memory.total / 2**30:.1f} GiB ({memory.available / 2**30:.1f} GiB available)"
    info["CPU cores"] = psutil.cpu_count(logical=True)
    info["locked-memory limit"] = memlock_limit()
    info["pinned copy bandwidth"] = pinned_bandwidth(probe_mib)
    return info
