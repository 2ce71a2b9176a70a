"""The simulation's copy engine: a thread that lands copies beside compute, on CPU time compute leaves idle.

On a GPU the copy engines move bytes while the SMs compute, so a copy issued early enough costs the
step nothing. The simulation's compute is the CPU, and a copy landed on the compute thread (when someone
learns of it: sim.py's "wait" landing) costs the step its whole memcpy. With "background" landing, a
thread of the lowest scheduling class (Linux's SCHED_IDLE: it runs only on a core nothing else wants)
lands every copy in issue order as soon as it can; learning of a copy the thread has not landed yet
lands it on the spot, as before. So copies overlap what leaves a core idle (Python between ops, waits),
never compute itself: a copy thread of normal priority measured no faster, its copies slowing the
compute they shared cores with.

[Note: order]
At most one copy runs on the thread, and the thread takes copies strictly in issue order: it never
starts one while an earlier one is landing on the compute thread. The compute thread lands what it
needs in issue order too. So copies of one stream never run at the same time, as on a GPU, where a
stream runs its copies one after another; copies of two streams may, as on two copy engines.

[Note: waking]
Issuing a copy does not wake the thread: while copies come, it wakes on its own every WAKE_S and lands what is
queued; once it has found none for IDLE_S, it sleeps until the next issue wakes it. A wake-up per copy cost the
compute thread more than the copy's own bookkeeping: the woken thread takes the GIL, and each hand-off is a
forced switch. In benchmarks/overhead.py's launch-bound LLaMA at half its model data (131 gradient downloads a
step), the compute thread's CPU time per step was 29-31 ms more than plain PyTorch's with a wake-up per issue, and
20-21 ms with a wake-up every 1-5 ms (17-19 ms with no thread at all: CHUNKMEM_SIM_LANDING=wait), where a GPU's
host pays a call to its copy engine and nothing more. Copies land up to WAKE_S later than before: later is the
strict direction (whoever needs one lands it at once), and the share of copies landed where they are waited for
(benchmarks' "copies %") says what that costs.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

WAKE_S = 0.002  # how often the thread looks for copies while they come (the Note on waking)
IDLE_S = 0.05  # how long it looks and finds none before it sleeps until a copy is issued


class Landable(Protocol):
    """A copy in flight (sim.Copy): `land` moves its bytes, None once it has landed, as is `held`, the buffer
    it keeps alive until then."""

    id: int
    land: Callable[[], Any] | None
    held: Any


def idle_priority_available() -> bool:
    """Whether a thread can put itself in the idle scheduling class here (Linux)."""
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")


class CopyThread:
    """Lands copies in issue order on a thread of idle priority (the module's Note on order). The thread stops
    when this object is collected (its device is) or the interpreter exits, after the copy it is landing."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child starts a thread of its own (the parent's is not there)
        self._queue = _Queue()
        thread = threading.Thread(target=self._queue.run, name="chunkmem-sim-copies", daemon=True)
        thread.start()
        # Also at exit, before the interpreter tears torch down: a thread left inside a torch op aborts it.
        self._finalizer = weakref.finalize(self, self._queue.close, thread)

    def add(self, copy: Landable) -> None:
        self._queue.add(copy)

    def land(self, copy: Landable) -> None:
        """Make sure `copy` has landed, landing it here if the thread has not started it."""
        self._queue.land(copy)

    @property
    def landed(self) -> int:
        """Copies the thread landed (the others landed where someone waited for them)."""
        return self._queue.landed

    def close(self) -> None:
        self._finalizer()


class _Queue:
    """The state the compute thread and the copy thread share, under one condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.copies: collections.deque[Landable] = collections.deque()
        self.landing: Landable | None = None  # the copy the copy thread is landing
        self.claimed: Landable | None = None  # the copy the compute thread is landing
        self.closed = False
        self.asleep = False  # the copy thread waits for an issue to wake it (the Note on waking)
        self.landed = 0  # by the copy thread

    def add(self, copy: Landable) -> None:
        with self.cond:
            self.copies.append(copy)
            if self.asleep:  # else it wakes on its own within WAKE_S (the Note on waking)
                self.asleep = False
                self.cond.notify_all()

    def land(self, copy: Landable) -> None:
        with self.cond:
            while self.landing is copy:
                self.cond.wait()
            move = copy.land
            if move is None:
                return
            self.claimed = copy
        self._move(copy, move)

    def run(self) -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
        while True:
            with self.cond:
                idle_since = time.monotonic()
                while not self.copies and not self.closed:
                    self.asleep = time.monotonic() - idle_since > IDLE_S
                    self.cond.wait(None if self.asleep else WAKE_S)
                self.asleep = False
                if self.closed:
                    return
                copy = self.copies[0]
                if copy is self.claimed:  # landing on the compute thread: the next waits for it (Note on order)
                    self.cond.wait()
                    continue
                self.copies.popleft()
                move = copy.land
                if move is None:
                    continue
                self.landing = copy
            try:
                self._move(copy, move)
                self.landed += 1
            except Exception:  # noqa: BLE001  left unlanded: whoever waits for it lands it again and sees the error
                pass
            del move  # its closure holds the copy's buffers: free them for reuse before waiting for the next

    def _move(self, copy: Landable, move: Callable[[], Any]) -> None:
        """Land `copy` (claimed by this thread), and mark it landed; if it fails, it stays unlanded."""
        landed = False
        try:
            move()
            landed = True
        finally:
            with self.cond:
                if landed:
                    copy.land = copy.held = None
                if self.landing is copy:
                    self.landing = None
                if self.claimed is copy:
                    self.claimed = None
                self.cond.notify_all()

    def close(self, thread: threading.Thread) -> None:
        with self.cond:
            self.closed = True
            self.copies.clear()
            self.cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()
