"""The disk tier's file and I/O: aligned round trips, the fence (a missing wait fails under the checker),
faults that name the file, and run directories removed at close and after a killed run."""

from __future__ import annotations

import errno
import os
from pathlib import Path
import subprocess
import sys
import time

import pytest
import torch

from chunkmem.errors import DiskTierError
from chunkmem.memory import disk as disk_module
from chunkmem.memory.disk import ALIGN, DiskTier, remove_stale
from chunkmem.memory.hostpool import HostPool, PlainAllocator
from chunkmem.memory.sim import HazardError

POOL = HostPool(PlainAllocator(pinned=True))


def buffer(nbytes: int, fill: int | None = None) -> torch.Tensor:
    out = POOL.tensor(nbytes, torch.uint8)
    if fill is not None:
        out.fill_(fill)
    return out


def test_round_trip_is_aligned_direct_io_and_counted(tmp_path):
    tier = DiskTier(tmp_path / "disk")
    offsets = [tier.slot(3 * ALIGN), tier.slot(100)]
    assert offsets == [0, 3 * ALIGN] and tier.size == 4 * ALIGN
    assert tier.direct, "ext4 and xfs take O_DIRECT"
    data = buffer(3 * ALIGN)
    data.copy_(torch.arange(3 * ALIGN) % 251)
    tier.write(offsets[0], data, "chunk a").wait()
    back = buffer(3 * ALIGN, fill=0)
    tier.read(offsets[0], back, "chunk a").wait()
    assert torch.equal(back, data)
    assert tier.stats["read_bytes"] == tier.stats["write_bytes"] == 3 * ALIGN
    with pytest.raises(ValueError, match="aligned"):
        tier.read(1, back, "misaligned")
    tier.close()


def test_touching_a_buffer_before_its_read_is_waited_for_fails(tmp_path):
    # The checker is on for every test (conftest): an access a missing wait leaves racing raises, as for copies.
    tier = DiskTier(tmp_path)
    offset = tier.slot(ALIGN)
    tier.write(offset, buffer(ALIGN, fill=7), "x").wait()
    target = buffer(ALIGN, fill=0)
    token = tier.read(offset, target, "state.0")
    with pytest.raises(HazardError, match="disk I/O"):
        target.sum()
    token.wait()
    assert int(target.sum()) == 7 * ALIGN
    source = buffer(ALIGN, fill=1)
    token = tier.write(offset, source, "state.0")
    source.sum()  # reading a buffer a write reads races with nothing
    with pytest.raises(HazardError, match="disk I/O"):
        source.add_(1)
    with pytest.raises(HazardError, match="still in use"):
        tier.read(offset, source, "state.0")  # a read into a buffer a write still reads
    token.wait()
    source.add_(1)
    tier.close()


def test_a_truncated_file_fails_naming_it(tmp_path):
    tier = DiskTier(tmp_path)
    offset = tier.slot(4 * ALIGN)
    tier.write(offset, buffer(4 * ALIGN, fill=3), "exp_avg.2").wait()
    os.truncate(tier.file, ALIGN)
    with pytest.raises(DiskTierError, match=rf"{tier.file}.*truncated"):
        tier.read(offset, buffer(4 * ALIGN), "exp_avg.2").wait()
    tier.close()


def test_a_file_truncated_and_grown_back_reads_as_zeros_and_that_fails_naming_it(tmp_path):
    # The size is right again, the bytes are gone: only the blocks' checksums can tell (the Note on checksums).
    tier = DiskTier(tmp_path)
    offset = tier.slot(4 * ALIGN)
    tier.write(offset, buffer(4 * ALIGN, fill=3), "exp_avg.2").wait()
    os.truncate(tier.file, 0)
    os.truncate(tier.file, tier.size)
    with pytest.raises(DiskTierError, match=rf"reading exp_avg.2 from {tier.file} gave other bytes than were written"):
        tier.read(offset, buffer(4 * ALIGN), "exp_avg.2").wait()
    tier.close()


def test_a_deleted_file_fails_naming_it(tmp_path):
    tier = DiskTier(tmp_path)
    offset = tier.slot(ALIGN)
    os.unlink(tier.file)
    data = buffer(ALIGN)
    read = tier.read(offset, data, "master.0")
    for _ in range(2):  # a failed I/O says so at every wait, never "done" after the first
        with pytest.raises(DiskTierError, match=rf"{tier.file}, which holds master.0, was deleted"):
            read.wait()
    # The failed read is over: its buffer is free again, and what comes next reports the disk's error.
    with pytest.raises(DiskTierError, match=rf"{tier.file}, which holds master.0, was deleted"):
        tier.write(offset, data, "master.0").wait()
    tier.close()


def test_a_full_disk_fails_naming_the_file(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path)
    offset = tier.slot(ALIGN)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "pwritev", full)
    with pytest.raises(DiskTierError, match=rf"writing exp_avg_sq.1 to {tier.file} failed.*is full"):
        tier.write(offset, buffer(ALIGN), "exp_avg_sq.1").wait()
    tier.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_room_the_file_cannot_take_names_why(tmp_path, monkeypatch, code):
    # A file-size limit (`ulimit -f`, FAT32's 4 GiB) was reported as a lack of space, beside the gigabytes free.
    tier = DiskTier(tmp_path)
    tier.slot(ALIGN)

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_module.os, "posix_fallocate", refuse)
    why = "free space under" if code == errno.ENOSPC else f"a file-size limit stops it below {2 * ALIGN} bytes"
    with pytest.raises(DiskTierError, match=rf"cannot reserve {ALIGN} more bytes in {tier.file} .*{why}"):
        tier.slot(ALIGN)
    tier.close()


def test_a_write_that_moves_nothing_fails_instead_of_spinning(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path)
    offset = tier.slot(ALIGN)
    monkeypatch.setattr(disk_module.os, "pwritev", lambda *args: 0)
    with pytest.raises(DiskTierError, match=rf"writing master.2 at {tier.file}"):
        tier.write(offset, buffer(ALIGN), "master.2").wait()
    tier.close()


def test_a_slow_disk_fails_after_the_timeout_naming_the_file(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path)
    offset = tier.slot(ALIGN)
    original = disk_module.os.preadv
    monkeypatch.setattr(disk_module.os, "preadv", lambda *a: (time.sleep(1.0), original(*a))[1])
    tier.timeout = 0.1
    target = buffer(ALIGN)
    token = tier.read(offset, target, "master.3")
    with pytest.raises(DiskTierError, match=rf"read of master.3.*{tier.file}.*has not finished after"):
        token.wait()
    tier.timeout = 10.0
    token.wait()  # it did finish in the end
    tier.close()


def test_a_full_disk_at_prepare_and_disk_memory_are_clear_errors(tmp_path):
    tier = DiskTier(tmp_path, limit=2 * ALIGN)
    tier.slot(ALIGN)
    with pytest.raises(DiskTierError, match="disk_memory=8192"):
        tier.slot(2 * ALIGN)
    tier.close()
    with pytest.raises(DiskTierError, match="is a file"):
        DiskTier(_a_file(tmp_path))
    with pytest.raises(DiskTierError, match="parent .* does not exist"):
        DiskTier(tmp_path / "missing" / "disk")


def _a_file(tmp_path) -> str:
    path = tmp_path / "plain-file"
    path.write_text("x")
    return str(path)


def test_files_go_at_close_and_nothing_is_written_outside(tmp_path):
    root = tmp_path / "disk"
    tier = DiskTier(root)
    tier.slot(ALIGN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]
    assert [p.name for p in tier.directory.iterdir()] and tier.directory.parent == root
    tier.close()
    tier.close()  # idempotent
    assert list(root.iterdir()) == []


KILLED = """
import os, sys, time
from chunkmem.memory.disk import DiskTier
tier = DiskTier(sys.argv[1])
tier.slot(1 << 20)
print(tier.directory, flush=True)
time.sleep(60)
"""


def test_a_killed_run_leaves_files_the_next_start_removes(tmp_path):
    env = dict(os.environ, CHUNKMEM_SIM_CHECK="0")
    live = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    killed = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        live_dir, killed_dir = live.stdout.readline().strip(), killed.stdout.readline().strip()
        killed.kill()
        killed.wait()
        assert os.path.isdir(killed_dir), "kill -9 runs no clean-up"
        tier = DiskTier(tmp_path)  # the next start
        assert not os.path.exists(killed_dir)
        assert os.path.isdir(live_dir), "a live run's files are left alone"
        (tmp_path / "chunkmem-not-ours").mkdir()
        (tmp_path / "chunkmem-not-ours" / "data").write_text("keep")
        assert remove_stale(tmp_path) == []
        tier.close()
    finally:
        live.kill()
        live.wait()
    remove_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunkmem-not-ours"]


def test_files_go_when_the_interpreter_exits(tmp_path):
    script = KILLED.replace("time.sleep(60)", "")
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, capture_output=True,
                   env=dict(os.environ, CHUNKMEM_SIM_CHECK="0"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"),
                                   FileNotFoundError(2, "No such file or directory"),
                                   OSError(30, "Read-only file system")], ids=["permission", "proc", "ro"])
def test_an_unwritable_disk_directory_is_a_disk_tier_error_naming_it(tmp_path, monkeypatch, error) -> None:
    # (Tests run as root here, whom permissions do not stop: the refusal is the file system's, simulated. /proc, which
    # takes no directories, refuses with ENOENT: it came as a bare FileNotFoundError.)
    def refused(self, *args, **kwargs):
        raise type(error)(*error.args, str(self))

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(DiskTierError, match=rf"Config.disk='{tmp_path}': cannot write {tmp_path}/.chunkmem-.*"
                                            f"{error.strerror}"):
        DiskTier(tmp_path)


def test_a_disk_without_locks_is_a_disk_tier_error_leaving_nothing_there(tmp_path, monkeypatch) -> None:
    def refused(*args) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(disk_module.fcntl, "flock", refused)
    with pytest.raises(DiskTierError, match="No locks available"):
        DiskTier(tmp_path)
    assert list(tmp_path.iterdir()) == []
