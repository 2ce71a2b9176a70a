"""Hugging Face directories in and out of chunks: streamed loads, sharded saves, tied weights, RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import chunkmem
from chunkmem.finetune import hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def stream(directory: Path, dtype: str = "fp32") -> chunkmem.ChunkedModel:
    source = hf.resolve(directory)
    module = hf.build(source.config, on_meta=True)
    assert all(p.device.type == "meta" for p in module.parameters())
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    model, _ = chunkmem.prepare(module, optimizer, chunkmem.Config(device="cpu", dtype=dtype))
    hf.load_weights(model, source.weight_files)
    return model.eval()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
def test_streamed_load_matches_from_pretrained(tmp_path: Path, make) -> None:
    reference = make()
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(hf.weight_files(tmp_path)) > 1  # really sharded
    model = stream(tmp_path)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    module = model.module
    if hasattr(module, "transformer"):  # GPT-2 ties the head to the embeddings: still one tensor
        assert module.lm_head.weight is module.transformer.wte.weight
    assert not any(b.device.type == "meta" for b in module.buffers())


def test_save_is_sharded_and_loads_with_from_pretrained(tmp_path: Path) -> None:
    reference = tiny_gpt2()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model, optimizer = chunkmem.prepare(reference, optimizer, chunkmem.Config(device="cpu"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    hf.save_pretrained(model, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / hf.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / f).exists() for f in files)
    assert files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as Hugging Face does
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_save_over_an_earlier_one_cut_short_fails_to_load_rather_than_mix_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tiny_gpt2()
    model, _ = chunkmem.prepare(reference, torch.optim.SGD(reference.parameters(), lr=0.1),
                                chunkmem.Config(device="cpu"))
    hf.save_pretrained(model, tmp_path, max_shard_bytes=60_000)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    replace, moved = os.replace, []

    def killed_after_one_shard(src: Any, dst: Any) -> None:
        if str(src).endswith(".safetensors") and moved:
            raise KeyboardInterrupt
        moved.append(src)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_after_one_shard)
    with pytest.raises(KeyboardInterrupt):
        hf.save_pretrained(model, tmp_path, max_shard_bytes=60_000)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):  # the old index pointed at one new shard and the old others: it loaded, mixed
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_missing_weights_are_an_error(tmp_path: Path) -> None:
    tiny_gpt2().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"n_layer": 3}))  # one more block than stored
    with pytest.raises(hf.InputError, match="does not match its weights"):
        stream(tmp_path)


PROBE = textwrap.dedent("""
    import json, os, sys, threading, time
    import psutil, torch
    import chunkmem
    from chunkmem.finetune import hf
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel  # imports are not the load's memory
    process = psutil.Process()
    source = hf.resolve(sys.argv[1])
    peak, done = [process.memory_info().rss], threading.Event()
    def sample():
        while not done.is_set():
            peak.append(process.memory_info().rss)
            time.sleep(0.002)
    base = process.memory_info().rss
    thread = threading.Thread(target=sample); thread.start()
    module = hf.build(source.config, on_meta=True)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    # A budget below the model size: in the CPU simulation the "device" is host memory too, and a
    # model that fits would be counted twice.
    model, _ = chunkmem.prepare(module, optimizer, chunkmem.Config(device="cpu", device_memory=sys.argv[2]))
    hf.load_weights(model, source.weight_files)
    done.set(); thread.join()
    params = sum(r.param.numel() * 4 for r in model.runtime.store.records.values())
    print(json.dumps({"base": base, "peak": max(peak), "param_bytes": params}))
""")


def test_streaming_load_peak_rss_stays_near_model_size(tmp_path: Path) -> None:
    """Loading adds about the parameters' bytes plus a shard, not the two or three copies of a naive load."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=4096, n_positions=128, n_embd=256, n_layer=12, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path, max_shard_size="8MB")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), "12MiB"], capture_output=True, text=True,
                         env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}, timeout=120)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    growth = figures["peak"] - figures["base"]
    print(f"streaming load: RSS grew {growth / 2**20:.1f} MiB for {figures['param_bytes'] / 2**20:.1f} MiB of "
          f"fp32 parameters")
    assert growth < 1.35 * figures["param_bytes"] + 16 * 2**20, figures
