"""The process group chunkmem creates: its backend follows the configured device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from chunkmem.zero import collectives


class Created(Exception):
    """Raised by the fake init_process_group: the backend it was asked for is all the test needs."""


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:1", "nccl")])
def test_the_backend_follows_the_configured_device_even_where_cuda_is_available(monkeypatch, device, backend):
    # A simulation run (device="cpu") on a machine with GPUs must not get NCCL, which carries no CPU tensors.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")

    def init_process_group(chosen: str, **_: object) -> None:
        raise Created(chosen)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Created, match=f"^{backend}$"):
        collectives.default_group(None, device)
