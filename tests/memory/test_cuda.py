"""The CUDA path on a real device: parity with plain PyTorch, the budget against what the process really
reserves, the copy fences, and chunkmem's default CUDA set-up (copy engine, native host update, the uploads after
it) against the same run with every launch blocking. The tests that can, run on "cpu" too (the simulation), so a
broken set-up shows in CI; the "cuda" ones are marked gpu and skipped without CUDA.

`chunkmem selftest` runs some of the same checks and more (bandwidth, the sanitizer, overlap) in one command.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys

import pytest
import torch

import chunkmem
from chunkmem.selftest import budget_for
from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, tiny_gpt2, train

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])
DEVICES = ["cpu", CUDA]
adamw = functools.partial(torch.optim.AdamW, lr=1e-3)


@pytest.fixture
def deterministic():
    """Atomics-free kernels, so two runs of the same math agree bit for bit."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def _plain(device: str, batches: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    plain = tiny_gpt2().to(device)
    losses = train(plain, adamw(plain.parameters()), [b.to(device) for b in batches], gpt2_loss)
    return losses, {k: v.cpu() for k, v in plain.state_dict().items()}


@pytest.fixture(autouse=True)
def _no_cap_left():
    """A failed test's traceback keeps its prepared model, and with it the allocator's cap, alive: the next test
    starts without a cap."""
    yield
    if torch.cuda.is_available():
        from chunkmem.memory.device import _BUDGETS

        _BUDGETS.clear()
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_everything_on_the_device_is_bit_identical_to_plain_pytorch(deterministic, device):
    batches = gpt2_batches(4)
    ref_losses, ref_state = _plain(device, batches)
    model = tiny_gpt2()
    cm, opt = chunkmem.prepare(model, adamw(model.parameters()), chunkmem.Config(device=device, native_optimizer=False))
    assert train(cm, opt, batches, gpt2_loss) == ref_losses
    state = cm.state_dict()
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("fraction", [0.5, 0.3])
@pytest.mark.parametrize("device", DEVICES)
def test_streaming_tracks_plain_pytorch_on_the_same_device(deterministic, device, fraction, sim_memory):
    # In the simulation every update is torch.optim's on CPU tensors, as plain PyTorch's: bit for bit. On CUDA the
    # streamed groups step on the host (torch.optim's CPU kernels: its single-tensor path, not CUDA's foreach one),
    # so their updates differ from plain CUDA's in the last bits; 4 steps of lr 1e-3 keep that within 1e-5. The
    # simulation places memory as CUDA's allocator does (its segments), as the budget must hold there.
    if device == "cpu":
        sim_memory(1)
    batches = gpt2_batches(4)
    ref_losses, ref_state = _plain(device, batches)
    model = tiny_gpt2()
    cm, opt = chunkmem.prepare(model, adamw(model.parameters()), chunkmem.Config(
        device=device, device_memory=budget_for(device, int(param_bytes(model) * fraction)), native_optimizer=False))
    losses, state, stats = train(cm, opt, batches, gpt2_loss), cm.state_dict(), cm.memory_stats()
    assert not cm.runtime.placer.all_homed and stats["device_chunk_bytes_peak"] <= stats["device_limit_bytes"]
    if device == "cpu":
        assert losses == ref_losses and all(torch.equal(state[k], v) for k, v in ref_state.items())
        return
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("device", DEVICES)
def test_what_the_process_reserves_stays_within_the_budget(device, fraction, sim_memory):
    # The budget holds for what the allocator reserves, cached blocks and holes included, plus what the process
    # holds outside it (gpu_memory's Note), with no out-of-memory fallback; in the simulation, the allocator model
    # at CUDA's sizes.
    probe_model = tiny_gpt2(layers=8)  # the probe has its own model: an optimizer holds only its model's parameters
    probe, _ = chunkmem.prepare(probe_model, adamw(probe_model.parameters()), chunkmem.Config(device="cpu"))
    data = probe.memory_stats()["model_data_bytes"]
    del probe, probe_model
    memory = sim_memory(1) if device == "cpu" else None  # (collects the probe, whose chunks would count)
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved() if device == "cuda" else 0
    budget = budget_for(device, int(data * fraction) + (8 << 20))  # 8 MiB for activations and the allocator's segments
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = tiny_gpt2(layers=8)
    cm, opt = chunkmem.prepare(model, adamw(model.parameters()), chunkmem.Config(device=device, device_memory=budget))
    train(cm, opt, gpt2_batches(4), gpt2_loss)
    assert cm.memory_stats()["oom_fallbacks"] == 0
    if memory is not None:
        assert memory.allocator.peak_reserved <= budget
    else:
        outside = cm.runtime.gpu_memory.outside_allocator() if cm.runtime.gpu_memory else 0
        assert torch.cuda.max_memory_reserved() - before + outside <= budget
        assert all(c.host_unfenced.is_pinned() for c in cm.runtime.store.chunks())
    del cm, opt, model  # the module too: its parameters are views into the chunks, its hooks the runtime's
    gc.collect()
    if memory is not None:
        assert memory.allocator.allowed is None, "the cap went with the runtime"
        return
    beyond = torch.empty(budget + (64 << 20), dtype=torch.uint8, device="cuda")  # the cap went with the runtime
    assert beyond.numel() > budget


def _cuda_device(engine: bool):
    from chunkmem.memory.device import CudaDevice

    device = CudaDevice("cuda")
    if not engine:
        device.engine = None
    elif device.engine is None:
        pytest.skip("the copy engine is not built here")
    return device


@pytest.mark.parametrize("side_stream", [False, True], ids=["default stream", "side stream"])
@pytest.mark.parametrize("engine", [True, False], ids=["engine", "torch"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_download_waits_for_kernels_queued_before_it(side_stream, engine):
    # A slow kernel writes the buffer, then the download starts: it must see what the kernel wrote, on
    # the legacy default stream (cuda_stream 0) as on any other.
    device = _cuda_device(engine)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        buffer = torch.zeros(1 << 24, device="cuda")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued before the write
        buffer.fill_(7.0)
        host = device.host_alloc(buffer.numel(), buffer.dtype)
        token = device.download(buffer, host)
    device.wait_host(token)
    assert torch.equal(host, torch.full_like(host, 7.0))


@pytest.mark.parametrize("engine", [True, False], ids=["engine", "torch"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_upload_lands_after_kernels_queued_before_it_and_after_the_copy_it_follows(engine):
    # 1. A slow kernel then a fill write the device buffer; an upload into it issued after them must land last.
    # 2. A chunk's slot reused (arena.py): the upload into it follows the download still reading it, on the
    #    other copy stream, and compute does not wait for either.
    device = _cuda_device(engine)
    buffer = torch.zeros(1 << 24, device="cuda")
    torch.cuda._sleep(200_000_000)
    buffer.fill_(7.0)
    ones = device.host_alloc(buffer.numel(), buffer.dtype).fill_(1.0)
    device.wait(device.upload(ones, buffer))
    assert torch.equal(buffer.cpu(), torch.ones(buffer.numel()))
    torch.cuda._sleep(200_000_000)
    buffer.fill_(3.0)  # what the download must read
    old = device.host_alloc(buffer.numel(), buffer.dtype)
    downloaded = device.download(buffer, old)
    twos = device.host_alloc(buffer.numel(), buffer.dtype).fill_(2.0)
    device.wait(device.upload(twos, buffer, after=downloaded))
    device.wait_host(downloaded)
    assert torch.equal(old, torch.full_like(old, 3.0)), "the upload overwrote the slot before its download read it"
    assert torch.equal(buffer.cpu(), torch.full((buffer.numel(),), 2.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_means_this_ranks_device_and_makes_it_current():
    from chunkmem.memory.device import CudaDevice

    last = torch.cuda.device_count() - 1
    device = CudaDevice(f"cuda:{last}")
    assert device.torch_device.index == last == torch.cuda.current_device()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engines_reading_of_held_bytes_is_torchs():
    """The copy engine reads what the allocator holds from its statistics, as gpu_memory.held_bytes does through
    torch.cuda.memory_stats, at every moment of a step: the two agree through allocations, splits and frees."""
    from chunkmem.memory import gpu_memory, native

    module = native.load_copy_engine()
    if module is None:
        pytest.skip(f"the CUDA copy engine is not built here: {native.missing().get(native.COPY_ENGINE)}")
    device = torch.device("cuda", torch.cuda.current_device())
    kept = []
    for size in (1, 4096, 3 << 20, 25 << 20):
        kept.append(torch.empty(size, dtype=torch.uint8, device=device))
        small = torch.empty(size // 2 + 1, dtype=torch.uint8, device=device)  # splits a segment, then leaves a hole
        del small
        assert module.held_bytes(device.index) == gpu_memory.held_bytes(device)
    del kept
    assert module.held_bytes(device.index) == gpu_memory.held_bytes(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_engine_batched_round_trip_and_pinned_pool():
    from chunkmem.memory import native
    from chunkmem.memory.hostpool import EngineAllocator, HostPool, RegisteredAllocator

    engine = native.copy_engine(torch.cuda.current_device())
    if engine is None:
        pytest.skip(f"the CUDA copy engine is not built here: {native.missing().get(native.COPY_ENGINE)}")
    pool = HostPool(EngineAllocator(native.load_copy_engine()))
    sizes = [1, 1000, 1 << 20, 3 * (1 << 20) + 7]  # odd sizes too: copies are byte-exact, not rounded
    hosts = [pool.tensor(n, torch.float32).copy_(torch.randn(n)) for n in sizes]
    assert all(h.is_pinned() for h in hosts)
    assert pool.stats()["host_pinned_bytes"] == 4 * sum(sizes)
    compute = torch.cuda.current_stream()
    devices = [torch.empty(n, device="cuda") for n in sizes]
    uploaded = engine.copy(devices, hosts, compute.cuda_stream)  # one call for the whole list
    uploaded.wait(compute.cuda_stream)  # compute reads the chunks only after the copies
    doubled = [d * 2 for d in devices]
    backs = [pool.tensor(n, torch.float32) for n in sizes]
    downloaded = engine.copy(backs, doubled, compute.cuda_stream)
    downloaded.synchronize()
    assert downloaded.query()
    for host, back in zip(hosts, backs):
        assert torch.equal(back, host * 2)
    address = hosts[2].data_ptr()
    del hosts
    assert pool.tensor(1 << 20, torch.float32).data_ptr() == address  # the freed block, same size
    with pytest.raises(RuntimeError, match="direction"):
        engine.copy([devices[0]], [devices[0]], compute.cuda_stream)
    with pytest.raises(RuntimeError, match="bytes"):
        engine.copy([devices[0]], [backs[1]], compute.cuda_stream)
    _, error = engine.raw.copy([devices[0]], [devices[0]], compute.cuda_stream)  # the extension's own check
    assert "direction" in error

    registered = HostPool(RegisteredAllocator())  # the route without the extension: cudaHostRegister
    small = [registered.tensor(100, torch.float32) for _ in range(3)]  # would share pages if not page-aligned
    buffer = registered.tensor(1000, torch.float32).copy_(torch.arange(1000.0))
    assert buffer.is_pinned() and all(s.is_pinned() for s in small)
    assert torch.equal(buffer.cuda(non_blocking=True).cpu(), torch.arange(1000.0))
    torch.zeros(1, device="cuda").add_(1)  # no CUDA error left behind for the next kernel launch to report


DEFAULT_SETUP = """
import copy, hashlib, sys, torch, chunkmem
from torch.nn.attention import SDPBackend, sdpa_kernel
from chunkmem.selftest import budget_for
from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, tiny_gpt2, train
device, dtype, ahead = sys.argv[1], sys.argv[2], sys.argv[3] == "ahead"
torch.use_deterministic_algorithms(True, warn_only=True)
model = tiny_gpt2(layers=12)
if device == "cuda":
    for module in model.modules():  # the GPU busy before each layer: the host runs ahead of it
        module.register_forward_pre_hook(lambda *_: torch.cuda._sleep(2_000_000))
    twin = copy.deepcopy(model)  # a step of it unbudgeted first: its kernels load before budget_for's reading
    cm, opt = chunkmem.prepare(twin, torch.optim.AdamW(twin.parameters()), chunkmem.Config(device=device))
    with sdpa_kernel(SDPBackend.MATH):
        train(cm, opt, gpt2_batches(1), gpt2_loss)
    del twin, cm, opt
room = int(param_bytes(model) * 0.4) + (4 << 20 if device == "cuda" else 0)  # CUDA: a third 2 MiB segment and more
cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), chunkmem.Config(
    device=device, device_memory=budget_for(device, room), native_optimizer=True, dtype=dtype, overlap_update=ahead))
with sdpa_kernel(SDPBackend.MATH):  # the memory-efficient attention's backward is not deterministic on CUDA
    losses = train(cm, opt, gpt2_batches(5), gpt2_loss)
digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in cm.state_dict().values())).hexdigest()
engine = getattr(cm.runtime.device, "engine", None) is not None
print(repr(losses), digest, engine, opt.native_steps > 0, not cm.runtime.placer.all_homed,
      cm.memory_stats()["ahead_adopted"] > 0)
"""


def _default_setup(tmp_path, device: str, dtype: str = "fp32", ahead: str = "after", **env: str) -> str:
    """The last line DEFAULT_SETUP prints; `ahead`: "ahead" for host updates made ahead of step()."""
    script = tmp_path / "default_setup.py"
    script.write_text(DEFAULT_SETUP)
    env = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), device, dtype, ahead], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_default_cuda_setup_gives_the_bits_of_the_same_run_with_every_launch_blocking(tmp_path):
    # chunkmem's defaults on CUDA (the copy engine, the native host update, the parameter uploads after it) at a
    # streaming budget, with the host running ahead of the GPU, against CUDA_LAUNCH_BLOCKING=1, where every
    # kernel and copy finishes before the host goes on: a missing fence changes the bits.
    overlapped = _default_setup(tmp_path, "cuda", CUDA_LAUNCH_BLOCKING="0")
    assert overlapped == _default_setup(tmp_path, "cuda", CUDA_LAUNCH_BLOCKING="1")
    assert overlapped.endswith("True True True False"), "the copy engine and the native kernel ran, chunks streamed"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_updates_made_ahead_on_cuda_give_the_bits_of_updates_after_backward(tmp_path):
    # Config.overlap_update on CUDA, in bf16 with the host running ahead of the GPU: the worker waits for each
    # group's gradient downloads by their events while backward goes on, and step() adopts what it made.
    ahead = _default_setup(tmp_path, "cuda", "bf16", "ahead")
    after = _default_setup(tmp_path, "cuda", "bf16", "after")
    assert ahead.rsplit(" ", 1)[0] == after.rsplit(" ", 1)[0]
    assert ahead.endswith("True True True True") and after.endswith("False"), (ahead, after)


@pytest.mark.slow
def test_the_default_setup_script_runs_in_the_simulation(tmp_path):
    # The GPU test's script, its set-up checked here in the simulation (no copy engine: "False"), with copies
    # landing at random moments against the strictest landing.
    at_random = _default_setup(tmp_path, "cpu", CHUNKMEM_SIM_LANDING="random:3")
    assert at_random == _default_setup(tmp_path, "cpu", CHUNKMEM_SIM_LANDING="wait")
    assert at_random.endswith("False True True False"), at_random
    # And the GPU test of host updates made ahead, in the simulation.
    ahead = _default_setup(tmp_path, "cpu", "bf16", "ahead", CHUNKMEM_SIM_LANDING="random:3")
    after = _default_setup(tmp_path, "cpu", "bf16", "after", CHUNKMEM_SIM_LANDING="wait")
    assert ahead.rsplit(" ", 1)[0] == after.rsplit(" ", 1)[0] and ahead.endswith("True"), (ahead, after)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_under_the_cuda_sanitizer_reports_no_race(tmp_path):
    # PyTorch's CUDA sanitizer checks every stream access torch sees; the copy engine's own copies are
    # invisible to it, so this run takes the torch route for copies (CHUNKMEM_NO_NATIVE=1).
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, chunkmem\n"
        "from chunkmem.selftest import budget_for\n"
        "from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, tiny_gpt2, train\n"
        "for fraction in (None, 0.5, 0.25):\n"
        "    model = tiny_gpt2()\n"
        "    budget = None if fraction is None else budget_for('cuda', int(param_bytes(model) * fraction))\n"
        "    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),\n"
        "                               chunkmem.Config(device='cuda', device_memory=budget))\n"
        "    train(cm, opt, gpt2_batches(3), gpt2_loss)\n"
        "    cm.state_dict()\n"
        "torch.cuda.synchronize()\n")
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1", CHUNKMEM_NO_NATIVE="1",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "CSAN" not in done.stderr, done.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_process_on_its_own_gpu_creates_no_context_on_gpu_0(tmp_path):
    # A guard that restores "device 0" by cudaSetDevice creates a context there (about half a GiB) for every
    # rank on another GPU; the copy engine uses torch's guard, which does not.
    pytest.importorskip("pynvml")
    script = tmp_path / "other_gpu.py"
    script.write_text(
        "import os, pynvml, torch, chunkmem\n"
        "from chunkmem.memory.gpu_memory import nvml_uuid\n"
        "from chunkmem.selftest import budget_for\n"
        "from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, tiny_gpt2, train\n"
        "model = tiny_gpt2()\n"
        "cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()), chunkmem.Config(\n"
        "    device='cuda:1', device_memory=budget_for('cuda:1', param_bytes(model) * 2)))\n"
        "train(cm, opt, gpt2_batches(2), gpt2_loss)\n"
        "torch.cuda.synchronize('cuda:1')\n"
        "pynvml.nvmlInit()\n"
        "handle = pynvml.nvmlDeviceGetHandleByUUID(nvml_uuid(torch.device('cuda', 0)))\n"
        "pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]\n"
        "print('context on gpu 0' if os.getpid() in pids else 'clean')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("clean"), done.stdout + done.stderr[-3000:]
