"""The compute device behind one small interface: CUDA, or the CPU simulation of one (chunkmem/memory/sim.py).

Everything above this interface runs unchanged in the simulation, which holds copies to CUDA's
ordering rules, so CudaDevice is the only code CI cannot run: it is kept to the calls that have no
CPU twin (streams, events, the caching allocator), each mirroring a method of SimulatedDevice.
Host payloads come from a `HostPool` (chunkmem/memory/hostpool.py) on both: pinned on CUDA, its twin in
simulation, with the same reuse, cap and fallback.

[Note: tokens]
`upload`, `download` and `collective` start work that ends later and return a token. Compute
waits for it with `wait` (on CUDA the compute stream waits; the host does not block); the host
with `wait_host`. Every copy is fenced after the work compute has queued when it is issued, on
every stream, the legacy default stream included.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from chunkmem.config import parse_size
from chunkmem.memory import native
from chunkmem.memory.allocator import Room, Sizes
from chunkmem.memory.arena import SlotArena
from chunkmem.memory.gpu_memory import allocator_fraction, held_bytes, held_in
from chunkmem.memory.hostpool import EngineAllocator, HostAllocator, HostPool, RegisteredAllocator
from chunkmem.memory.sim import SimulatedDevice

_log = logging.getLogger("chunkmem")


LARGE_SEGMENT = 20 << 20  # CUDACachingAllocator's kLargeBuffer: the segment a request of 1-10 MiB reserves
CUDA_SIZES = Sizes()  # its rounding and segments (the simulation's model of them: allocator.py)
LANDING_POLL_S = 50e-6  # how often a thread waiting for a copy to land asks (CudaDevice.wait_landed)


class Device(Protocol):
    torch_device: torch.device
    host_pool: HostPool  # where host_alloc's buffers come from; its stats() go into memory_stats()
    arena: SlotArena  # where chunk payloads live on the device (arena.py's Note on chunk memory)
    segment_bytes: int  # the caching allocator's large segment: what one non-model allocation may reserve anew
    reads_memory: bool  # memory_reading() measures the allocator (else non-model bytes are the saved activations)

    def segment_for(self, nbytes: int) -> int:
        """What a request of `nbytes` reserves when no cached block holds it (0 where memory is not modelled)."""
        ...

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def upload(self, host: torch.Tensor, device: torch.Tensor, label: str = "", after: object | None = None) -> object:
        """Start a host-to-device copy, after the copy `after` if given (whatever its stream); returns a token
        for `wait`."""
        ...

    def download(self, device: torch.Tensor, host: torch.Tensor, label: str = "") -> object:
        """Start a device-to-host copy; returns a token for `wait_host`."""
        ...

    def collective(self, issue: Callable[[], Any], writes: Sequence[torch.Tensor] = (),
                   reads: Sequence[torch.Tensor] = (), label: str = "") -> object:
        """Start the asynchronous collective `issue()` (it returns a torch.distributed Work) after the
        work compute has queued; returns a token for `wait`. `writes`/`reads`: the tensors it fills and reads."""
        ...

    def wait(self, token: object) -> None:
        """Make compute wait for the work behind `token`, without blocking the host."""
        ...

    def wait_host(self, token: object) -> None:
        """Block the host until the work behind `token` is done."""
        ...

    def wait_landed(self, token: object) -> None:
        """Block the calling thread, a worker beside the host's (runtime/ahead.py), until the copy behind `token`
        has landed. The host learns nothing from it: it waits itself before it reads what the copy wrote."""
        ...

    def discard(self, token: object) -> None:
        """Nothing will read what the copy behind `token` writes (a prefetch dropped unused), so a host write
        into its source races with nothing that matters. Only the simulation's checker cares."""
        ...

    def limit_memory(self, owner: object, limit: int, outside: int) -> None:
        """Hold everything `owner` (a runtime) takes from the device within `limit` bytes, of which `outside`
        are already held outside the allocator (gpu_memory's Note on the budget)."""
        ...

    def capped(self) -> bool:
        """Whether prepared models cap this device's memory now (dropped ones too, until the collector ends them)."""
        ...

    def synchronize(self) -> None:
        """Block the host until everything issued on the device is done."""
        ...

    def holds(self, tensor: torch.Tensor) -> int:
        """How many tensors on `tensor`'s storage the device itself keeps for copies in flight (arena.py)."""
        ...

    def memory_reading(self) -> tuple[int, int] | None:
        """The most the device's caching allocator held since the last call (gpu_memory.held_bytes: live blocks and
        the holes between them; temporaries come and go between two calls) and the largest block it handed out
        since; None where the simulation does not model it."""
        ...

    def allocation_room(self) -> Room | None:
        """The caching allocator's room now (allocator.Room: `sure` for one allocation, its `held` being
        memory_reading's figure; `fresh` for several). None without a cap, or where the simulation does not model
        one."""
        ...

    def empty_cache(self) -> None: ...
    def free_bytes(self) -> int: ...
    def total_bytes(self) -> int: ...


CAPTURED = ("chunkmem moves chunks between host and device while a step runs, on streams and into memory a CUDA graph "
            "cannot replay (torch.cuda.graph, make_graphed_callables, torch.compile(mode='reduce-overhead') capture "
            "one): compile a prepared model with the default mode, or capture only what runs outside it")


def cuda_index(name: str, environ: dict[str, str] | os._Environ = os.environ, count: int | None = None) -> int:
    """The CUDA device `name` means: "cuda:N" is N; under torchrun "cuda" is LOCAL_RANK's device (ranks of
    one node must not all land on GPU 0), else the current device."""
    device = torch.device(name)
    if device.index is not None:
        return device.index
    count = torch.cuda.device_count() if count is None else count
    local = environ.get("LOCAL_RANK")
    if local is None or count == 1:  # one visible GPU per process (a scheduler set CUDA_VISIBLE_DEVICES)
        return torch.cuda.current_device() if count != 1 else 0
    if not local.isdigit() or int(local) >= count:
        raise ValueError(f"Config.device='cuda' under torchrun means cuda:LOCAL_RANK, but LOCAL_RANK={local!r} and "
                         f"{count} CUDA devices are visible: pass device='cuda:N', or run at most {count} processes "
                         "per node")
    return int(local)


def use_device(name: str) -> torch.device:
    """The torch.device a Config.device string means (see `cuda_index`). A CUDA device is made current, so
    that what uses the current device (NCCL, object collectives, allocator defaults) uses this one and
    no rank creates a context on GPU 0."""
    if name == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", cuda_index(name))
    torch.cuda.set_device(device)
    return device


class CudaDevice:
    """A CUDA device: pinned host payloads and copy streams fenced against the compute stream.

    Uploads and downloads run on their own streams, so an eviction's copy overlaps with compute and
    with the next upload; events are the tokens. With the copy engine built (chunkmem/memory/native.py)
    copies go through it, into cudaHostAlloc'd host memory. Without it, the same with PyTorch.
    """

    def __init__(self, name: str, host_memory: int | None = None) -> None:
        self.torch_device = use_device(name)
        module = native.load_copy_engine()
        self.engine_module: Any = module
        self.engine: Any = None  # the device's CopyEngine when the extension is built
        self.h2d_stream: torch.cuda.Stream  # uploads
        self.d2h_stream: torch.cuda.Stream  # downloads
        allocator: HostAllocator
        # Peaks between moments, without resetting PyTorch's (held_peak): by the trace hook of the native caching
        # allocator, which other backends (cudaMallocAsync, a pluggable allocator) refuse.
        self.tracking = module is not None and torch.cuda.get_allocator_backend() == "native"
        self.last_peak = 0  # the allocator's peak of live bytes at the last reading (without the tracker)
        if module is not None:
            self.engine = native.copy_engine(self.torch_device.index)
            if self.tracking:
                module.track_allocations()
            allocator = EngineAllocator(module, self.torch_device.index)
        else:
            allocator = RegisteredAllocator(device=self.torch_device.index)
        if self.engine is not None:
            # The engine's streams as torch sees them, for record_stream on the buffers they read or fill.
            self.h2d_stream = torch.cuda.ExternalStream(self.engine.h2d_stream, device=self.torch_device)
            self.d2h_stream = torch.cuda.ExternalStream(self.engine.d2h_stream, device=self.torch_device)
        else:  # not built, or it did not start (native.copy_engine)
            self.h2d_stream = torch.cuda.Stream(self.torch_device)
            self.d2h_stream = torch.cuda.Stream(self.torch_device)
        self.comm_stream = torch.cuda.Stream(self.torch_device)  # ZeRO's collectives
        # Not the bound method: the pool's finalizer needs it when this device is gone (hostpool's _free_all).
        self.host_pool = HostPool(allocator, host_memory,
                                  before_free=functools.partial(torch.cuda.synchronize, self.torch_device))
        self.arena = SlotArena(self)
        self.segment_bytes = LARGE_SEGMENT
        self.reads_memory = True

    def segment_for(self, nbytes: int) -> int:
        return CUDA_SIZES.segment_for(nbytes)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host_pool.tensor(numel, dtype)

    def upload(self, host: torch.Tensor, device: torch.Tensor, label: str = "", after: object | None = None) -> object:
        if after is not None:  # the copy stream waits (a download from the same slot, say); compute does not
            self._stream_waits(self.h2d_stream, after)
        return self._copy(device, host, self.h2d_stream, device)

    def download(self, device: torch.Tensor, host: torch.Tensor, label: str = "") -> object:
        return self._copy(host, device.contiguous(), self.d2h_stream, device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream,
              device_buffer: torch.Tensor) -> object:
        """`dst.copy_(src)` on `stream` (the engine picks its own by direction) after what compute has
        queued: a new device buffer was allocated there, an evicted one last written there. Returns an
        event that marks the copy's end. record_stream keeps the caching allocator from handing
        `device_buffer` out again before the copy is done with it."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(CAPTURED)
        compute = torch.cuda.current_stream(self.torch_device)
        # First, so that a copy issued and then failing (its event not recorded) still keeps its buffers.
        device_buffer.record_stream(stream)
        if src is not device_buffer and src.is_cuda:
            src.record_stream(stream)  # the contiguous copy of a strided source
        if self.engine is not None:
            # The fence holds on every stream: cuda_stream is 0 on the legacy default stream, which is a
            # stream like any other to the engine.
            return self.engine.copy([dst], [src], compute.cuda_stream)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            dst.data.copy_(src, non_blocking=True)  # as the engine's: no version counter moves (a user's edit would)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def collective(self, issue: Callable[[], Any], writes: Sequence[torch.Tensor] = (),
                   reads: Sequence[torch.Tensor] = (), label: str = "") -> object:
        self.comm_stream.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self.comm_stream):
            return _Collective(issue())

    def wait(self, token: object) -> None:
        if isinstance(token, _Collective):
            token.work.wait()  # NCCL: the current stream waits
        else:
            self._stream_waits(torch.cuda.current_stream(self.torch_device), token)

    @staticmethod
    def _stream_waits(stream: torch.cuda.Stream, token: object) -> None:
        """Work queued on `stream` from now on starts after the copy behind `token`; the host does not block."""
        if isinstance(token, torch.cuda.Event):
            stream.wait_event(token)
        else:
            token.wait(stream.cuda_stream)  # type: ignore[attr-defined]  # the engine's event

    def wait_host(self, token: object) -> None:
        if isinstance(token, _Collective):
            token.work.wait()
            torch.cuda.current_stream(self.torch_device).synchronize()
        else:
            token.synchronize()  # type: ignore[attr-defined]

    def wait_landed(self, token: object) -> None:
        # Another thread's wait (the host update made ahead): polled, as a synchronize spins a core that update needs.
        while not token.query():  # type: ignore[attr-defined]  # a copy's event (torch's or the engine's)
            time.sleep(LANDING_POLL_S)

    def discard(self, token: object) -> None:
        pass  # record_stream keeps the dropped buffer from reuse until the copy is done

    def limit_memory(self, owner: object, limit: int, outside: int) -> None:
        """Cap what PyTorch's caching allocator may reserve on this device (gpu_memory's Note on the budget),
        until `owner` is gone."""
        index = self.torch_device.index
        budgets = _BUDGETS.setdefault(index, weakref.WeakKeyDictionary())
        before = budgets.get(owner)
        budgets[owner] = (limit, outside)
        try:
            _apply_cap(index, self.total_bytes())
        except BaseException:  # refused (no room beside what the process holds outside the allocator): not counted
            if before is None:
                del budgets[owner]
            else:
                budgets[owner] = before
            raise
        if before is None:
            weakref.finalize(owner, _apply_cap, index, self.total_bytes())

    def capped(self) -> bool:
        return bool(_BUDGETS.get(self.torch_device.index))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def holds(self, tensor: torch.Tensor) -> int:
        return 0  # a copy keeps no tensor alive: record_stream keeps the allocator from reusing its blocks

    def allocation_room(self) -> Room | None:
        index = self.torch_device.index
        if not self.capped():
            return None
        cap = int(_FRACTIONS[index] * self.total_bytes())  # as the allocator checks
        held = self.engine_module.held_bytes(index) if self.engine_module is not None else held_bytes(self.torch_device)
        return Room(cap - held, cap - torch.cuda.memory_allocated(index), cap - torch.cuda.memory_reserved(index))

    def memory_reading(self) -> tuple[int, int]:
        engine, index = self.engine_module, self.torch_device.index
        if not self.tracking:  # no size of the blocks between readings
            reading, self.last_peak = peak_reading(torch.cuda.memory_stats(index), self.last_peak)
            return reading, 0
        held = engine.held_bytes(index)  # held_bytes's figure, without torch.cuda.memory_stats's dictionary
        excess, largest = engine.take_allocation_reading(index)
        return held + excess, largest

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.torch_device)[0]

    def total_bytes(self) -> int:  # what the allocator's memory fraction is a share of (its setMemoryFraction)
        return torch.cuda.get_device_properties(self.torch_device).total_memory


class _Collective:
    """The token of a collective issued on the comm stream."""

    def __init__(self, work: Any) -> None:
        self.work = work


_BUDGETS: dict[int, weakref.WeakKeyDictionary] = {}  # CUDA index -> {runtime: (device budget, bytes outside)}
_FRACTIONS: dict[int, float] = {}  # CUDA index -> the share of the device its allocator may reserve, as last set


def _apply_cap(index: int, total: int) -> None:
    """Cap the allocator on device `index` at its live runtimes' budgets; no cap once none is left. A cap lowered
    below what the allocator holds (what the process holds outside it grew) only stops it from taking more: its
    cached free blocks go back to the device too."""
    budgets = list(_BUDGETS.get(index, {}).values())
    fraction = allocator_fraction(budgets, total) if budgets else 1.0
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _FRACTIONS[index] = fraction  # (torch has no getter before 2.6)
    if torch.cuda.memory_reserved(index) > fraction * total:
        torch.cuda.empty_cache()


# Options of the native caching allocator that change how it splits, rounds, caches or maps blocks: the plan's model
# of its segments (allocator.py) is of its defaults.
_RESHAPING_OPTIONS = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
                      "garbage_collection_threshold")


def peak_reading(stats: dict[str, int], last_peak: int) -> tuple[int, int]:
    """Without the engine's tracker: what the caching allocator holds (held_bytes, by its statistics `stats`) and,
    where its peak of live bytes rose above `last_peak` (the peak at the last reading), the most they rose above
    what it holds now: a temporary an op made and freed since (a backward op's input gradients), which before went
    unseen, and the plan gave its room to chunks. Where the peak did not move, nothing more is known (chunkmem does not
    reset the statistics: torch.cuda.max_memory_allocated stays the user's); where it fell, the user reset them
    (torch.cuda.reset_peak_memory_stats), and the peak since is new. Gives the reading and the peak for the next."""
    peak, live = stats.get("active_bytes.all.peak", 0), stats.get("active_bytes.all.current", 0)
    return held_in(stats) + (max(peak - live, 0) if peak != last_peak else 0), peak


def check_allocator(backend: str, conf: str = "") -> None:
    """A budget on CUDA needs PyTorch's native caching allocator: its cap, its statistics and the rules the plan
    counts on (gpu_memory's Note on the budget); `conf`, its PYTORCH_CUDA_ALLOC_CONF, may change those rules: a
    warning names the options that do."""
    if backend != "native":
        raise ValueError(f"Config.device_memory needs PyTorch's native CUDA caching allocator, but "
                         f"PYTORCH_CUDA_ALLOC_CONF selects the {backend!r} backend: remove backend:{backend} from "
                         "PYTORCH_CUDA_ALLOC_CONF, or leave device_memory=None")
    options = [f"{key}:{value}" for key, value in re.findall(r"(\w+)\s*:\s*(\[[^\]]*\]|[^,]*)", conf)
               if key in _RESHAPING_OPTIONS and (key, value.strip()) != ("expandable_segments", "False")]
    if options:
        _log.warning("chunkmem: PYTORCH_CUDA_ALLOC_CONF sets %s, which changes how PyTorch's caching allocator splits, "
                     "rounds or maps its blocks; the plan counts its blocks as its defaults make them, so a budget may "
                     "take more steps to settle or, rarely, run out of memory: leave them at their defaults under "
                     "Config.device_memory", ", ".join(options))


def collect_garbage() -> None:
    """Free dropped prepared models now. A runtime lives in reference cycles, so its device memory goes only when
    the collector runs; and the finalizers one pass runs let go of more (weakref.finalize callbacks, autograd's
    hooks), which only the next pass frees: passes go on until one finds nothing (at most 4)."""
    for _ in range(4):
        if not gc.collect():
            return


def make_device(name: str, host_memory: int | str | None = None, budgeted: bool = False) -> Device:
    """The device `name` ("cpu" is the simulation) pinning at most `host_memory` bytes of host buffers. A model
    dropped earlier, held only by reference cycles, would keep its device memory (which a `budgeted` model's
    budget counts where device memory is modelled: on CUDA, in the simulation with its allocator's model) and its
    allocator cap: it goes first (a few tenths of a second with transformers loaded)."""
    limit = parse_size("host_memory", host_memory)
    device: Device = SimulatedDevice(limit) if name == "cpu" else CudaDevice(name, limit)
    if budgeted and name != "cpu":
        check_allocator(torch.cuda.get_allocator_backend(),  # (in the order CUDAAllocatorConfig reads them)
                        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")))
    if device.capped() or (budgeted and device.memory_reading() is not None):
        collect_garbage()
    native.report_missing(cuda=name != "cpu")
    return device
