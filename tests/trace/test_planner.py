"""The planner (chunkmem/trace/planner.py): exact model data, activations against the simulation."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

import chunkmem
from chunkmem.chunks.placement import SAFETY_FRACTION
from chunkmem.cli import main
from chunkmem.memory.disk import ALIGN
from chunkmem.trace.planner import Request, fixes, gpt2_config, plan, spec_from_config
from chunkmem.trace.simulate import simulate
from tests.multiproc import run_workers

MiB = 2**20
LLAMA = Path(__file__).resolve().parents[2] / "examples" / "llama_config.json"


def sharded_stats(rank: int, world: int, config: Any, dtype: str, budget: int) -> dict:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)  # every rank builds the same weights
    model = GPT2LMHeadModel(config)
    prepared, _ = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()),
                                   chunkmem.Config(device="cpu", device_memory=budget, dtype=dtype))
    return prepared.memory_stats()


@pytest.mark.parametrize("dtype,world,budget", [("fp32", 1, 2 * MiB), ("bf16", 1, 600_000), ("bf16", 2, 4 * MiB)])
def test_model_data_matches_a_prepared_model(dtype: str, world: int, budget: int) -> None:
    from transformers import GPT2LMHeadModel

    # 3 layers under ZeRO: a size that counts the world size's padding and ZeRO's buffers differs there.
    config = gpt2_config(layers=2 if world == 1 else 3, hidden=64, vocab=320, positions=64)
    estimate = plan(spec_from_config(config, "gpt2"), Request(budget, 2**30, dtype=dtype, world_size=world))
    if world > 1:  # a rank's share: the layout is padded to a multiple of the world size, then split
        assert estimate.trainable_chunks % world == 0
        for stats in run_workers(sharded_stats, world, config, dtype, budget):
            assert (stats["model_data_bytes"], stats["chunk_size"]) == (estimate.model_data_bytes, estimate.chunk_size)
        return
    model = GPT2LMHeadModel(config)
    prepared, _ = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()),
                                   chunkmem.Config(device="cpu", device_memory=budget, dtype=dtype))
    stats = prepared.memory_stats()
    assert estimate.model_data_bytes == stats["model_data_bytes"]
    assert estimate.chunk_size == stats["chunk_size"]
    assert estimate.model_data_by_kind == {k: v for k, v in prepared.runtime.data.model_bytes()["host"].items()}


# (layers, hidden, vocab, batch, seq, dtype, checkpointing): GPT-2-style configs across batch and sequence sizes.
CONFIGS = [(2, 64, 128, 1, 16, "fp32", False), (2, 64, 128, 8, 64, "fp32", False), (2, 128, 256, 2, 128, "fp32", False),
           (2, 128, 256, 4, 32, "bf16", False), (3, 128, 256, 4, 64, "fp32", True)]


@pytest.mark.parametrize("layers,hidden,vocab,batch,seq,dtype,checkpointing", CONFIGS)
def test_activation_estimate_within_25_percent(layers, hidden, vocab, batch, seq, dtype, checkpointing) -> None:
    config = gpt2_config(layers, hidden, vocab, 128)
    request = Request(8 * MiB, 2**30, batch, seq, dtype, checkpointing, attention="math", cuda=False)
    estimate = plan(spec_from_config(config, "gpt2"), request)
    measured = simulate(config, request, estimate)
    assert abs(estimate.activation_forward_bytes / measured.activation_peak - 1) < 0.25
    assert measured.model_data_bytes == estimate.model_data_bytes
    if checkpointing:  # the forward keeps layer inputs only: far below what it keeps without checkpointing
        plain = plan(spec_from_config(config, "gpt2"), dataclasses.replace(request, checkpointing=False))
        assert measured.activation_peak < plain.activation_forward_bytes / 3


@pytest.mark.parametrize("dtype,checkpointing", [("fp32", False), ("bf16", True)])
def test_llama_activation_estimate_within_25_percent(dtype: str, checkpointing: bool) -> None:
    config = AutoConfig.from_pretrained(LLAMA)  # gated MLP, RMS norm, grouped-query attention
    request = Request(8 * MiB, 2**30, 2, 64, dtype, checkpointing, attention="math", cuda=False)
    estimate = plan(spec_from_config(config, "llama"), request)
    measured = simulate(config, request, estimate)
    assert abs(estimate.activation_forward_bytes / measured.activation_peak - 1) < 0.25
    assert measured.model_data_bytes == estimate.model_data_bytes


def test_plan_command_on_a_local_directory_and_a_config(tmp_path: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    budget = 3 * MiB
    cases = [(gpt2_config(layers=2, hidden=64, vocab=320, positions=64), "bf16"),
             (AutoConfig.from_pretrained(LLAMA), "fp32")]
    for index, (config, dtype) in enumerate(cases):
        model = GPT2LMHeadModel(config) if index == 0 else AutoModelForCausalLM.from_config(config)
        if index == 0:  # a Hugging Face directory: config.json and safetensors weights
            model.save_pretrained(tmp_path / "gpt2")
            target = str(tmp_path / "gpt2")
        else:  # a bare config.json
            target = str(LLAMA)
        code = main(["plan", target, "--device", "cpu", "--device-memory", str(budget), "--dtype", dtype,
                     "--batch-size", "1", "--seq-len", "16", "--json"])
        result = json.loads(capsys.readouterr().out)
        assert code == 0 and result["verdict"] in ("fits", "tight") and result["model"] == target
        prepared, _ = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()),
                                       chunkmem.Config(device="cpu", device_memory=budget, dtype=dtype))
        stats = prepared.memory_stats()
        assert result["model_data_bytes"] == stats["model_data_bytes"], target
        assert result["chunk_size"] == stats["chunk_size"]
        assert result["margin_bytes"] == int(budget * SAFETY_FRACTION)  # --device cpu: no CUDA context margin
    # The size flags beside MODEL were ignored, and a --seq-len past its positions planned what finetune refuses (and
    # --simulate died of an IndexError); the default sequence is the model's maximum where that is less.
    gpt2 = str(tmp_path / "gpt2")
    assert main(["plan", gpt2, "--layers", "40", "--hidden", "4096"]) == 2
    assert "with --layers and --hidden: the model's config gives its size" in capsys.readouterr().err
    assert main(["plan", gpt2, "--vocab", "1000"]) == 2
    assert "with --vocab: the model's config gives its size" in capsys.readouterr().err
    assert main(["plan", gpt2, "--seq-len", "65"]) == 2
    assert "--seq-len 65 exceeds the model's maximum of 64 positions" in capsys.readouterr().err
    assert main(["plan", gpt2, "--batch-size", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["seq_len"] == 64


def test_verdicts_binding_and_fixes() -> None:
    spec = spec_from_config(gpt2_config(48, 1600, 50257, 1024), "gpt2")
    big = Request(24 * 2**30, 64 * 2**30, batch_size=8, seq_len=1024)
    estimate = plan(spec, big)
    assert (estimate.verdict, estimate.binding) == ("does not fit", "device memory")
    ranked = fixes(spec, big)
    assert ranked[0][1].verdict == "fits" and "checkpointing" in ranked[0][0]
    small_host = plan(spec, Request(80 * 2**30, 16 * 2**30, batch_size=1, seq_len=128))
    assert (small_host.verdict, small_host.binding) == ("does not fit", "host memory")
    roomy = plan(spec, Request(80 * 2**30, 512 * 2**30, batch_size=1, seq_len=128, checkpointing=True))
    assert roomy.verdict == "fits"


@pytest.mark.parametrize("field,said", [("n_layer", "Field 'n_layer' expected int, got str"),
                                        ("n_head", "cannot build a causal LM from it: `embed_dim` must be divisible")])
def test_plan_says_what_is_wrong_with_a_config_transformers_refuses(field, said, tmp_path, capsys) -> None:
    # Tracebacks, before: a field of the wrong type fails huggingface_hub's validation with an exception of its own,
    # and heads that do not divide the width fail only when transformers builds the model.
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config | {field: {"n_layer": "two", "n_head": 3}[field]}))
    assert main(["plan", str(path), "--device", "cpu"]) == 2
    assert said in capsys.readouterr().err


def test_plan_command(capsys) -> None:
    args = ["plan", "--layers", "2", "--hidden", "64", "--vocab", "128", "--batch-size", "2", "--seq-len", "16"]
    assert main(args + ["--json", "--device-memory", "1GiB", "--host-memory", "64GiB"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "fits" and result["model_data_bytes"] > 0
    assert main(args + ["--device-memory", "1MiB"]) == 1
    assert "verdict: does not fit (binding: device memory)" in capsys.readouterr().out
    assert main(["plan"]) == 2
    assert "give MODEL" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9"]) == 2  # the depth is missing: said so, with an example that has it
    err = capsys.readouterr().err
    assert "got --params 1e+09: give MODEL" in err and "--layers 24 --params" in err
    assert main(args + ["--device-memory", "lots"]) == 2
    assert "--device-memory='lots'" in capsys.readouterr().err
    assert main(["plan", "/nonexistent/model"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(args + ["--batch-size", "0"]) == 2
    for count in ("-5", "nan", "inf", "1e40"):  # a math domain error, a NaN conversion, overflows (exit 1)
        assert main(["plan", "--layers", "2", "--params", count]) == 2
        assert f"--params {float(count)}: expected a positive parameter count up to 1e+15" in capsys.readouterr().err


def test_plan_simulate(capsys) -> None:
    args = ["plan", "--layers", "2", "--hidden", "64", "--vocab", "128", "--batch-size", "2", "--seq-len", "16",
            "--dtype", "fp32", "--simulate", "--json"]
    timed = {}
    for budget in ("2MiB", "64MiB"):  # chunks stream; all of them fit
        assert main(args + ["--device-memory", budget]) == 0
        result = json.loads(capsys.readouterr().out)
        assert abs(result["simulated"]["estimate_error"]) < 0.25
        assert result["simulated"]["model_data_bytes"] == result["model_data_bytes"]
        timed[budget] = t = result["time_model"]  # the third simulated step replayed at typical GPU speeds
        assert sum(t["stage_s"].values()) == pytest.approx(t["step_s"]) and t["step_s"] >= t["bound_s"] > 0
    streamed, resident = timed["2MiB"], timed["64MiB"]
    assert streamed["h2d_bytes"] > 0 and streamed["host_update_s"] > 0
    assert resident["h2d_bytes"] == resident["d2h_bytes"] == resident["host_update_s"] == 0
    assert streamed["step_s"] > resident["step_s"]
    # Host updates made ahead of step() are for low precision: refused in fp32, and predicted to shorten a step.
    assert main(args + ["--device-memory", "2MiB", "--overlap-update"]) == 2
    assert "for Adam in bf16 or fp16 only" in capsys.readouterr().err
    low = [*args[:args.index("fp32")], "bf16", *args[args.index("fp32") + 1:], "--device-memory", "2MiB"]
    predicted = []
    for extra in ([], ["--overlap-update"]):
        assert main(low + extra) == 0
        predicted.append(json.loads(capsys.readouterr().out)["time_model"])
    apart, ahead = predicted
    assert apart["host_update_s"] > 0 and apart["bound_s"] <= ahead["step_s"] < apart["step_s"]


def test_plan_ranks_chunk_sizes_by_the_predicted_step(capsys) -> None:
    from transformers import AutoModelForCausalLM

    from chunkmem.chunks.layout import chunk_size_bands
    from chunkmem.trace.planner import gpt2_config

    args = ["plan", "--layers", "2", "--hidden", "64", "--vocab", "128", "--batch-size", "2", "--seq-len", "16",
            "--dtype", "bf16", "--device-memory", "2MiB", "--simulate"]
    assert main(args[:-1] + ["--chunk-sizes"]) == 2 and "add --simulate" in capsys.readouterr().err
    assert main(args + ["--chunk-sizes", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["chunk_sizes"]
    default = [r for r in rows if r["default"]]
    assert len(default) == 1 and default[0]["chunk_size"] == result["simulated"]["chunk_size"]
    assert default[0]["step_s"] == result["time_model"]["step_s"]
    with torch.device("meta"):
        named = [(n, p.numel()) for n, p in AutoModelForCausalLM.from_config(gpt2_config(2, 64, 128, 1024))
                 .named_parameters()]
    # Each simulated at its own size (what the prepared model's memory_stats said), and fastest first.
    others = chunk_size_bands(named, besides=default[0]["chunk_size"])
    assert others and sorted(r["chunk_size"] for r in rows if not r["default"]) == others
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert main(args + ["--chunk-sizes"]) == 0
    text = capsys.readouterr().out
    assert "chunk sizes by the time model's predicted step:" in text and "(default)" in text
    assert "fastest: " in text


def test_plan_simulate_with_cudas_allocator_sizes_trains_where_the_plans_slots_do_not_all_fit(capsys, sim_memory) -> None:
    # At 48 MiB the plan made after the first step asks the arena for more slots than the allocator's segments leave
    # room for (chunkmem/memory/arena.py, `reserve`): the steps go on, and the third is recorded.
    sim_memory(1)
    args = ["plan", "--layers", "4", "--hidden", "256", "--vocab", "1024", "--batch-size", "2", "--seq-len", "64",
            "--dtype", "bf16", "--device-memory", "48MiB", "--simulate", "--json"]
    assert main(args) == 0
    timed = json.loads(capsys.readouterr().out)["time_model"]
    assert "failure" not in timed and timed["h2d_bytes"] > 0


def test_plan_simulate_says_when_a_later_step_outgrows_the_budget(capsys, monkeypatch, sim_memory) -> None:
    from chunkmem.errors import MemoryBudgetError
    from chunkmem.trace import timing

    def outgrown(runtime: Any, train_step: Any, scale: float = 1.0) -> Any:
        raise MemoryBudgetError("chunk master.3 needs 4096 bytes on the device")

    monkeypatch.setattr(timing, "record", outgrown)
    args = ["plan", "--layers", "2", "--hidden", "64", "--vocab", "128", "--batch-size", "2", "--seq-len", "16",
            "--dtype", "fp32", "--device-memory", "64MiB", "--simulate"]
    assert main(args) == 1  # the estimate said it fits; the simulation says otherwise
    assert "FAILED, the budget did not hold: chunk master.3 needs 4096 bytes" in capsys.readouterr().out
    monkeypatch.undo()
    sim_memory(1)  # the first step already: 1 MiB is less than one segment of CUDA's caching allocator
    assert main(args[:-2] + ["1MiB", "--simulate", "--json"]) == 1
    assert "needs" in json.loads(capsys.readouterr().out)["time_model"]["failure"]


def test_plan_and_finetune_assume_one_dtype() -> None:
    """Issue 15, item 9: plan defaulted to bf16 while finetune trained in fp32."""
    import argparse

    from chunkmem.commands import finetune as finetune_command
    from chunkmem.commands import plan as plan_command
    from chunkmem.finetune.train import FinetuneConfig

    defaults = set()
    for command in (plan_command, finetune_command):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        defaults.add(parser.parse_args([]).dtype)
    defaults |= {FinetuneConfig().dtype, chunkmem.Config(device="cpu").dtype, Request(1, 1).dtype}
    assert defaults == {"fp32"}


def test_host_memory_is_per_machine_when_ranks_share_one(capsys) -> None:
    """Issue 15, item 9: "shard over 2 GPUs: host 53.88 GiB" was a rank's need on a host that holds both."""
    spec = spec_from_config(gpt2_config(48, 1600, 50257, 1024), "gpt2")
    tight_host = Request(80 * 2**30, 40 * 2**30, batch_size=1, seq_len=128, dtype="bf16", checkpointing=True)
    base = plan(spec, tight_host)
    assert base.binding == "host memory" and base.host_need_per_host == base.host_need
    two = plan(spec, dataclasses.replace(tight_host, world_size=2))  # two ranks on this machine
    assert two.host_need < base.host_need < two.host_need_per_host == 2 * two.host_need
    assert not [label for label, _ in fixes(spec, tight_host) if label.startswith("shard")]  # it does not help
    two_hosts = dataclasses.replace(tight_host, ranks_per_host=1)
    sharded = [(label, e) for label, e in fixes(spec, two_hosts) if label.startswith("shard")]
    assert sharded and sharded[0][1].host_need_per_host == sharded[0][1].host_need < base.host_need
    args = ["plan", "--layers", "48", "--hidden", "1600", "--device-memory", "80GiB", "--host-memory", "64GiB",
            "--batch-size", "1", "--seq-len", "128", "--dtype", "bf16", "--grad-ckpt", "--world-size", "2"]
    assert main(args) == 0
    assert "per rank" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["host_need_per_host"] == 2 * result["host_need"] and result["request"]["hosted_ranks"] == 2


def test_plan_suggests_the_disk_tier_when_host_memory_binds_and_shows_its_bytes(capsys) -> None:
    from transformers import GPT2LMHeadModel

    config = gpt2_config(layers=6, hidden=64, vocab=320, positions=1024)  # as the command builds it
    spec = spec_from_config(config, "gpt2")
    roomy = Request(2**30, 2**30, batch_size=1, seq_len=16, dtype="bf16", cuda=False)
    whole = plan(spec, roomy).model_data_bytes
    tight = dataclasses.replace(roomy, host_memory=int(whole * 0.8))
    assert plan(spec, dataclasses.replace(roomy, disk=True)).disk_bytes == 0, "it fits: no disk tier"
    base = plan(spec, tight)
    assert (base.verdict, base.binding, base.disk_bytes) == ("does not fit", "host memory", 0)
    label, tiered = fixes(spec, tight)[0]
    assert "disk" in label and tiered.verdict != "does not fit" and tiered.request.disk
    kinds = tiered.model_data_by_kind
    spilled = kinds["master"] + kinds["exp_avg"] + kinds["exp_avg_sq"]  # each chunk's slot rounded up to ALIGN
    assert spilled <= tiered.disk_bytes < spilled + 3 * tiered.trainable_chunks * ALIGN
    assert tiered.host_need < tight.host_memory < base.host_need
    # The bytes on disk are the runtime's, exactly.
    model = GPT2LMHeadModel(config)
    prepared, _ = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()), chunkmem.Config(
        device="cpu", device_memory=2**30, host_memory=tight.host_memory, dtype="bf16", disk=str(Path.cwd())))
    try:
        assert prepared.memory_stats()["disk_bytes"] == tiered.disk_bytes
    finally:
        prepared.runtime.host_cache.close()
    args = ["plan", "--layers", "6", "--hidden", "64", "--vocab", "320", "--batch-size", "1", "--seq-len", "16",
            "--dtype", "bf16", "--device", "cpu", "--device-memory", "1GiB", "--host-memory", str(tight.host_memory)]
    assert main(args) == 1
    assert "cheapest change that fits: master weights and optimizer states on disk (--disk" in capsys.readouterr().out
    assert main([*args, "--disk"]) == 0
    assert "disk tier" in capsys.readouterr().out


@pytest.mark.parametrize("gpus", [None, 2])
def test_plan_json_stays_parseable_when_a_library_prints(capsys, monkeypatch, gpus):
    # Loading a config imports transformers, which imports DeepSpeed when installed; its logger prints to stdout.
    command = importlib.import_module("chunkmem.commands.plan")

    def noisy(*args: Any, **kwargs: Any) -> Any:
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
        return load(*args, **kwargs)

    load = command._config
    monkeypatch.setattr(command, "_config", noisy)
    code = main(["plan", "--layers", "2", "--hidden", "64", "--vocab", "320", "--device", "cpu", "--device-memory",
                 "64MiB", "--batch-size", "1", "--seq-len", "16", "--json", *(["--gpus", str(gpus)] if gpus else [])])
    captured = capsys.readouterr()
    assert code in (0, 1) and isinstance(json.loads(captured.out), dict)
    assert "Setting accelerator" in captured.err


def test_plan_searches_combinations_of_fixes_and_names_the_fastest_that_fits(tmp_path, capsys) -> None:
    """Issue 35, item 10: LLaMA-7B on a 24 GiB GPU and 64 GiB of host memory fits with no single fix; the
    planner must find the combination that does and rank what fits by its predicted step time."""
    from transformers import LlamaConfig

    from chunkmem.trace.search import options, step_seconds

    config = LlamaConfig()  # LLaMA-7B's shape: hidden 4096, 32 layers, intermediate 11008
    spec = spec_from_config(config, "llama")
    request = Request(24 * 2**30, 64 * 2**30, batch_size=8, seq_len=1024)
    assert plan(spec, request).verdict == "does not fit"
    assert all(e.verdict == "does not fit" for _, e in fixes(spec, request)), "one fix at a time fits nothing"
    found = options(spec, request)
    fitting = [o for o in found if o.estimate.verdict == "fits"]
    best = found[0]
    assert best.lora_rank == 0 and best.estimate.request.checkpointing and best.estimate.request.disk
    assert plan(spec, best.estimate.request).verdict == "fits"  # the changes as a user would make them
    tokens = request.batch_size * request.seq_len
    assert best.seconds == min(step_seconds(spec, o.estimate, tokens) for o in fitting if not o.lora_rank)
    lora = [i for i, o in enumerate(found) if o.lora_rank and o.estimate.verdict != "does not fit"]
    assert lora and min(lora) > max(i for i, o in enumerate(found) if not o.lora_rank and o in fitting)
    # The time model: recomputing the forward, a smaller device and the disk tier each cost time.
    roomy = dataclasses.replace(best.estimate.request, device_memory=80 * 2**30)
    assert step_seconds(spec, plan(spec, roomy), tokens) < best.seconds
    no_ckpt = dataclasses.replace(roomy, checkpointing=False, host_memory=2**40, disk=False)
    assert step_seconds(spec, plan(spec, no_ckpt), tokens) < step_seconds(spec, plan(spec, roomy), tokens)
    config.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--device-memory", "24GiB", "--host-memory", "64GiB"]) == 1
    out = capsys.readouterr().out
    assert "cheapest change that fits: activation checkpointing" in out and "--disk" in out
    assert main(["plan", str(tmp_path), "--device-memory", "24GiB", "--host-memory", "64GiB", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["combinations"][0]["changes"] == list(best.changes)
    assert result["combinations"][0]["seconds"] == pytest.approx(best.seconds)


def test_plan_simulate_chooses_homes_as_the_gpu_machine_it_predicts_would(capsys, monkeypatch) -> None:
    """The simulated step is replayed at typical GPU speeds, where the native kernel is on and homes are chosen by
    time: its planner weighs host updates at those speeds too (chunks/planning.py's Note on homes by time)."""
    from chunkmem.chunks import placement
    from chunkmem.trace.search import HOST_UPDATE, PCIE

    weights = []
    decide = placement.decide_homes
    monkeypatch.setattr(placement, "decide_homes", lambda *args: weights.append(args[-1]) or decide(*args))
    args = ["plan", "--layers", "2", "--hidden", "64", "--vocab", "128", "--batch-size", "2", "--seq-len", "16",
            "--dtype", "bf16", "--device-memory", "2MiB", "--simulate", "--json"]
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["time_model"]["host_update_s"] > 0
    assert weights and set(weights) == {PCIE / HOST_UPDATE}
