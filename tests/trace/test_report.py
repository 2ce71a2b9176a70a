"""Report: a recorded trace round-trips through every output format."""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
from pathlib import Path

import torch

import chunkmem
from chunkmem.cli import main
from chunkmem.trace import read_trace
from chunkmem.trace.planner import Request, plan, spec_from_config
from chunkmem.trace.report import write_report
from chunkmem.trace.report_data import build
from tests.helpers import gpt2_batches, tiny_gpt2


def record(directory: Path, budget: int = 250_000, **keep: int) -> None:
    model = tiny_gpt2(layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = chunkmem.prepare(model, optimizer, chunkmem.Config(device="cpu", device_memory=budget))
    with chunkmem.trace(directory, model=model, optimizer=optimizer, **keep):
        for ids in gpt2_batches(3):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        chunkmem.annotate("done")


def test_trace_round_trips_through_the_report(tmp_path: Path) -> None:
    record(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({"model_data_bytes": 1, "activation_bytes": 2,
                                                   "device_all_resident": 3}))
    written = {p.name for p in write_report(tmp_path)}
    assert {"report.html", "moments.csv", "perfetto.json"} <= written
    if importlib.util.find_spec("matplotlib") is not None:
        png = (tmp_path / "memory.png").read_bytes()
        assert "memory.png" in written and png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk: 13 x 4.8 inches at 110 dpi
        assert (width, height) == (1430, 528)
    else:
        assert "memory.png" not in written
    trace = read_trace(tmp_path)
    moments = trace.ranks[0].moments
    rows = list(csv.DictReader((tmp_path / "moments.csv").open()))
    assert len(rows) == len(moments)
    for row, moment in zip(rows, moments):
        assert int(row["device_param"]) == moment["device"].get("param", 0)
        assert int(row["host_exp_avg"]) == moment["host"].get("exp_avg", 0)
        assert int(row["device_nonmodel"]) == moment["device"].get("nonmodel", 0)
    events = json.loads((tmp_path / "perfetto.json").read_text())["traceEvents"]
    copies = [e for e in events if e["ph"] == "X"]
    assert len(copies) == len(trace.ranks[0].moves) > 0
    assert sum(e["args"]["bytes"] for e in copies) == sum(m["bytes"] for m in trace.ranks[0].moves)
    assert any(e["ph"] == "i" and e["name"] == "done" for e in events)
    page = (tmp_path / "report.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # opens offline: nothing fetched
    data = json.loads(page.split('<script type="application/json" id=data>')[1].split("</script>")[0])
    assert data["ranks"][0]["series"]["device"]["param"] == [m["device"].get("param", 0) for m in moments]
    assert [row["what"] for row in data["compare"]] == ["model data (host)", "activations (device, peak)",
                                                       "device total (peak)", "device budget"]
    assert data["compare"][3]["actual"] == 250_000 and data["ranks"][0]["device_limit"] == 250_000
    assert data["ranks"][0]["spans"] == [{"name": "done", "x0": len(moments) - 1, "x1": len(moments) - 1}]
    assert data["compare"][0]["actual"] == max(sum(m["host"].get(k, 0) for k in ("param", "grad", "exp_avg",
                                                                                  "exp_avg_sq")) for m in moments)
    lanes = {lane["chunk"]: lane for lane in data["ranks"][0]["lanes"]}
    assert any(lane["spans"] for lane in lanes.values())
    assert {lane["kind"] for lane in lanes.values()} == {"param", "grad", "exp_avg", "exp_avg_sq"}  # the colours


def test_predicted_vs_actual_with_a_plan_of_the_same_run(tmp_path: Path) -> None:
    budget = 1_200_000  # holds the activations (about 0.5 MB) beside some of the 1.8 MB of model data
    record(tmp_path, budget)
    request = Request(budget, 2**30, batch_size=2, seq_len=16, dtype="fp32", attention="math", cuda=False)
    plan_ = plan(spec_from_config(tiny_gpt2(layers=2).config, "gpt2"), request)
    assert plan_.verdict == "fits" and plan_.device_all_resident > budget  # it fits only if chunks move
    (tmp_path / "plan.json").write_text(json.dumps(plan_.to_json()))
    rows = {row["what"]: row for row in build(read_trace(tmp_path))["compare"]}
    assert rows["model data (host)"]["actual"] == rows["model data (host)"]["predicted"] == plan_.model_data_bytes
    assert rows["model data (host)"]["difference"] == "+0.0%"
    acts = rows["activations (device, peak)"]
    assert abs(acts["actual"] / acts["predicted"] - 1) < 0.01  # the estimate counts what this forward saves
    device = rows["device total (peak)"]
    assert device["predicted"] == budget and plan_.device_need < device["actual"] <= budget
    assert rows["device budget"]["predicted"] == rows["device budget"]["actual"] == budget


def test_report_command_exit_codes(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such trace directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no trace.rank*.jsonl" in capsys.readouterr().err
    record(tmp_path / "t")
    assert main(["report", str(tmp_path / "t"), "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.html").exists()
    (tmp_path / "file").write_text("")
    assert main(["report", str(tmp_path / "t"), "--output", str(tmp_path / "file")]) == 2  # a FileExistsError
    assert "an --output folder it can write" in capsys.readouterr().err
    record(tmp_path / "none", keep_last=0, keep_warmup=0)  # no step kept: no chart (a ValueError in matplotlib)
    assert main(["report", str(tmp_path / "none")]) == 0
    assert (tmp_path / "none" / "report.html").exists() and not (tmp_path / "none" / "memory.png").exists()
