"""Recording: the trace agrees with the chunk runtime to the byte; observer mode on a plain model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chunkmem
from chunkmem.chunks.observe import Moment, Move
from chunkmem.trace import TraceError, read_trace
from chunkmem.trace.recorder import Retention
from chunkmem.trace.report_data import build
from chunkmem.trace.schema import MODEL_KINDS, SCHEMA, total
from tests.helpers import gpt2_batches, mlp, mlp_batches, mlp_loss, param_bytes, tiny_gpt2
from tests.runtime.test_disk_tier import model_data


class Books:
    """A second observer that copies what the runtime itself says at every moment."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.seen: list[tuple[int, int, dict, dict]] = []

    def moment(self, moment: Moment) -> None:
        self.seen.append((moment.step, moment.index, self.runtime.data.model_bytes(), self.runtime.memory_stats()))

    def moved(self, move: Move) -> None:
        pass


def test_categories_equal_runtime_at_every_moment(tmp_path: Path) -> None:
    model = tiny_gpt2(layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = chunkmem.prepare(model, optimizer, chunkmem.Config(device="cpu", device_memory=300_000,
                                                                          dtype="bf16"))
    books = Books(model.runtime)
    with chunkmem.trace(tmp_path, model=model, optimizer=optimizer, keep_warmup=10):
        model.runtime.observers.append(books)
        for ids in gpt2_batches(3):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    moments = read_trace(tmp_path).ranks[0].moments
    assert len(moments) == len(books.seen) > 50
    for record, (step, index, sides, stats) in zip(moments, books.seen):
        assert (record["step"], record["i"]) == (step, index)
        for side in ("device", "host"):
            expected = {k: v for k, v in sides[side].items() if v}
            assert {k: record[side][k] for k in MODEL_KINDS if k in record[side]} == expected
        assert total(record["device"]) == stats["device_chunk_bytes"]
        assert total(record["host"]) == stats["model_data_bytes"]
        assert "master" in record["host"]  # bf16: fp32 master weights are their own category
        # Every host payload comes from chunkmem's pool, pinned (the simulation's twin counts as pinned).
        assert record["host"]["pinned_chunkmem"] == stats["host_pinned_bytes"] >= stats["model_data_bytes"]


def test_layout_meta_and_host_readings(tmp_path: Path) -> None:
    model = tiny_gpt2(layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = chunkmem.prepare(model, optimizer, chunkmem.Config(device="cpu", device_memory=300_000,
                                                                          dtype="bf16"))
    with chunkmem.trace(tmp_path, model=model, optimizer=optimizer):
        for ids in gpt2_batches(2):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    layout = json.loads((tmp_path / "layout.rank0.json").read_text())
    # What the store holds, read off the chunks' own host buffers.
    held = {c.name: c.host.untyped_storage().nbytes() for c in model.runtime.store.chunks()}
    assert {c["name"]: c["bytes"] for c in layout["chunks"]} == held
    assert sum(held.values()) == model.memory_stats()["model_data_bytes"]
    assert {c["kind"] for c in layout["chunks"]} == {"param", "grad", "master", "exp_avg", "exp_avg_sq"}
    members = {m["name"] for c in layout["chunks"] if c["kind"] == "param" for m in c["members"]}
    assert members == {name for name, _ in model.module.named_parameters()}  # tied weights appear once
    assert layout["device_limit_bytes"] == 300_000
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["argv"] == sys.argv and meta["schema"] == SCHEMA
    assert (meta["chunkmem"], meta["torch"]) == (chunkmem.__version__, torch.__version__)
    assert meta["python"] == sys.version.split()[0] and meta["config"]["dtype"] == "bf16"
    moments = read_trace(tmp_path).ranks[0].moments
    assert all(m["host"]["rss"] > total(m["host"]) for m in moments)  # the process holds more than its chunks


def test_observer_mode_reports_plain_adam_exactly(tmp_path: Path) -> None:
    model = mlp(width=16, depth=2)
    optimizer = torch.optim.Adam(model.parameters())
    with chunkmem.trace(tmp_path, model=model, optimizer=optimizer):
        for batch in mlp_batches(2, width=16):
            mlp_loss(model, batch).backward()
            optimizer.step()
    rank = read_trace(tmp_path).ranks[0]
    assert rank.header["source"] == "observer"
    last = rank.moments[-1]  # post_optimizer of step 1: params, grads and both Adam states exist
    size = param_bytes(model)
    assert last["name"] == "post_optimizer"
    assert (last["device"]["param"], last["device"]["grad"], last["device"]["exp_avg"],
            last["device"]["exp_avg_sq"]) == (size, size, size, size)
    assert last["device"]["optim_other"] == 4 * len(list(model.parameters()))  # Adam's fp32 `step` scalars
    first = rank.moments[0]
    assert first["device"] == {"param": size, "allocated": size, "reserved": size}
    assert max(m["device"].get("nonmodel", 0) for m in rank.moments) > 0  # saved activations were seen


def test_retention_keeps_warmup_and_last_steps(tmp_path: Path) -> None:
    model = mlp(width=8, depth=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with chunkmem.trace(tmp_path, model=model, optimizer=optimizer, keep_warmup=1, keep_last=2):
        for batch in mlp_batches(6, width=8):
            mlp_loss(model, batch).backward()
            optimizer.step()
            with chunkmem.annotate("eval"):
                pass
    rank = read_trace(tmp_path).ranks[0]
    assert sorted({m["step"] for m in rank.moments}) == [0, 4, 5]
    assert [s["step"] for s in rank.steps] == list(range(6))  # summaries are never dropped
    assert rank.gaps == [{"type": "gap", "first": 1, "last": 3, "steps": 3}]
    # An annotation after an optimizer step comes before the next step's first moment (i = -1), and is
    # kept or dropped with that step; the last one, after the last step, stays with it.
    last = max(m["i"] for m in rank.moments if m["step"] == 5)
    assert [(m["step"], m["i"], m["phase"]) for m in rank.markers] == [
        (4, -1, "begin"), (4, -1, "end"), (5, -1, "begin"), (5, -1, "end"), (5, last, "begin"), (5, last, "end")]
    first_of_4 = next(x for x, m in enumerate(rank.moments) if m["step"] == 4)
    assert build(read_trace(tmp_path))["ranks"][0]["spans"][0] == {"name": "eval", "x0": first_of_4, "x1": first_of_4}
    assert rank.complete


def test_schema_version_is_checked(tmp_path: Path) -> None:
    (tmp_path / "trace.rank0.jsonl").write_text(json.dumps({"type": "header", "schema": "chunkmem.trace/99",
                                                            "rank": 0}) + "\n")
    with pytest.raises(TraceError, match="chunkmem.trace/99"):
        read_trace(tmp_path)
    with pytest.raises(TraceError, match="no such trace directory"):
        read_trace(tmp_path / "missing")
    with pytest.raises(TraceError, match=rf"trace.rank0.jsonl: a file, not a trace directory .*is {tmp_path}\)"):
        read_trace(tmp_path / "trace.rank0.jsonl")  # "no such trace directory", of a file that is there
    assert SCHEMA == "chunkmem.trace/1"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="level 'loud'"):
        chunkmem.trace("x", model=mlp(), level="loud")
    with pytest.raises(ValueError, match="keep_last=-1"):
        Retention(keep_last=-1)
    with pytest.raises(ValueError, match="non-empty string"):
        chunkmem.annotate("")


def test_trace_command_records_a_plain_script_without_changes(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 2)\no = torch.optim.Adam(m.parameters())\n"
                      "for _ in range(2):\n    m(torch.randn(3, 4)).sum().backward(); o.step()\n")
    out = tmp_path / "trace"
    done = subprocess.run([sys.executable, "-m", "chunkmem.cli", "trace", "--output", str(out), "--",
                           sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rank = read_trace(out).ranks[0]
    assert rank.header["source"] == "observer" and rank.complete
    assert rank.moments[-1]["device"]["exp_avg"] == (4 * 2 + 2) * 4
    assert json.loads((out / "meta.json").read_text())["argv"] == [str(script)]
    missing = subprocess.run([sys.executable, "-m", "chunkmem.cli", "trace"], capture_output=True, text=True)
    assert missing.returncode == 2 and "no command given" in missing.stderr


@pytest.mark.slow
def test_trace_command_under_torchrun_writes_one_file_per_rank_and_the_report_shows_both(tmp_path: Path) -> None:
    from tests.multiproc import free_port

    example = Path(__file__).resolve().parents[2] / "examples" / "zero_torchrun.py"
    out = tmp_path / "trace"
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", CHUNKMEM_TIMEOUT="60")
    done = subprocess.run([sys.executable, "-m", "chunkmem.cli", "trace", "--output", str(out), "--",
                           sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(example), "--steps", "2"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    trace = read_trace(out)
    assert [r.header["rank"] for r in trace.ranks] == [0, 1]
    for rank in trace.ranks:  # each rank's exact chunk categories: its own shard of the model data
        assert rank.header["source"] == "chunks" and rank.complete and rank.moments
    layouts = [json.loads((out / f"layout.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(lay["world"], lay["rank"]) for lay in layouts] == [(2, 0), (2, 1)]
    report = subprocess.run([sys.executable, "-m", "chunkmem.cli", "report", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    assert [r["rank"] for r in build(trace)["ranks"]] == [0, 1]


def run_trace(out: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chunkmem.cli", "trace", "--output", str(out), "--", *command],
                          capture_output=True, text=True, timeout=180)


TRAIN = ("import sys, torch\nm = torch.nn.Linear(4, 2)\no = torch.optim.Adam(m.parameters())\n"
         "for _ in range(2):\n    m(torch.randn(3, 4)).sum().backward(); o.step()\n")


def test_a_failing_command_in_a_reused_directory_says_what_happened(tmp_path: Path) -> None:
    """Issue 15, item 7: it used to say "written to chunkmem-trace" (the old files) and keep a stale plan.json."""
    out = tmp_path / "trace"
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    assert run_trace(out, sys.executable, str(script)).returncode == 0
    (out / "plan.json").write_text('{"model_data_bytes": 1}')  # the plan of that run
    failing = tmp_path / "fails.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    done = run_trace(out, sys.executable, str(failing))
    assert done.returncode == 3
    assert "recorded nothing" in done.stderr and "removed an earlier trace" in done.stderr
    assert "wrote" not in done.stdout and "written" not in done.stdout
    assert not list(out.iterdir())  # neither the old trace nor its plan is left to be mistaken for this run


def test_a_command_that_fails_after_training_keeps_its_trace_and_its_status(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    script = tmp_path / "train.py"
    script.write_text(TRAIN + "sys.exit(5)\n")
    done = run_trace(out, sys.executable, str(script))
    assert done.returncode == 5
    assert "the command failed (exit status 5)" in done.stderr and "trace.rank0.jsonl" in done.stderr
    assert read_trace(out).ranks[0].moments


def test_a_directory_with_other_files_is_refused_untouched(tmp_path: Path) -> None:
    out = tmp_path / "work"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "meta.json").write_text("{}")
    done = run_trace(out, sys.executable, "-c", "pass")
    assert done.returncode == 2 and "notes.txt" in done.stderr and "new or empty directory" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "notes.txt"]


def test_an_output_that_cannot_be_made_is_refused_before_the_command_runs(tmp_path: Path) -> None:
    # The traced script died in prepare, unable to write its trace there, and this said it recorded nothing.
    (tmp_path / "a_file").write_text("")
    ran = tmp_path / "ran"
    done = run_trace(tmp_path / "a_file" / "trace", sys.executable, "-c", f"open({str(ran)!r}, 'w')")
    assert done.returncode == 2 and "cannot make that directory" in done.stderr and not ran.exists()


def test_the_disk_tier_shows_in_the_trace_and_the_report(tmp_path: Path) -> None:
    model = mlp(width=64, depth=6)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = chunkmem.prepare(model, optimizer, chunkmem.Config(
        device="cpu", chunk_size=4096, host_memory=int(model_data(model) * 0.6), disk=str(tmp_path / "disk")))
    assert model.runtime.host_cache is not None
    with chunkmem.trace(tmp_path / "trace", model=model, optimizer=optimizer, keep_warmup=10):
        for x, y in mlp_batches(3, width=64):
            mlp_loss(model, (x, y)).backward()
            optimizer.step()
            optimizer.zero_grad()
    stats = model.memory_stats()
    rank = read_trace(tmp_path / "trace").ranks[0]
    assert sum(s["disk_read_bytes"] for s in rank.steps) == stats["disk_read_bytes"] > 0
    assert sum(s["disk_write_bytes"] for s in rank.steps) == stats["disk_write_bytes"] > 0
    # Disk moves are not host<->device copies.
    assert sum(s["h2d_bytes"] for s in rank.steps) == stats["h2d_bytes"]
    assert sum(s["d2h_bytes"] for s in rank.steps) == stats["d2h_bytes"]
    on_disk = [total(m.get("disk", {})) for m in rank.moments]
    assert 0 < max(on_disk) <= stats["disk_bytes"] and max(s["disk_peak"] for s in rank.steps) == max(on_disk)
    assert {k for m in rank.moments for k in m.get("disk", {})} <= {"exp_avg", "exp_avg_sq"}
    steady = build(read_trace(tmp_path / "trace"))["ranks"][0]["phases"]["steady"]
    assert steady["disk_read_per_step"] > 0 and steady["disk_write_per_step"] > 0 and steady["disk_peak"] > 0
