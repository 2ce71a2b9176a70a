"""The disk tier under host memory: chunk payloads in one preallocated file per run, moved by asynchronous
direct I/O in large aligned blocks.

Why O_DIRECT and a thread pool rather than an io_uring or libaio binding: a chunk is megabytes, so one
`preadv`/`pwritev` per 16 MiB block costs microseconds of system call against milliseconds of transfer,
and a few threads already keep an NVMe queue full; io_uring's gain is in many small requests, which the
tier never makes. `os.preadv`/`os.pwritev` release the GIL, need nothing beyond the standard library
and run wherever Linux does, where the Python bindings of io_uring and libaio on the package index are
single-maintainer projects with native builds. O_DIRECT keeps the page cache out: the tier exists
because RAM is short, and cached pages would both take RAM and make reads look faster than the disk.
On a file system that refuses O_DIRECT (tmpfs), files are opened buffered, with one warning.

[Note: run directories]
Each tier lives in `<disk>/chunkmem-<host>-<pid>-<n>/` holding `lock` (flock'ed while the run lives) and
`chunks.bin` (slots, each a chunk's bytes rounded up to ALIGN, reserved with posix_fallocate so a full
disk shows at prepare, not mid-run). `close()` and interpreter exit remove the directory; a run killed
before that leaves it, and the next tier started on the same disk directory removes every
`chunkmem-*` directory whose lock it can take (its owner is dead). Nothing is written outside.

[Note: tokens]
`read` and `write` return an IoToken at once; the I/O runs on the pool. Until `IoToken.wait()` returns,
the buffer is in use: a read fills it (no access may touch it), a write reads it (nothing may change it).
With the simulation's checker on (the whole test suite), an op that does raises HazardError, as for a
copy (sim.guard_io). A failed or overlong I/O raises DiskTierError from `wait()`, naming the file.

[Note: checksums]
A file truncated under the run (and, by a write-back landing after that, extended again with holes) reads back
as zeros without any error from the system, and zeros handed to the optimizer are silently wrong numbers. So
every block written keeps its CRC-32, every block read back is checked against it (a DiskTierError if they
differ), and every transfer checks first that the file still has the size reserved. zlib's CRC-32 runs on the
I/O threads, without the GIL, at about 2 GB/s a core on this project's machines: the cost of a disk tier's
bandwidth, spread over its threads.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import logging
import os
import shutil
import socket
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from pathlib import Path

import torch

from chunkmem.errors import DiskTierError
from chunkmem.memory import sim

log = logging.getLogger("chunkmem")

ALIGN = 4096  # O_DIRECT: buffer addresses, file offsets and lengths are multiples of the logical block size
BLOCK = 16 << 20  # bytes per system call: large enough to stream, small enough to spread over the threads
THREADS = 4
TIMEOUT_S = float(os.environ.get("CHUNKMEM_DISK_TIMEOUT", "300"))  # a wait longer than this is a fault
PREFIX = "chunkmem-"
_OWN_FILES = {"lock", "chunks.bin"}
_runs = itertools.count()
_tokens = itertools.count(1)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class IoToken:
    """An asynchronous read or write of one buffer (the Note on tokens)."""

    def __init__(self, tier: DiskTier, what: str, futures: list[Future], nbytes: int) -> None:
        self.tier = tier
        self.what = what  # "read of exp_avg.3"
        self.futures = futures
        self.nbytes = nbytes
        self.waited = False
        self.failure: BaseException | None = None  # why it failed, raised again by every later wait
        self.id = next(_tokens)
        self.stream = "disk"  # for the simulation's messages

    def done(self) -> bool:
        """Whether the I/O has finished (without waiting, and without telling the checker anything)."""
        return self.waited or all(f.done() for f in self.futures)

    def wait(self) -> None:
        """Block the host until the I/O is done; DiskTierError if it failed or took longer than the timeout."""
        if self.failure is not None:
            raise self.failure
        if self.waited:
            return
        start = time.perf_counter()
        deadline = start + self.tier.timeout
        try:
            for future in self.futures:
                future.result(timeout=max(0.0, deadline - time.perf_counter()))
        except FutureTimeout:
            raise DiskTierError(
                f"{self.what} ({self.nbytes} bytes) in {self.tier.file} has not finished after "
                f"{self.tier.timeout:.0f} s: the disk under {self.tier.root} is too slow or hung. Check it "
                "(`chunkmem env`, dmesg), put Config.disk on a faster one, or raise CHUNKMEM_DISK_TIMEOUT") from None
        except BaseException as error:
            # A block failed: once the others have ended too, the I/O is over and its buffer free (a write-back
            # the caller attempts next must report the disk's error, not a race with this dead read).
            if not futures_wait(self.futures, timeout=max(0.0, deadline - time.perf_counter())).not_done:
                self.failure = error
                self._finished()
            raise
        finally:
            self.tier.stats["wait_seconds"] += time.perf_counter() - start
        self._finished()

    def _finished(self) -> None:
        self.waited = True
        self.tier.forget(self)
        sim.learned(self)

    def knows(self, copy: object, side: str) -> bool:  # the checker's question (sim.Hazard)
        return self.waited


class DiskTier:
    """One run's file of chunk slots under `root`, and the threads that read and write it."""

    def __init__(self, root: str | os.PathLike, limit: int | None = None, threads: int = THREADS) -> None:
        self.root = Path(root)
        self.limit = limit
        self.timeout = TIMEOUT_S
        self.directory, self._lock_fd = _claim(self.root)
        self.file = self.directory / "chunks.bin"
        self.direct = True
        try:
            self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            log.warning("chunkmem: %s refuses O_DIRECT (%s): the disk tier reads and writes through the page "
                        "cache there, which takes RAM; put Config.disk on a disk file system", self.root, error)
            self.direct = False
            self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o600)
        self.size = 0  # bytes reserved in the file
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="chunkmem-disk")
        self.stats = {"read_bytes": 0, "write_bytes": 0, "reads": 0, "writes": 0, "wait_seconds": 0.0}
        self._flight: dict[int, tuple[int, int, bool, IoToken]] = {}  # id -> (start, end, is_read, token)
        # The Note on checksums: block offset -> (length, CRC-32) of what was written there last.
        self._checksums: dict[int, tuple[int, int]] = {}
        self._guard = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove, self.directory, self.fd, self._lock_fd, self.pool)

    def __repr__(self) -> str:
        return f"DiskTier({self.file}, {self.size} bytes)"

    # -- slots --------------------------------------------------------------------------------------
    def slot(self, nbytes: int) -> int:
        """Reserve room for `nbytes` (rounded up to ALIGN) at the end of the file; returns its offset."""
        offset, length = self.size, aligned(nbytes)
        if self.limit is not None and offset + length > self.limit:
            raise DiskTierError(f"the disk tier needs more than Config.disk_memory={self.limit} bytes in "
                                f"{self.root}: raise disk_memory (or leave it None), or raise host_memory")
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as error:
            free = shutil.disk_usage(self.root).free
            fix = (f"a file-size limit stops it below {offset + length} bytes (`ulimit -f`, or the file system's own, "
                   "as FAT32's 4 GiB): raise it" if error.errno == errno.EFBIG else f"free space under {self.root}")
            raise DiskTierError(f"cannot reserve {length} more bytes in {self.file} ({error.strerror}; {free} bytes "
                                f"free there): {fix}, or point Config.disk elsewhere") from None
        self.size = offset + length
        return offset

    # -- I/O ----------------------------------------------------------------------------------------
    def read(self, offset: int, buffer: torch.Tensor, what: str) -> IoToken:
        """Start filling `buffer` (host, ALIGN-aligned, its bytes a multiple of ALIGN) from the file at `offset`."""
        return self._submit(offset, buffer, what, is_read=True)

    def write(self, offset: int, buffer: torch.Tensor, what: str) -> IoToken:
        """Start writing `buffer` to the file at `offset`."""
        return self._submit(offset, buffer, what, is_read=False)

    def _submit(self, offset: int, buffer: torch.Tensor, what: str, is_read: bool) -> IoToken:
        address, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if address % ALIGN or nbytes % ALIGN or offset % ALIGN or offset + nbytes > self.size:
            raise ValueError(f"disk {what}: buffer at {address:#x} of {nbytes} bytes to offset {offset} of {self.size}: "
                             f"expected {ALIGN}-aligned addresses, offsets and lengths inside the file")
        self._check_overlap(address, nbytes, is_read, what)
        memory = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        run = self._read_block if is_read else self._write_block
        futures = [self.pool.submit(run, memory[at:at + BLOCK], offset + at, what)
                   for at in range(0, nbytes, BLOCK)]
        token = IoToken(self, f"{'read' if is_read else 'write'} of {what}", futures, nbytes)
        token.buffer = buffer  # type: ignore[attr-defined]  # kept alive until the I/O is done
        with self._guard:
            self._flight[token.id] = (address, address + nbytes, is_read, token)
        self.stats["read_bytes" if is_read else "write_bytes"] += nbytes
        self.stats["reads" if is_read else "writes"] += 1
        sim.guard_io(token, buffer, write_only=not is_read)
        return token

    def _check_overlap(self, address: int, nbytes: int, is_read: bool, what: str) -> None:
        """Two I/Os on one buffer at once race unless both only read it (writes to the file). An I/O holds its
        buffer until its token is waited for, finished or not (the Note on tokens): the race is the missing wait."""
        with self._guard:
            for start, end, other_read, token in self._flight.values():
                if start < address + nbytes and address < end and (is_read or other_read):
                    raise sim.HazardError(f"disk {what}: its buffer is still in use by the {token.what}: wait for "
                                          "that token before reusing the buffer")

    def forget(self, token: IoToken) -> None:
        with self._guard:
            self._flight.pop(token.id, None)

    def _read_block(self, memory: memoryview, offset: int, what: str) -> None:
        self._transfer(os.preadv, "reading", memory, offset, what)
        written = self._checksums.get(offset)
        if written is not None and written != (len(memory), zlib.crc32(memory)):
            raise DiskTierError(f"reading {what} from {self.file} gave other bytes than were written there (at "
                                f"[{offset}, {offset + len(memory)})): the file was changed or truncated under the "
                                "running job, and its model data is lost. Keep other programs out of "
                                f"{self.root}; resume from the last checkpoint")

    def _write_block(self, memory: memoryview, offset: int, what: str) -> None:
        self._transfer(os.pwritev, "writing", memory, offset, what)
        self._checksums[offset] = (len(memory), zlib.crc32(memory))

    def _transfer(self, call: Callable[[int, list, int], int], doing: str, memory: memoryview, offset: int,
                  what: str) -> None:
        """All of `memory` at `offset`, however many calls it takes; a call that moves nothing fails."""
        self._check_file(what)
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise DiskTierError(f"{doing} {what} at {self.file}: the file holds {size} bytes, but {self.size} were "
                                "reserved: it was truncated under the running job, and its model data is lost. "
                                f"Keep other programs out of {self.root}; resume from the last checkpoint")
        done = 0
        while done < len(memory):
            try:
                moved = call(self.fd, [memory[done:]], offset + done)
            except OSError as error:
                raise self._failed(doing, what, error) from None
            if moved == 0:
                size = os.fstat(self.fd).st_size
                raise DiskTierError(f"{doing} {what} at {self.file} needs bytes [{offset}, {offset + len(memory)}) "
                                    f"but the file ends at {size}: it was truncated under the running job. The run "
                                    "cannot continue; resume from the last checkpoint")
            done += moved

    def _check_file(self, what: str) -> None:
        if os.fstat(self.fd).st_nlink == 0:
            raise DiskTierError(f"{self.file}, which holds {what}, was deleted under the running job: its model data "
                                f"is gone with it. Keep other programs out of {self.root}; resume from the last "
                                "checkpoint")

    def _failed(self, doing: str, what: str, error: OSError) -> DiskTierError:
        hint = {errno.ENOSPC: f"the file system under {self.root} is full: free space there",
                errno.EDQUOT: f"the disk quota under {self.root} is used up",
                errno.EIO: "the disk reported an I/O error: check it (dmesg)"}.get(error.errno or 0, "check the disk")
        return DiskTierError(f"{doing} {what} {'from' if doing == 'reading' else 'to'} {self.file} failed "
                             f"({error.strerror or error}): {hint}; resume from the last checkpoint")

    def close(self) -> None:
        """Wait for nothing, stop the threads, remove the run directory. Idempotent."""
        self._finalizer()


def _remove(directory: Path, fd: int, lock_fd: int, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    for handle in (fd, lock_fd):
        try:
            os.close(handle)
        except OSError:
            pass
    shutil.rmtree(directory, ignore_errors=True)


def _claim(root: Path) -> tuple[Path, int]:
    """A new run directory under `root` (made if missing, its parent must exist), stale ones removed first, and
    its lock, held; a DiskTierError naming Config.disk when the directory cannot be written."""
    try:
        return _make_run_directory(root)
    except OSError as error:  # no permission; a file system that takes no files (/proc), read-only, full
        why = error.strerror or error
        raise DiskTierError(f"Config.disk={str(root)!r}: cannot write {error.filename or root} ({why}): point "
                            "Config.disk at a directory this user may write, on a file system that takes files and has "
                            "room (not read-only, not /proc)") from None


def _make_run_directory(root: Path) -> tuple[Path, int]:
    """`_claim`'s work: the directory is made under a name `remove_stale` ignores and renamed once locked."""
    if root.exists() and not root.is_dir():
        raise DiskTierError(f"Config.disk={str(root)!r} is a file, expected a directory for the disk tier's files")
    if not root.exists():
        if not root.parent.is_dir():
            raise DiskTierError(f"Config.disk={str(root)!r}: its parent {root.parent} does not exist; create it (or "
                                "the directory itself) first")
        root.mkdir(exist_ok=True)
    remove_stale(root)
    name = f"{socket.gethostname()}-{os.getpid()}-{next(_runs)}"
    making = root / f".{PREFIX}{name}"
    making.mkdir()
    lock = -1
    try:
        lock = os.open(making / "lock", os.O_RDONLY | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        directory = root / f"{PREFIX}{name}"
        making.rename(directory)
    except OSError:  # a file system without locks, or whose renames fail: nothing of this run left there
        if lock >= 0:
            os.close(lock)
        shutil.rmtree(making, ignore_errors=True)
        raise
    return directory, lock


def remove_stale(root: Path) -> list[Path]:
    """Remove the run directories under `root` whose owners died (their lock is free); returns them."""
    removed = []
    for entry in sorted(root.glob(f"{PREFIX}*")):
        lock = entry / "lock"
        if not entry.is_dir() or not lock.exists() or {p.name for p in entry.iterdir()} - _OWN_FILES:
            continue  # not a run directory of ours (or one still being made): leave it
        try:
            handle = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live run holds it
        finally:
            os.close(handle)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    if removed:
        log.info("chunkmem: removed %d disk-tier directories left by runs that died: %s", len(removed),
                 ", ".join(str(p) for p in removed))
    return removed
