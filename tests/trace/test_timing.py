"""The time model (chunkmem/trace/timing.py) on steps small enough to time by hand."""

from __future__ import annotations

import pytest

from chunkmem.chunks.plan import Action, Plan
from chunkmem.chunks.planning import Event, GroupChunks, Step
from chunkmem.trace.timing import Cores, Recorded, Speeds, predict

MB = 10**6
# 1 MB/ms each way; kernels of 1 ms per forward module when the stage's 2 ms are shared by two equal modules.
SPEEDS = Speeds(h2d=1e9, d2h=1e9, host_update=1e9, device_update=1e9, compute={"fwd": 2e-3, "bwd": 0.0}, host={})
SIZES = {"a": MB, "b": MB}


def two_modules(actions: tuple[Action, ...], host: dict[str, float] | None = None) -> tuple[Recorded, Speeds]:
    events = [Event("use", ("a",), -1, 0), Event("use", ("b",), -1, 0)]
    step = Step.of(events, {}, (), SIZES, 10 * MB)
    recorded = Recorded(events, ["fwd", "fwd"], [], frozenset(), SIZES, step, Plan(actions, (2 * MB, 2 * MB)))
    speeds = Speeds(SPEEDS.h2d, SPEEDS.d2h, SPEEDS.host_update, SPEEDS.device_update, SPEEDS.compute, host or {})
    return recorded, speeds


def test_resident_chunks_cost_the_compute_alone() -> None:
    got = predict(*two_modules(()))
    assert got.step_s == pytest.approx(2e-3) and got.copy_s == 0 and got.h2d_bytes == 0


def test_a_fetch_on_demand_waits_and_a_prefetch_hides_behind_the_compute_before() -> None:
    # The host takes 1 ms to issue each access, as long as its kernel: the GPU waits on it, and a fetch issued
    # with access 1 lands 1 ms after it was issued, while nothing else runs.
    paced = {"fwd": 2e-3}
    waited = predict(*two_modules((Action(1, "fetch", "b"),), paced))
    assert waited.step_s == pytest.approx(4e-3) and waited.overlap == pytest.approx(0.0)
    ahead = predict(*two_modules((Action(1, "prefetch", "b"),), paced))  # issued with access 0, under its kernel
    assert ahead.step_s == pytest.approx(3e-3) and ahead.overlap == pytest.approx(1.0)
    assert waited.h2d_bytes == ahead.h2d_bytes == MB


def test_host_time_beyond_the_kernels_sets_the_pace() -> None:
    got = predict(*two_modules((), host={"fwd": 6e-3}))  # 3 ms of host work before each 1 ms kernel
    assert got.step_s == pytest.approx(7e-3)


def test_a_streamed_group_waits_for_its_gradient_updates_on_the_host_and_sends_its_parameters_up() -> None:
    group = GroupChunks(0, "p", "g", ("m",), nbytes=3 * MB, streamed=MB)
    sizes = {"p": MB, "g": MB, "m": MB}
    events = [Event("use", ("p",), -1, 0), Event("grad", ("g",), 0, 0), Event("optim", ("p", "g", "m"), 0, 0)]
    step = Step.of(events, {0: group}, (), sizes, 10 * MB)
    speeds = Speeds(1e9, 1e9, 1e9, 1e9, {"bwd": 1e-3}, {})
    got = predict(Recorded(events, ["bwd", "bwd", "optim"], [group], frozenset(), sizes, step,
                           Plan((), (MB,))), speeds)
    # 1 ms backward, the gradient down (1 ms), the update of p, g, m (3 ms), p up (1 ms).
    assert got.step_s == pytest.approx(6e-3) and got.host_update_s == pytest.approx(3e-3)
    assert (got.h2d_bytes, got.d2h_bytes) == (MB, MB)
    assert got.bound(2e-3, speeds) == pytest.approx(3e-3)  # the host update alone


def two_streamed_groups() -> Recorded:
    """Two streamed groups of 4 MB to update (parameter and gradient 1 MB each, master and state 2 MB), each
    module's backward followed by its gradient going down, then the optimizer's step."""
    groups = [GroupChunks(i, f"p{i}", f"g{i}", (f"m{i}",), nbytes=4 * MB, streamed=MB) for i in (0, 1)]
    sizes = {name: MB for i in (0, 1) for name in (f"p{i}", f"g{i}")} | {"m0": 2 * MB, "m1": 2 * MB}
    events = [Event("use", ("p1",), -1, 0), Event("grad", ("g1",), 1, 0), Event("use", ("p0",), -1, 0),
              Event("grad", ("g0",), 0, 0), Event("optim", ("p0", "g0", "m0"), 0, 0),
              Event("optim", ("p1", "g1", "m1"), 1, 0)]
    step = Step.of(events, dict(enumerate(groups)), (), sizes, 10 * MB)
    return Recorded(events, ["bwd"] * 4 + ["optim"] * 2, groups, frozenset(), sizes, step, Plan((), (MB, MB)))


def test_host_updates_overlapping_backward_start_as_their_gradients_land_copying_them_first_where_asked() -> None:
    """`overlap` (issue 36's speculative update, predicted): each streamed group updates on a thread of its own once
    its gradients have landed, in the order they land, with `copy_grads` copying them first (read and written: 2 ms
    here); its parameters go up once backward has ended (the step adopts the update)."""
    recorded = two_streamed_groups()
    speeds = Speeds(1e9, 1e9, 1e9, 1e9, {"bwd": 10e-3}, {})
    after = predict(recorded, speeds)
    # 5 ms per module's backward; g1 down 5-6 ms, g0 10-11; after backward: g0 updates 11-15, p0 up 15-16, g1 15-19,
    # p1 up 19-20.
    assert after.step_s == pytest.approx(20e-3)
    during = predict(recorded, speeds, overlap=True, copy_grads=True)
    # g1 copied and updated 6-12, p1 up 12-13 (backward ended at 10); g0 (landed at 11) 12-18, p0 up 18-19.
    assert during.step_s == pytest.approx(19e-3)
    # Without copies: g1 updated 6-10, p1 up 10-11; g0 11-15, p0 up 15-16.
    assert predict(recorded, speeds, overlap=True).step_s == pytest.approx(16e-3)
    assert during.host_update_s == after.host_update_s == pytest.approx(8e-3), "the copies are not the update"
    assert (during.h2d_bytes, during.d2h_bytes) == (after.h2d_bytes, after.d2h_bytes) == (2 * MB, 2 * MB)


def test_a_team_updating_ahead_slows_the_host_beside_it_and_runs_at_its_own_measured_speed() -> None:
    """Updates made ahead share the host's cores (the Note's contention): a host-bound backward, 2 ms of host work
    per event, no kernel time. Without contention: g1 lands at 5 ms and updates 5-9, g0 lands at 9 and updates 9-13,
    p0 up 13-14. With the cores measured as a team of 8 updating at 1 GB/s and leaving a launching thread half its
    rate, a team of 16 at 2 GB/s leaving a quarter: g1 updates on 8 threads until backward's last kernel ends (at
    6 ms: 1 MB), then on 16 (3 MB, 6-7.5 ms); the host event issued at 6 (g0's gradient) runs beside the team of
    16, 8 ms rather than 2, so g0 lands at 15, updates 15-17 and p0 goes up 17-18."""
    recorded = two_streamed_groups()

    def step_s(cores: Cores | None) -> float:
        return predict(recorded, Speeds(1e9, 1e9, 1e9, 1e9, {"bwd": 0.0}, {"bwd": 8e-3}, cores), overlap=True).step_s

    assert step_s(None) == pytest.approx(14e-3)
    assert step_s(Cores({}, {8: 1e9, 16: 1e9}, {8: 1.0, 16: 1.0}, backward_team=8, team=16)) == pytest.approx(14e-3)
    assert step_s(Cores({}, {8: 1e9, 16: 2e9}, {8: 0.5, 16: 0.25}, backward_team=8, team=16)) == pytest.approx(18e-3)
    # Plain PyTorch's own launches are host work too: 1 ms more per backward event (a team beside it slowing
    # nothing here): g0's gradient is issued at 12 ms, lands at 13, updates 13-17, p0 up 17-18.
    assert step_s(Cores({"bwd": 4e-3}, {8: 1e9}, {8: 1.0}, backward_team=8, team=8)) == pytest.approx(18e-3)
