"""The native CPU optimizer kernel (csrc/cpu_optim.cpp): loading it, and typed wrappers around it.

Why: with optimizer state on the host, the step is bound by memory bandwidth, and torch.optim makes
several passes over each chunk (plus two cast passes in mixed precision). The kernel makes one.

The extension is optional. `load()` prefers `chunkmem._C` when setup.py built it, else compiles
csrc/cpu_optim.cpp once with torch.utils.cpp_extension into ~/.cache/chunkmem (about a minute; later
imports reuse the build). When neither works, or CHUNKMEM_NO_NATIVE=1, it returns None and logs one
warning: callers then use torch.optim. The wrappers check their inputs and raise ValueError naming the
offending tensor, because the C++ side only has a terse backstop.

CHUNKMEM_ISA=scalar|avx2|avx512 forces a code path (default: the widest the CPU runs), for tests and
for comparing paths.

The CUDA copy engine (csrc/copy_engine.cu: copy streams, events, batched copies, cudaHostAlloc) is
built the same way by `load_copy_engine()`, only when torch has CUDA and nvcc is found; CudaDevice
uses it when it loads and pure PyTorch otherwise. `report_missing()`, called when a device is made
(at the first prepare), logs one line naming the parts that are missing and why; each part is
reported once per process, by whichever of it and the loaders speaks first.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from chunkmem.memory import sim

__all__ = ["load", "adam_step", "sgd_step", "supported_isas", "SOURCE", "CFLAGS", "LDFLAGS", "COPY_ENGINE_SOURCE",
           "load_copy_engine", "copy_engine", "CopyEngine", "EngineEvent", "copy_engine_nvcc_flags", "missing",
           "report_missing"]

_log = logging.getLogger("chunkmem")

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu_optim.cpp"
COPY_ENGINE_SOURCE = SOURCE.with_name("copy_engine.cu")
CPU_KERNEL, COPY_ENGINE = "CPU optimizer kernel", "CUDA copy engine"
# -ffp-contract=off: the kernel fuses a multiply-add exactly where ATen does, and nowhere else, so that
# it rounds like torch.optim. -march is deliberately absent: the file picks AVX2/AVX-512 at run time.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]

_LOWP = (torch.bfloat16, torch.float16)
Range = tuple[int, int, dict[str, Any]]  # a range of a chunk group's flat chunks, and what adam_step is given for it
_GRAD_DTYPES = (torch.float32, *_LOWP)
_missing: dict[str, str] = {}  # part -> why it is unavailable, once a loader has found out
_reported: set[str] = set()  # parts whose absence has been logged


def _build_directory(name: str = "cpu_optim") -> Path:
    """One cache folder per (Python, torch) pair: an extension built against another torch won't load."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "chunkmem"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return root / tag / name


def _load_extension(part: str, name: str, source: Path, build_dir: Path, **options: Any) -> ModuleType:
    """torch's JIT build of `source` in `build_dir`: one line first when it will make the caller wait, and
    one build at a time under a lock the kernel drops when its holder dies.

    [Note: a build that was stopped]
    torch marks a build in progress with a file named `lock` in its folder and waits, without end, for
    that file to go. A build killed midway (Ctrl-C, a job's time limit) leaves it there, and every later
    import of chunkmem would hang in silence. chunkmem's own builds take an flock first, which the kernel
    releases with its process, so whoever holds it knows no chunkmem build is running and removes a
    `lock` it finds as stale."""
    from torch.utils.cpp_extension import load as load_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "chunkmem.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            _log.warning("chunkmem: removing %s, left by a build of the %s that was stopped", stale, part)
            stale.unlink(missing_ok=True)
        built = [p.stat().st_mtime for p in build_dir.glob(f"{name}*.so")]
        if not built or max(built) < source.stat().st_mtime:
            _log.warning("chunkmem: building the %s from %s (about a minute, once: cached in %s)", part,
                         source.name, build_dir)
        return load_extension(name=name, sources=[str(source)], build_directory=str(build_dir), verbose=False,
                              **options)


def _build() -> ModuleType:
    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} is missing (chunkmem installed without its csrc/ folder)")
    return _load_extension(CPU_KERNEL, "chunkmem_cpu_optim", SOURCE, _build_directory(), extra_cflags=CFLAGS,
                           extra_ldflags=LDFLAGS)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None (after one warning) when it is disabled or cannot be built."""
    if os.environ.get("CHUNKMEM_NO_NATIVE") == "1":
        _give_up(CPU_KERNEL, "disabled by CHUNKMEM_NO_NATIVE=1")
        _log.warning("chunkmem: native CPU optimizer disabled by CHUNKMEM_NO_NATIVE=1; using torch.optim")
        return None
    try:
        from chunkmem import _C  # type: ignore[attr-defined]

        return _C
    except ImportError:
        pass
    try:
        return _build()
    except Exception as exc:  # a missing compiler or header shows up as many exception types
        _give_up(CPU_KERNEL, f"build failed: {type(exc).__name__}: {str(exc).strip()[-500:]}")
        _log.warning("chunkmem: could not build the native CPU optimizer (%s: %s); using torch.optim, "
                     "which is slower. Install g++ with OpenMP and Python headers, or set "
                     "CHUNKMEM_NO_NATIVE=1 to silence this.", type(exc).__name__, str(exc).strip()[-500:])
        return None


def _give_up(part: str, why: str) -> None:
    """Record that `part` is unavailable; the caller logs it, so report_missing() will not repeat it."""
    _missing[part] = why
    _reported.add(part)


# ---- the CUDA copy engine -------------------------------------------------------------------------------

def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    candidate = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    return str(candidate) if candidate is not None and candidate.is_file() else shutil.which("nvcc")


def _copy_engine_blocker() -> str | None:
    """Why the copy engine cannot be built here, or None when it can (cheap: builds nothing)."""
    if os.environ.get("CHUNKMEM_NO_NATIVE") == "1":
        return "disabled by CHUNKMEM_NO_NATIVE=1"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if _nvcc() is None:
        return "nvcc not found: install the CUDA toolkit, or set CUDA_HOME to it"
    return None


def copy_engine_nvcc_flags() -> list[str]:
    """nvcc flags that compile csrc/copy_engine.cu with its binding as the JIT build does (CI's check)."""
    import sysconfig

    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    # C++20: what torch.utils.cpp_extension compiles torch 2.13's headers with.
    return ["-std=c++20", "-O2", "-DTORCH_EXTENSION_NAME=chunkmem_copy_engine", *COMMON_NVCC_FLAGS,
            *(f"-I{path}" for path in includes)]


@functools.cache
def load_copy_engine() -> ModuleType | None:
    """The compiled copy engine (built on first call, about a minute), or None when it cannot be."""
    why = _copy_engine_blocker()
    if why is None:
        try:
            return _load_extension(COPY_ENGINE, "chunkmem_copy_engine", COPY_ENGINE_SOURCE,
                                   _build_directory("copy_engine"), extra_cuda_cflags=["-O2"])
        except Exception as exc:  # as in load(): compiler, header and linker failures take many forms
            why = f"build failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
    _missing[COPY_ENGINE] = why
    return None


@functools.cache
def copy_engine(device: int) -> CopyEngine | None:
    """The copy engine of CUDA device `device`, or None; one per process: its streams outlive runtimes. None too
    where it is built but cannot start there (its streams or events not made): copies then go through PyTorch's
    streams, as without it, and report_missing says why, rather than the run ending at prepare."""
    module = load_copy_engine()
    if module is None:
        return None
    try:
        return CopyEngine(module.CopyEngine(device))
    except RuntimeError as exc:
        _missing[COPY_ENGINE] = f"did not start on cuda:{device}: {exc}"
        return None


class CopyEngine:
    """csrc/copy_engine.cu's engine of one device. The extension returns its errors rather than throwing them (a
    C++ exception ended the process on the lent H100): this raises them as RuntimeError, and checks a batch before
    handing it over, so that a bad argument never reaches the C++ side."""

    def __init__(self, raw: Any) -> None:
        _raise(raw.error)
        self.raw = raw
        self.device: int = raw.device
        self.h2d_stream: int = raw.h2d_stream
        self.d2h_stream: int = raw.d2h_stream

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor], after: int) -> EngineEvent:
        """dst[i].copy_(src[i]) for every i, one direction, on that direction's stream after the work queued on
        stream `after`; the event after the last copy."""
        _raise(_invalid_batch(dst, src, self.device))
        event, error = self.raw.copy(dst, src, after)
        _raise(error)
        return EngineEvent(event)


class EngineEvent:
    """The engine's event after a batch of copies (a token of CudaDevice)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def wait(self, stream: int) -> None:
        """Work queued on `stream` from now on starts after the copies."""
        _raise(self.raw.wait(stream))

    def synchronize(self) -> None:
        _raise(self.raw.synchronize())

    def query(self) -> bool:
        done, error = self.raw.query()
        _raise(error)
        return bool(done)


def _raise(error: str) -> None:
    if error:
        raise RuntimeError(error)


def _invalid_batch(dst: list[torch.Tensor], src: list[torch.Tensor], device: int) -> str:
    """What is wrong with a batch of copies for the engine of CUDA `device` ("" when nothing is): the extension's
    own check, in the same words."""
    if len(dst) != len(src):
        return f"chunkmem copy engine: {len(dst)} destinations but {len(src)} sources; pass one of each per chunk"
    if not dst:
        return "chunkmem copy engine: empty batch; pass at least one chunk"
    upload = dst[0].is_cuda
    for i, (to, from_) in enumerate(zip(dst, src)):
        device_side, host_side = (to, from_) if upload else (from_, to)
        if not device_side.is_cuda or device_side.get_device() != device or host_side.device.type != "cpu":
            way = f"cpu -> cuda:{device}" if upload else f"cuda:{device} -> cpu"
            return (f"chunkmem copy engine: pair {i} goes the wrong direction for this batch ({way}); split batches "
                    "by direction and device")
        error = sim.invalid_pair(i, to, from_)
        if error:
            return error
    return ""


# ---- saying what is missing, once ---------------------------------------------------------------------

def _cpu_kernel_blocker() -> str | None:
    """Why the CPU kernel is unavailable: load()'s answer if it ran, else a cheap guess (builds nothing)."""
    if load.cache_info().currsize:
        return _missing.get(CPU_KERNEL)
    if os.environ.get("CHUNKMEM_NO_NATIVE") == "1":
        return "disabled by CHUNKMEM_NO_NATIVE=1"
    if importlib.util.find_spec("chunkmem._C") is not None:
        return None
    compiler = os.environ.get("CXX", "c++")
    return None if shutil.which(compiler) else f"no C++ compiler {compiler!r} on PATH to build {SOURCE.name}"


def missing() -> dict[str, str]:
    """The native parts known to be unavailable, with why (parts not tried yet are absent)."""
    return dict(_missing)


def report_missing(cuda: bool) -> None:
    """Log one line naming the native parts that are missing and why, each part once per process.

    cuda: whether this run computes on CUDA. Then a missing copy engine costs speed and is a warning;
    on the CPU simulation it is irrelevant and only informational.
    """
    found = {CPU_KERNEL: _cpu_kernel_blocker(), COPY_ENGINE: _missing.get(COPY_ENGINE) or _copy_engine_blocker()}
    new = {part: why for part, why in found.items() if why is not None and part not in _reported}
    if not new:
        return
    _reported.update(new)
    # A part this run could use, and that the user did not turn off, is worth a warning; the rest is news.
    relevant = [why for part, why in new.items() if part == CPU_KERNEL or cuda]
    serious = any(not why.startswith("disabled") for why in relevant)
    _log.log(logging.WARNING if serious else logging.INFO,
             "chunkmem: running on pure PyTorch without %s",
             "; ".join(f"the {part} ({why})" for part, why in new.items()))


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("chunkmem's native CPU optimizer is unavailable (see the warning logged by "
                           "chunkmem.memory.native.load()); check `load() is not None` before calling it")
    return module


def supported_isas() -> list[str]:
    """Code paths this CPU runs, narrowest first, e.g. ['scalar', 'avx2']; [] without the extension."""
    module = load()
    return list(module.supported_isas()) if module is not None else []


def _isa(isa: str | None) -> str:
    chosen = isa or os.environ.get("CHUNKMEM_ISA", "auto")
    if chosen not in ("auto", "scalar", "avx2", "avx512"):
        raise ValueError(f"isa={chosen!r} is not a code path; use 'auto', 'scalar', 'avx2' or 'avx512'")
    return chosen


def _check(name: str, t: torch.Tensor, numel: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the CPU optimizer needs host tensors")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} has shape {tuple(t.shape)} and strides {t.stride()}; pass a contiguous "
                         f"1-D chunk (e.g. t.contiguous().view(-1))")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} is {t.dtype}; expected one of {', '.join(map(str, dtypes))}")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but master has {numel}; all must cover one chunk")


def _check_common(master: torch.Tensor, grad: torch.Tensor, param_out: torch.Tensor | None) -> None:
    _check("master", master, master.numel(), (torch.float32,))
    _check("grad", grad, master.numel(), _GRAD_DTYPES)
    if param_out is not None:
        _check("param_out", param_out, master.numel(), _LOWP)


def adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              param_out: torch.Tensor | None, *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, decoupled: bool, step: int, grad_scale_inv: float = 1.0,
              maximize: bool = False, isa: str | None = None,
              into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, threads: int = 0) -> bool:
    """One Adam (decoupled=False) or AdamW (decoupled=True) step over a chunk, in place.

    master, exp_avg, exp_avg_sq: fp32; grad: fp32, bf16 or fp16, multiplied by grad_scale_inv first;
    param_out: optional bf16/fp16 copy of the updated master. `step` counts this step (1 on the first).
    into: fp32 (master, exp_avg, exp_avg_sq) to write the results to instead, leaving the inputs as they were
    (none of them may overlap an input).
    threads: the OpenMP team's size; 0: torch's (torch.get_num_threads()).
    Returns True if any scaled gradient was inf or nan; the update has been applied regardless, with
    the non-finite values propagated as torch.optim would.
    """
    _check_common(master, grad, param_out)
    _check("exp_avg", exp_avg, master.numel(), (torch.float32,))
    _check("exp_avg_sq", exp_avg_sq, master.numel(), (torch.float32,))
    if step < 1:
        raise ValueError(f"step={step}; it counts steps taken including this one, so it starts at 1")
    if threads < 0:
        raise ValueError(f"threads={threads}: expected a number of threads, or 0 for torch's")
    for name, out in zip(("master", "exp_avg", "exp_avg_sq"), into or ()):
        _check(f"into's {name}", out, master.numel(), (torch.float32,))
        if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
               for t in (master, grad, exp_avg, exp_avg_sq)):
            raise ValueError(f"into's {name} shares memory with an input: give buffers of their own, or into=None "
                             "to update in place")
    written = (param_out, *into) if into is not None else (master, exp_avg, exp_avg_sq, param_out)
    sim.check_unseen("the native adam_step", (master, grad, exp_avg, exp_avg_sq), written)
    return bool(_module().adam_step(master, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps,
                                    weight_decay, decoupled, step, grad_scale_inv, maximize, _isa(isa),
                                    *(into or (None, None, None)), threads))


def adam_ranges(ranges: list[Range], master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, param_out: torch.Tensor | None,
                into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, threads: int = 0) -> None:
    """adam_step over each of `ranges` of a chunk group's flat chunks, each with what it is given."""
    for start, end, args in ranges:
        cut = slice(start, end)
        out = param_out[cut] if param_out is not None else None
        adam_step(master[cut], grad[cut], exp_avg[cut], exp_avg_sq[cut], out, threads=threads,
                  into=(into[0][cut], into[1][cut], into[2][cut]) if into is not None else None, **args)


def sgd_step(master: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None,
             param_out: torch.Tensor | None, *, lr: float, momentum: float, dampening: float,
             weight_decay: float, nesterov: bool, maximize: bool, first_step: bool,
             grad_scale_inv: float = 1.0, isa: str | None = None) -> bool:
    """One torch.optim.SGD step over a chunk, in place; returns True if a scaled grad was inf or nan.

    momentum_buf (fp32) is required exactly when momentum != 0. On first_step it is overwritten with the
    gradient, undampened, as torch does when it creates the buffer.
    """
    _check_common(master, grad, param_out)
    if (momentum_buf is None) != (momentum == 0):
        raise ValueError(f"momentum={momentum} but momentum_buf is "
                         f"{'missing' if momentum_buf is None else 'given'}; pass a buffer exactly "
                         f"when momentum != 0")
    if momentum_buf is not None:
        _check("momentum_buf", momentum_buf, master.numel(), (torch.float32,))
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"nesterov needs momentum > 0 and dampening == 0, got momentum={momentum}, "
                         f"dampening={dampening} (as torch.optim.SGD requires)")
    sim.check_unseen("the native sgd_step", (grad,), (master, momentum_buf, param_out))
    return bool(_module().sgd_step(master, grad, momentum_buf, param_out, lr, momentum, dampening,
                                   weight_decay, nesterov, maximize, first_step, grad_scale_inv, _isa(isa)))
