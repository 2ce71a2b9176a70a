"""The simulation's copy thread lands copies in issue order on idle CPU time, and a copy someone must
know has landed lands at once, on the thread that asks, when the copy thread has not started it."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from chunkmem.memory.landing import WAKE_S, CopyThread, idle_priority_available
from chunkmem.memory.sim import HazardError, SimulatedDevice

pytestmark = pytest.mark.skipif(not idle_priority_available(), reason="no idle scheduling class here (not Linux)")


class Fake:
    """A copy whose landing records which thread landed it, in a shared log, and when it started landing
    (`started`, also shared)."""

    def __init__(self, id: int, log: list[tuple[int, int]], gate: threading.Event | None = None,
                 during: Callable[[], None] | None = None, started: list[int] | None = None) -> None:
        self.id = id
        self.land: Callable[[], None] | None = self._move
        self._log, self._gate, self._during = log, gate, during
        self._started = started if started is not None else []

    def _move(self) -> None:
        self._started.append(self.id)
        if self._gate is not None:
            assert self._gate.wait(10), "gate never opened"
        if self._during is not None:
            self._during()
        self._log.append((self.id, threading.get_ident()))


def eventually(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def settle(copies: list) -> None:
    eventually(lambda: all(c.land is None for c in copies), "the copy thread never landed them")


def test_copies_land_in_issue_order_without_anyone_waiting():
    log: list[tuple[int, int]] = []
    thread = CopyThread()
    copies = [Fake(i, log) for i in range(20)]
    for copy in copies:
        thread.add(copy)
    settle(copies)
    assert [i for i, _ in log] == list(range(20))
    assert {who for _, who in log} != {threading.get_ident()}, "the copy thread landed them, not this one"
    thread.close()


def test_a_thread_asleep_after_copies_stopped_coming_is_woken_by_the_next_issue():
    # While copies come the thread wakes on its own every WAKE_S; after IDLE_S without any it sleeps until an
    # issue wakes it (the Note on waking): a copy issued then must land without anyone waiting for it.
    log: list[tuple[int, int]] = []
    thread = CopyThread()
    first = Fake(0, log)
    thread.add(first)
    settle([first])
    eventually(lambda: thread._queue.asleep, "the thread never went to sleep")
    time.sleep(3 * WAKE_S)  # asleep, it does not look for copies on its own
    later = Fake(1, log)
    thread.add(later)
    settle([later])
    assert [i for i, _ in log] == [0, 1] and threading.get_ident() not in {who for _, who in log}
    thread.close()


def test_a_copy_the_thread_has_not_started_lands_on_the_thread_that_needs_it():
    log: list[tuple[int, int]] = []
    gate = threading.Event()
    thread = CopyThread()
    stuck, needed = Fake(0, log, gate), Fake(1, log)  # two streams' copies: the thread is stuck on the first
    thread.add(stuck)
    thread.add(needed)
    thread.land(needed)
    assert log == [(1, threading.get_ident())] and needed.land is None
    gate.set()
    settle([stuck])
    assert [i for i, _ in log] == [1, 0], "each copy lands once"
    thread.close()


def test_the_thread_does_not_start_the_next_copy_while_an_earlier_one_lands_elsewhere():
    log: list[tuple[int, int]] = []
    gate = threading.Event()
    thread = CopyThread()

    started: list[int] = []

    def meanwhile() -> None:
        gate.set()  # the thread finishes the first copy and could take another now
        time.sleep(0.05)

    first, second, third = (Fake(0, log, gate, started=started), Fake(1, log, during=meanwhile, started=started),
                            Fake(2, log, started=started))
    for copy in (first, second, third):
        thread.add(copy)
    eventually(lambda: bool(started), "the copy thread never started")
    thread.land(second)  # claimed here while the thread waits on the gate
    settle([first, third])
    assert started == [0, 1, 2], "no copy starts while an earlier one lands, and each lands once"
    assert [i for i, _ in log] == [0, 1, 2]
    thread.close()


def test_a_copy_that_fails_on_the_thread_raises_where_it_is_waited_for():
    attempts: list[int] = []

    class Failing(Fake):
        def _move(self) -> None:
            attempts.append(threading.get_ident())
            raise RuntimeError("copy failed")

    thread = CopyThread()
    copy = Failing(0, [])
    thread.add(copy)
    eventually(lambda: bool(attempts), "the copy thread never tried")
    with pytest.raises(RuntimeError, match="copy failed"):
        thread.land(copy)
    assert attempts[-1] == threading.get_ident() and copy.land is not None, "a failed copy has not landed"
    thread.close()


def test_the_thread_runs_at_idle_priority_and_stops_with_its_owner():
    before = {t.ident for t in threading.enumerate() if t.name == "chunkmem-sim-copies"}
    thread = CopyThread()
    (mine,) = [t for t in threading.enumerate() if t.name == "chunkmem-sim-copies" and t.ident not in before]
    policies: list[int] = []
    copy = Fake(0, [], during=lambda: policies.append(os.sched_getscheduler(0)))  # type: ignore[attr-defined]
    thread.add(copy)
    settle([copy])
    assert policies == [os.SCHED_IDLE]  # type: ignore[attr-defined]
    del thread
    gc.collect()
    mine.join(10)
    assert not mine.is_alive(), "the copy thread outlived its device"


def test_background_landing_gives_the_same_bytes_and_keeps_the_checker_strict():
    dev = SimulatedDevice(landing="background")
    host = dev.host_alloc(1 << 16, torch.float32).copy_(torch.randn(1 << 16))
    device = dev.alloc(1 << 16, torch.float32)
    token = dev.upload(host, device, "param.0")
    settle([token])  # landed by the copy thread; compute has not learned it
    with pytest.raises(HazardError, match="upload of param.0"):
        device.sum()
    dev.wait(token)
    assert torch.equal(device.to("cpu", copy=True), host)  # a download: CUDA compares on one device
    back = dev.host_alloc(1 << 16, torch.float32)
    down = dev.download(device * 2, back, "grad.0")
    dev.wait_host(down)
    assert torch.equal(back, host * 2)
