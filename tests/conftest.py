"""Every test runs against the strict simulation (chunkmem/memory/sim.py): copies land only when someone learns
they have, and the happens-before checker raises on any access that a missing fence would leave racing
on a GPU. Processes the tests start (torchrun, spawned ranks, the CLI) check too, through the environment.
A config that names no device means the simulation here even where CUDA is available; the `gpu` tests name
their CUDA device."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from chunkmem.memory import sim

os.environ.setdefault("CHUNKMEM_SIM_CHECK", "1")  # "0" runs the suite without the checker, to time it
os.environ.setdefault("CHUNKMEM_SIM_LANDING", "wait")  # copies land at the last moment (sim.py), not in the background
os.environ.setdefault("CHUNKMEM_DEVICE", "cpu")  # Config's default device: the simulation, on a GPU machine too
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the GPU parity tests


@pytest.fixture(autouse=True)
def strict_simulation() -> Iterator[None]:
    if os.environ["CHUNKMEM_SIM_CHECK"] != "1":
        yield
        return
    with sim.checking():
        yield
