"""SIGINT/SIGTERM during training: the first asks to stop, the second aborts, handlers are put back."""

from __future__ import annotations

import os
import signal

import pytest

from chunkmem.finetune.interrupt import StopOnSignal


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_asks_second_aborts_and_handlers_come_back(signum: int, capfd: pytest.CaptureFixture) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt, match="second"):
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signum)
            for _ in range(1000):  # the handler runs at the next instructions
                pass
            assert stop.signal == signum
            assert "send it again to abort now" in capfd.readouterr().err
            os.kill(os.getpid(), signum)
            for _ in range(1000):
                pass
            raise AssertionError("the second signal did not abort")
    assert {s: signal.getsignal(s) for s in before} == before


def test_nothing_changes_without_a_signal() -> None:
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal() as stop:
        assert signal.getsignal(signal.SIGINT) != before
    assert stop.signal is None and signal.getsignal(signal.SIGINT) == before
