"""LoRA: frozen base weights in low-precision chunks without gradient or optimizer storage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from chunkmem.finetune import lora  # noqa: E402
from chunkmem.finetune import train as finetune


def test_adapter_starts_as_the_base_and_folds_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    for base in (torch.nn.Linear(8, 6), transformers.pytorch_utils.Conv1D(6, 8)):  # Conv1D(nf=out, nx=in)
        adapted = lora.LoRALinear(base, rank=2, alpha=4.0)
        x = torch.randn(3, 8)
        assert torch.equal(adapted(x), base(x))  # B starts at zero
        torch.nn.init.normal_(adapted.lora_B)
        merged_weight = base.weight + adapted.delta(adapted.lora_A, adapted.lora_B)
        merged = torch.nn.functional.linear(x, merged_weight) + base.bias if isinstance(base, torch.nn.Linear) \
            else x @ merged_weight + base.bias
        torch.testing.assert_close(adapted(x), merged)


def test_lora_run_trains_adapters_and_leaves_base_untouched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=10, eos_token_id=10)
    base = transformers.GPT2LMHeadModel(config)
    base.save_pretrained(tmp_path / "base")
    original = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = finetune.FinetuneConfig(model=str(tmp_path / "base"), output=str(tmp_path / "out"), steps=8,
                                  seq_len=32, batch_size=4, lr=1e-2, lora_rank=4, dtype="bf16", eval_every=0)
    result = finetune.run(cfg)
    runtime = result.model.runtime
    frozen = [r for r in runtime.store.records.values() if not r.param.requires_grad]
    trainable = [r for r in runtime.store.records.values() if r.param.requires_grad]
    assert frozen and all(r.name.endswith(("lora_A", "lora_B")) for r in trainable)
    for group in runtime.store.groups:  # frozen chunks: low precision, no gradient/master/optimizer state
        if not group.trainable:
            assert set(group.chunks) == {"param"} and group.param.dtype == torch.bfloat16
    renames = {v: k for k, v in lora.renames(result.model.module).items()}
    for record in frozen:  # base weights are exactly what was loaded (in bf16)
        name = renames.get(record.name, record.name)
        assert torch.equal(runtime.data.fp32_value(record), original[name].to(torch.bfloat16).float()), name
    assert any(runtime.data.fp32_value(r).abs().sum() > 0 for r in trainable if r.name.endswith("lora_B"))
    saved = load_file(next((tmp_path / "out").glob("model-*.safetensors")))
    assert not any("lora_" in k or ".base." in k for k in saved)  # folded into a plain GPT-2
    changed = saved["transformer.h.0.attn.c_attn.weight"].float() - original["transformer.h.0.attn.c_attn.weight"]
    assert changed.abs().max() > 0
    assert torch.equal(saved["transformer.h.0.ln_1.weight"].float(),
                       original["transformer.h.0.ln_1.weight"].to(torch.bfloat16).float())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "GPT2LMHeadModel"
