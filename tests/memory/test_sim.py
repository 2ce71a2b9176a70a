"""The simulated device holds copies to CUDA's rules: they land late, and an access that a missing fence
would leave racing on a GPU raises, naming the buffer, the copy and the op."""

from __future__ import annotations

import pytest
import torch

from chunkmem.memory import sim
from chunkmem.memory.sim import HazardError, SimulatedDevice


def pair(dev: SimulatedDevice, value: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    host = dev.host_alloc(8, torch.float32).fill_(value)
    return host, dev.alloc(8, torch.float32)


def test_an_upload_lands_only_when_compute_waits_for_it():
    dev = SimulatedDevice()
    host, device = pair(dev)
    token = dev.upload(host, device, "param.0")
    with sim.paused():
        assert device.isnan().all(), "fresh device memory is poison until the upload lands"
    dev.wait(token)
    assert torch.equal(device.to("cpu", copy=True), host)  # a download: CUDA compares on one device


def test_copies_keep_the_copy_engines_rules():
    # torch's copy_ here casts and follows strides; the CUDA copy engine copies bytes between flat buffers of one dtype
    # and refuses anything else, so a caller that relied on a cast passed here and failed on a GPU.
    dev = SimulatedDevice()
    host, device = pair(dev)
    with pytest.raises(RuntimeError, match="pair 0 has 32 bytes for 16 bytes, or another dtype"):
        dev.download(device, dev.host_alloc(8, torch.bfloat16))
    with pytest.raises(RuntimeError, match="pair 0 is not contiguous"):
        dev.upload(dev.host_alloc(16, torch.float32)[::2], device)
    dev.wait(dev.upload(host, device))  # one dtype, flat: as the engine copies


def test_the_copy_clock_runs_while_bytes_land_not_when_copies_are_issued():
    dev = SimulatedDevice(landing="wait")  # not at random, whatever CHUNKMEM_SIM_LANDING says
    host, device = dev.host_alloc(1 << 22, torch.float32), dev.alloc(1 << 22, torch.float32)
    token = dev.upload(host, device, "param.0")
    assert dev.copy_seconds == 0.0, "issuing a copy moves no bytes"
    dev.wait(token)
    landed = dev.copy_seconds
    assert landed > 0.0
    dev.wait(token)
    assert dev.copy_seconds == landed, "a copy lands once"


@pytest.mark.parametrize("op", [lambda d: d.sum(), lambda d: d.add_(1)], ids=["read", "write"])
def test_compute_touching_an_upload_it_did_not_wait_for_raises(op):
    dev = SimulatedDevice()
    host, device = pair(dev)
    dev.upload(host, device, "param.3")
    with pytest.raises(HazardError, match=r"compute op aten\.\S+ (reads|writes) .* upload of param\.3 .*Device\.wait"):
        op(device)


def test_views_and_metadata_are_not_accesses():
    dev = SimulatedDevice()
    host, device = pair(dev)
    dev.upload(host, device)
    view = device[2:6].view(2, 2)  # pointing parameters at a chunk moves no bytes
    assert view.shape == (2, 2) and view.is_pinned() is False


def test_the_host_may_not_change_an_upload_source_until_it_knows_the_upload_landed():
    dev = SimulatedDevice()
    host, device = pair(dev)
    token = dev.upload(host, device, "master.1")
    host.sum()  # reading is fine: the copy only reads too
    dev.wait(token)  # compute knows; the host does not
    with pytest.raises(HazardError, match=r"host op .* writes .* upload of master\.1"):
        host.fill_(0.0)
    dev.wait_host(token)
    host.fill_(0.0)


def test_the_host_learns_of_an_upload_through_a_later_download_fenced_after_compute_waited():
    dev = SimulatedDevice()
    host, device = pair(dev)
    up = dev.upload(host, device)
    dev.wait(up)
    out_host, out_device = dev.host_alloc(8, torch.float32), device * 2
    down = dev.download(out_device, out_host)  # ordered after compute, which waited for the upload
    dev.wait_host(down)
    host.fill_(0.0)  # so the upload has landed: no hazard
    assert torch.equal(out_host, torch.full((8,), 6.0))


def test_a_download_lands_when_the_host_waits_and_guards_both_ends():
    dev = SimulatedDevice()
    host = dev.host_alloc(8, torch.float32).zero_()
    device = dev.alloc(8, torch.float32).fill_(5.0)
    token = dev.download(device, host, "grad.2")
    device.sum()  # compute may read what a download reads
    with pytest.raises(HazardError, match=r"compute op .* writes .* download of grad\.2"):
        device.fill_(1.0)
    with pytest.raises(HazardError, match=r"host op .* reads .* download of grad\.2 .*wait_host"):
        host.sum()
    dev.wait_host(token)
    assert torch.equal(host, torch.full((8,), 5.0))
    device.fill_(1.0)


def test_a_thread_that_waited_for_a_download_may_read_what_it_wrote_and_the_host_still_may_not():
    """Device.wait_landed (a worker beside the host: runtime/ahead.py) teaches the waiting thread alone, as a CUDA
    thread that synchronized on the copy's event; the native kernel's reads are checked as ATen ops are."""
    import threading

    dev = SimulatedDevice(landing="random:0")
    host = dev.host_alloc(8, torch.float32).zero_()
    token = dev.download(dev.alloc(8, torch.float32).fill_(5.0), host, "grad.2")
    read: list[BaseException | None] = []

    def worker(wait: bool) -> None:
        try:
            if wait:
                dev.wait_landed(token)
            sim.check_unseen("the native adam_step", [host], [])
            read.append(None)
        except HazardError as error:
            read.append(error)

    for wait in (False, True):
        thread = threading.Thread(target=worker, args=(wait,))
        thread.start()
        while thread.is_alive():
            thread.join(0.01)
            dev.alloc(1, torch.float32)  # the device goes on: copies land at random moments
    assert isinstance(read[0], HazardError) and read[1] is None
    with pytest.raises(HazardError, match=r"host op .* reads .* download of grad\.2 .*wait_host"):
        host.sum()
    dev.wait_host(token)
    assert torch.equal(host, torch.full((8,), 5.0))


def test_only_overlapping_bytes_conflict():
    dev = SimulatedDevice()
    host = dev.host_alloc(16, torch.float32).zero_()
    device = dev.alloc(8, torch.float32).fill_(1.0)
    dev.download(device, host[8:])  # a gradient landing in the second half of a chunk
    host[:8].add_(2.0)  # the first half is free to use
    with pytest.raises(HazardError):
        host[4:12].sum()


def test_a_copy_into_bytes_another_stream_still_uses_raises_unless_fenced_after_it():
    # An eviction's download still reads a slot when the next chunk's upload fills it: on a GPU the two race
    # (the simulation could land them either way), unless the upload is ordered after the download.
    dev = SimulatedDevice()
    evicted = dev.host_alloc(8, torch.float32)
    host, device = pair(dev)
    device.fill_(1.0)
    down = dev.download(device, evicted, "param.0")
    with pytest.raises(HazardError, match=r"issuing the upload of param\.1 .* writes .* download of param\.0"):
        dev.upload(host, device, "param.1")
    up = dev.upload(host, device, "param.1", after=down)
    dev.wait(up)
    dev.wait_host(down)
    assert torch.equal(evicted, torch.ones(8)), "the download read the old bytes"
    assert torch.equal(device.to("cpu", copy=True), host)
    # Two copies that only read a buffer do not race: two uploads from one host buffer.
    dev.upload(host, dev.alloc(8, torch.float32))
    dev.upload(host, dev.alloc(8, torch.float32))


def test_the_native_kernel_is_checked_as_aten_ops_are():
    # The native CPU optimizer is a pybind call the dispatcher never sees: reading a gradient whose download has
    # not landed would compute on stale bytes, silently, unless it is checked too.
    native = pytest.importorskip("chunkmem.memory.native")
    if native.load() is None:
        pytest.skip("the native extension is unavailable here")
    dev = SimulatedDevice()
    grad, master, exp_avg, exp_avg_sq = (dev.host_alloc(8, torch.float32).zero_() for _ in range(4))
    token = dev.download(dev.alloc(8, torch.float32).fill_(1.0), grad, "grad.4")
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, step=1)
    with pytest.raises(HazardError, match=r"host op the native adam_step reads .* download of grad\.4"):
        native.adam_step(master, grad, exp_avg, exp_avg_sq, None, **args)
    assert torch.equal(master, torch.zeros(8)), "refused before it ran"
    dev.wait_host(token)
    native.adam_step(master, grad, exp_avg, exp_avg_sq, None, **args)
    assert (master < 0).all()


def test_discarding_a_prefetch_lets_the_host_rewrite_its_source():
    dev = SimulatedDevice()
    host, device = pair(dev)
    token = dev.upload(host, device)
    dev.discard(token)  # dropped before use: whatever it copies is never read
    host.fill_(0.0)


def test_random_landing_lands_copies_in_stream_order_and_never_changes_results():
    dev = SimulatedDevice(landing="random:7")
    hosts = [dev.host_alloc(4, torch.float32).fill_(float(i)) for i in range(20)]
    devices = [dev.alloc(4, torch.float32) for _ in hosts]
    tokens = [dev.upload(h, d) for h, d in zip(hosts, devices)]
    with sim.paused():
        landed = [not d.isnan().any().item() for d in devices]
    assert any(landed) and not all(landed), "some copies land early, some later"
    assert landed == sorted(landed, reverse=True), "in stream order: a landed copy's predecessors landed"
    for token, host, device in zip(tokens, hosts, devices):
        dev.wait(token)
        assert torch.equal(device.to("cpu", copy=True), host)


def test_a_bad_landing_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"CHUNKMEM_SIM_LANDING='soon': expected 'background', 'wait' or 'random:SEED'"):
        SimulatedDevice(landing="soon")


def test_synchronize_lands_everything_and_both_sides_know():
    dev = SimulatedDevice()
    host, device = pair(dev)
    dev.upload(host, device)
    dev.synchronize()
    host.fill_(1.0)
    assert torch.equal(device, torch.full((8,), 3.0))
    later_host, later_device = pair(dev, 9.0)
    dev.upload(later_host, later_device)  # issued after the synchronize: not known yet
    with pytest.raises(HazardError):
        later_device.sum()


def test_a_block_under_a_copy_in_flight_is_not_reused():
    dev = SimulatedDevice(landing="wait")
    host, device = pair(dev)
    address = device.data_ptr()
    token = dev.upload(host, device, "param.0")
    del device
    assert dev.alloc(8, torch.float32).data_ptr() != address, "the upload still writes it"
    dev.wait(token)


def test_a_pinned_host_block_given_up_before_its_copy_landed_goes_to_its_next_user_with_the_copy_still_on_it():
    """CUDA keeps nothing of a pinned host buffer alive for a copy: its last view may die first, and the pool hands
    the block to the next request of its size, whose bytes the copy then reads or writes (the Note on host
    buffers). Its next user may touch them once the host knows the copy landed, and copy onto them after it."""
    dev = SimulatedDevice(landing="wait")
    host = dev.host_alloc(8, torch.float32).zero_()
    device = dev.alloc(8, torch.float32).fill_(5.0)
    address = host.data_ptr()
    down = dev.download(device, host, "grad.2")
    del host  # given up in flight: the pool has it back
    reused = dev.host_alloc(8, torch.float32)
    assert reused.data_ptr() == address, "the block went to the next request of its size"
    with pytest.raises(HazardError, match=r"host op .* writes .* download of grad\.2 .*wait_host"):
        reused.fill_(1.0)
    source = dev.alloc(8, torch.float32)
    with pytest.raises(HazardError, match=r"issuing the upload of param\.3 .* download of grad\.2"):
        dev.upload(reused, source, "param.3")  # on another stream, fenced after no wait for the download
    dev.wait_host(down)
    assert torch.equal(reused, torch.full((8,), 5.0)), "the download landed in the new user's bytes, as on CUDA"
    reused.fill_(1.0)  # known landed: the bytes are the new user's


def test_an_upload_from_a_given_up_pinned_block_reads_what_its_next_user_wrote_there():
    dev = SimulatedDevice(landing="wait")
    host = dev.host_alloc(8, torch.float32).fill_(3.0)
    device = dev.alloc(8, torch.float32)
    up = dev.upload(host, device, "param.0")
    del host
    reused = dev.host_alloc(8, torch.float32)
    reused.sum()  # reading bytes an upload reads races with nothing
    with pytest.raises(HazardError, match=r"host op .* writes .* upload of param\.0"):
        reused.fill_(9.0)
    with sim.paused():
        reused.fill_(9.0)  # as a racing host write would, on CUDA
    dev.wait(up)
    assert torch.equal(device.to("cpu", copy=True), torch.full((8,), 9.0)), "the upload read the new user's bytes"


def test_a_given_up_pinned_block_keeps_the_copies_the_host_does_not_know_landed_though_compute_waited():
    dev = SimulatedDevice(landing="wait")
    host = dev.host_alloc(8, torch.float32).fill_(3.0)
    up = dev.upload(host, dev.alloc(8, torch.float32), "param.0")
    dev.wait(up)  # compute waited (the copy landed): the host knows nothing
    del host
    reused = dev.host_alloc(8, torch.float32)
    with pytest.raises(HazardError, match=r"host op .* writes .* upload of param\.0"):
        reused.fill_(9.0)
    dev.wait_host(up)
    reused.fill_(9.0)


def test_a_storage_that_dies_while_the_checker_forgets_takes_its_hazards_with_it():
    """Storages die on the copy thread and in collections at any moment: one that dies while `forget` walks the
    hazards (here: inside its test) leaves no KeyError and no hazard behind for the next storage at its address."""
    dev = SimulatedDevice(landing="wait")
    token = dev.upload(*pair(dev), "param.0")
    checker = sim._active
    assert checker is not None, "the suite runs with the checker on (conftest)"
    doomed = [torch.zeros(8), torch.zeros(8)]
    for tensor in doomed:
        sim.guard(dev, token, tensor, "host", write_only=False)
    addresses = {t.untyped_storage().data_ptr() for t in doomed}
    del tensor

    def done(hazard: sim.Hazard) -> bool:
        doomed.clear()  # both buffers die now, in the middle of the walk
        return False

    checker.forget(done)
    assert not addresses & set(checker.hazards), "a dead storage's hazards are gone, not put back"
    dev.wait(token)


def test_an_in_place_foreach_op_moves_version_counters_under_the_simulations_modes_as_it_does_without():
    """Under a dispatch mode torch leaves them as they were; the simulation's modes move them as a CUDA run (no
    mode) does, so a change made through `_foreach_mul_` (torch's clip_grad_norm_) is seen (runtime/ahead.py)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_dispatch_mode_stack(), "the suite runs the simulation's modes (conftest)"
    flat = torch.zeros(8)
    views = [flat[:4], flat[4:]]
    before = flat._version
    torch._foreach_mul_(views, 2.0)
    assert flat._version > before
    before = flat._version
    torch._foreach_mul(views, 2.0)
    assert flat._version == before, "an op that writes nothing moves nothing"
