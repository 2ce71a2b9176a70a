"""Saved activations: counted once per storage, and released without running Python code."""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch

from chunkmem.runtime.activations import ActivationMeter


def test_storages_are_counted_once_and_released_when_autograd_drops_them() -> None:
    meter = ActivationMeter()
    base = torch.zeros(256)
    first, second, other = meter.wrap(base), meter.wrap(base[:10]), meter.wrap(torch.zeros(64))
    assert meter.live == meter.peak == 256 * 4 + 64 * 4
    del first
    assert meter.live == 256 * 4 + 64 * 4  # the view still holds the storage
    del second, other
    assert meter.live == 0 and meter.peak == 256 * 4 + 64 * 4


def test_a_reused_address_is_a_new_storage() -> None:
    meter = ActivationMeter()
    saved = meter.wrap(torch.zeros(1024))
    del saved  # its storage is freed; the allocator may hand the same address out again at once
    again = meter.wrap(torch.zeros(16))
    assert meter.live == 16 * 4 and again is not None


def test_an_interrupt_while_saved_tensors_die_is_not_swallowed(monkeypatch: Any) -> None:
    """Issue 15, item 1: a KeyboardInterrupt raised in a release callback used to be printed as
    "Exception ignored" and lost. A signal handler runs at the next Python instruction; the profile
    hook below raises where that instruction would be, in any Python function called while a
    saved tensor dies. Nothing may swallow it."""
    swallowed: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: swallowed.append(info.exc_value))
    meter = ActivationMeter()
    weight = torch.randn(8, 8, requires_grad=True)
    # No op here saves its own output: that would be a reference cycle only backward breaks.
    with torch.autograd.graph.saved_tensors_hooks(meter.wrap, lambda saved: saved.get(meter)):
        hidden = torch.sin(torch.randn(4, 8) @ weight)
        loss = (hidden * hidden).sum()
    del hidden
    assert meter.live > 0
    called: list[str] = []

    def interrupt(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            called.append(frame.f_code.co_name)
            raise KeyboardInterrupt

    interrupted = False
    while gc.collect():  # garbage earlier tests left (their finalizers run Python code) goes before the hook is on:
        pass  # all of it, also what a first pass only freed (a parameter autograd's C++ side still held)
    sys.setprofile(interrupt)
    try:
        del loss  # autograd's graph, and with it every saved activation, goes now
        gc.collect()
    except KeyboardInterrupt:
        interrupted = True  # reached the caller: fine, that is where an interrupt belongs
    finally:
        sys.setprofile(None)
    assert not [e for e in swallowed if isinstance(e, KeyboardInterrupt)], called
    assert meter.live == 0 or interrupted
    assert meter.live == 0
