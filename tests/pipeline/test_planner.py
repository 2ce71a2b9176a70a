"""The layout planner (chunkmem/pipeline/planner.py): a stage's model data is what chunkmem.prepare gives the
stage, verdicts hold against the budgets, and the rankings for GPT-2-XL- and LLaMA-7B-sized models."""

from __future__ import annotations

import pytest
import torch

import chunkmem
from chunkmem.cli import main
from chunkmem.pipeline.planner import rank_layouts, stage_config, why
from chunkmem.trace.planner import Request, gpt2_config

GiB, MiB = 2**30, 2**20


def test_a_stage_has_the_model_data_of_the_prepared_stage() -> None:
    from transformers import GPT2LMHeadModel

    config = gpt2_config(layers=4, hidden=64, vocab=320, positions=64)
    request = Request(2 * MiB, GiB, batch_size=4, seq_len=16, dtype="fp32", cuda=False)
    ranked = rank_layouts(config, 2, request)
    stage = GPT2LMHeadModel(stage_config(config, 2))
    assert stage.config.n_layer == 2
    prepared, _ = chunkmem.prepare(stage, torch.optim.AdamW(stage.parameters()),
                                   chunkmem.Config(device="cpu", device_memory=2 * MiB), group=chunkmem.LOCAL)
    stats = prepared.memory_stats()
    param = prepared.runtime.data.model_bytes()["host"]["param"]
    pipelined = {c.schedule: c for c in ranked if c.stages == 2 and c.microbatch == 1}
    assert pipelined["1f1b"].model_data_bytes == stats["model_data_bytes"]
    assert pipelined["2bw"].model_data_bytes == stats["model_data_bytes"] + param  # the older version
    for c in ranked:
        assert (c.verdict == "fits") == (c.device_need <= request.device_memory and
                                         c.host_need_per_host <= request.host_memory)
        assert c.schedule != "2bw" or c.data_parallel == 1
        assert c.data_parallel * c.stages == 2 and c.data_parallel * c.microbatch * c.n_microbatches == 4


def llama_7b() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000)


@pytest.mark.parametrize("name,config", [("gpt2-xl", lambda: gpt2_config(48, 1600, 50257, 1024)),
                                         ("llama-7b", llama_7b)])
@pytest.mark.slow
def test_rankings_for_large_models(name: str, config, capsys) -> None:  # noqa: ANN001
    winners = {}
    for memory in (24, 80):
        for gpus in (1, 2, 4, 8):
            request = Request(memory * GiB, 512 * GiB, batch_size=16, seq_len=1024, dtype="bf16")
            ranked = rank_layouts(config(), gpus, request)
            best = ranked[0]
            assert best.verdict == "fits", (name, memory, gpus)
            assert best.device_need <= memory * GiB and best.host_need_per_host <= 512 * GiB
            assert "wins" in why(ranked) or "only layout" in why(ranked)
            winners[memory, gpus] = best
        seconds = [winners[memory, g].seconds for g in (1, 2, 4, 8)]
        assert seconds == sorted(seconds, reverse=True), f"{name}: more GPUs of {memory} GiB never slower"
    # a 7B model's bf16 training state (16 bytes a parameter) is past 64 GiB of host on one GPU
    if name == "llama-7b":
        ranked = rank_layouts(config(), 1, Request(24 * GiB, 64 * GiB, batch_size=16, seq_len=1024, dtype="bf16"))
        assert ranked[0].verdict == "does not fit" and "no layout fits" in why(ranked)


def test_plan_command_ranks_layouts(capsys) -> None:  # noqa: ANN001
    args = ["plan", "--layers", "4", "--hidden", "64", "--vocab", "128", "--batch-size", "4", "--seq-len", "16",
            "--gpus", "2"]
    assert main(args + ["--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 GPUs of 1.00 GiB") and " 1. D=" in out and "wins" in out
    assert main(args + ["--device-memory", "1MiB"]) == 1
    assert "no layout fits" in capsys.readouterr().out
    assert main(args[:-1] + ["0"]) == 2
