"""Every test runs against the strict simulation (chunkmem/memory/sim.py): copies land only when someone learns
they have, and the happens-before checker raises on any access that a missing fence would leave racing
on a GPU. Processes the tests start (torchrun, spawned ranks, the CLI) check too, through the environment.
A config that names no device means the simulation here even where CUDA is available; the `gpu` tests name
their CUDA device."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator

import pytest

from chunkmem.memory import sim
from chunkmem.memory.allocator import Sizes
from chunkmem.memory.simmemory import SimulatedMemory, stop_simulated_memory, use_simulated_memory

os.environ.setdefault("CHUNKMEM_SIM_CHECK", "1")  # "0" runs the suite without the checker, to time it
os.environ.setdefault("CHUNKMEM_SIM_LANDING", "wait")  # copies land at the last moment (sim.py), not in the background
os.environ.setdefault("CHUNKMEM_DEVICE", "cpu")  # Config's default device: the simulation, on a GPU machine too
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the GPU parity tests
# MKL picks its kernels per process: on one CI machine a process took the AVX2 ones where the next took AVX-512's,
# and their matmuls differed in the last bit. Tests that compare processes bit for bit (the default setup's, the
# ranks against one process) pin the path; read at MKL's first call, so before any test runs one.
os.environ.setdefault("MKL_CBWR", "AVX2")
# Most tests use budgets of a few KiB on tiny models to make chunks move, far below what a GPU's allocator could
# place (2 MiB segments): they judge placement and bits, with non-model data counted as saved activations. Device
# tensors are still placed, so that an op mixing them with host ones fails as on CUDA ("places"). The tests of
# budgets as CUDA holds them turn the allocator model on (`sim_memory`; chunkmem/memory/simmemory.py).
os.environ.setdefault("CHUNKMEM_SIM_MEMORY", "places")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What importing torch, transformers and the tests made (some 370,000 objects) is never garbage: frozen out of
    the collector's sight, a full collection (a budgeted prepare runs a few: chunkmem.memory.device.collect_garbage)
    takes milliseconds instead of 0.2 s."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def sim_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[float], SimulatedMemory]]:
    """`sim_memory(d)`: devices made from now on place device memory by the caching allocator model, its sizes
    divided by `d` (CUDA's for 1), starting empty. Its op hook goes with the test."""
    def use(divisor: float = 1.0) -> SimulatedMemory:
        monkeypatch.setenv("CHUNKMEM_SIM_MEMORY", f"scale:{divisor}")
        gc.collect()  # models of earlier tests still alive would hold memory in it
        return use_simulated_memory(Sizes.scaled(divisor))
    yield use
    stop_simulated_memory()


@pytest.fixture(autouse=True)
def strict_simulation() -> Iterator[None]:
    if os.environ["CHUNKMEM_SIM_CHECK"] != "1":
        yield
        return
    with sim.checking():
        yield
