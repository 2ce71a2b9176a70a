"""ChunkmemTrainer: a Trainer script that changes one line trains as the plain Trainer does."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import chunkmem  # noqa: E402
from chunkmem.trainer import OPTIMIZER_DIR, ChunkmemTrainer  # noqa: E402


def fit(trainer_cls: type, model: torch.nn.Module, output: Path, resume: Path | None = None,
        **extra) -> transformers.Trainer:
    ids = torch.randint(0, 16, (32, 24), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(output), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
        max_grad_norm=0.5, logging_steps=1, save_steps=4, report_to=[], use_cpu=True, disable_tqdm=True,
        seed=0, data_seed=0, dataloader_num_workers=0)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, **extra)
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def test_trainer_matches_plain_trainer_and_saves(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    plain = fit(transformers.Trainer, copy.deepcopy(model), tmp_path / "plain")
    chunked = fit(ChunkmemTrainer, model, tmp_path / "chunked",
                  chunkmem_config=chunkmem.Config(device="cpu", device_memory="60KiB"))
    assert isinstance(chunked.model, chunkmem.ChunkedModel)
    assert chunked.model.memory_stats()["h2d_bytes"] > 0  # the budget made chunks move
    logs = [(h["loss"], h["grad_norm"]) for h in chunked.state.log_history if "loss" in h]
    ref = [(h["loss"], h["grad_norm"]) for h in plain.state.log_history if "loss" in h]
    assert len(logs) == 8 and logs[-1][0] < logs[0][0]  # it trains
    assert max(g for _, g in ref) > 0.5  # clipping was active, so the norms below test it
    torch.testing.assert_close(torch.tensor(logs), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    assert (tmp_path / "chunked" / "checkpoint-4" / OPTIMIZER_DIR / "meta.json").exists()
    chunked.save_model(str(tmp_path / "final"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    ids = torch.arange(16).view(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, chunked.model.eval()(ids).logits)
        torch.testing.assert_close(loaded(ids).logits, plain.model.eval()(ids).logits, rtol=1e-4, atol=1e-4)
    # Resumed from the plain Trainer's checkpoint, the optimizer and the schedule started again, silently.
    older = tmp_path / "plain" / "checkpoint-4"
    with pytest.raises(ValueError, match="checkpoint of transformers' Trainer"):
        fit(ChunkmemTrainer, copy.deepcopy(plain.model), tmp_path / "again", resume=older,
            chunkmem_config=chunkmem.Config(device="cpu"))
    # Saved over the plain Trainer's save of step 4 (one model.safetensors, which transformers reads before an
    # index), it loaded those weights.
    chunked.save_model(str(older))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(older).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, chunked.model(ids).logits)


def test_save_model_in_bf16_writes_the_fp32_master_weights_as_save_pretrained(tmp_path: Path) -> None:
    # It wrote the bf16 parameters (the plain Trainer's bf16 run writes fp32), and model.save_pretrained the masters.
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                                                 n_head=2, bos_token_id=0, eos_token_id=0))
    chunked = fit(ChunkmemTrainer, model, tmp_path / "run", chunkmem_config=chunkmem.Config(device="cpu", dtype="bf16"))
    chunked.save_model(str(tmp_path / "final"))
    saved = {}
    for file in (tmp_path / "final").glob("*.safetensors"):
        saved.update(load_file(file))
    want = chunked.model.state_dict()
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert all(torch.equal(saved[k], want[k]) for k in saved) and "transformer.wte.weight" in saved


def test_label_smoothing_and_a_model_prepared_before_the_trainer_train_and_evaluate_as_plain(tmp_path: Path) -> None:
    """transformers shifts a causal LM's labels for label smoothing by its class name (it saw "ChunkedModel"), and keeps
    the dataset columns and label names the model's forward takes (a prepared model's takes anything: the batches came
    out empty, and evaluation had no loss)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def run(trainer_cls: type, model: torch.nn.Module, output: str, **extra) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / output), max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3,
            label_smoothing_factor=0.1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
        trainer = trainer_cls(model=model, args=args, train_dataset=data, eval_dataset=data, **extra)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h] + [trainer.evaluate()["eval_loss"]]

    plain = run(transformers.Trainer, copy.deepcopy(model), "plain")
    config = chunkmem.Config(device="cpu", device_memory="60KiB")
    assert run(ChunkmemTrainer, copy.deepcopy(model), "chunked", chunkmem_config=config) == pytest.approx(plain)
    for trainer_cls in (ChunkmemTrainer, transformers.Trainer):  # the plain one reads the prepared model's own
        copied = copy.deepcopy(model)
        prepared, optimizer = chunkmem.prepare(
            copied, torch.optim.AdamW(copied.parameters(), lr=3e-3, weight_decay=0.0), config)
        assert run(trainer_cls, prepared, trainer_cls.__name__, optimizers=(optimizer, None)) == pytest.approx(plain)
    assert repr(prepared).startswith("ChunkedModel(\n  (module): GPT2LMHeadModel(")


class _AdapterModel(transformers.GPT2LMHeadModel):
    """A stand-in for a PEFT model (peft is not among the test requirements): a `peft_config`, and a save_pretrained
    that, as PEFT's, writes the adapter's values alone from the `state_dict` it is given."""

    peft_config = {"default": "lora"}

    def save_pretrained(self, save_directory, state_dict=None, **kwargs) -> None:
        from safetensors.torch import save_file

        os.makedirs(save_directory, exist_ok=True)
        adapter = {k: v.contiguous() for k, v in state_dict.items() if ".ln_" in k}  # (the adapter, here)
        save_file(adapter, os.path.join(save_directory, "adapter_model.safetensors"))


def test_save_model_of_a_peft_model_writes_its_adapter_as_the_plain_trainer(tmp_path: Path) -> None:
    # ChunkmemTrainer wrote a PEFT model whole, in a Hugging Face model's layout under PEFT's names: PeftModel could not
    # load it, nor could the Trainer resume from its checkpoints (helper-68, with peft 0.21). The model's own
    # save_pretrained writes the adapter, from chunkmem's values.
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _AdapterModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                                  bos_token_id=0, eos_token_id=0))
    chunked = fit(ChunkmemTrainer, model, tmp_path / "run", chunkmem_config=chunkmem.Config(device="cpu", dtype="bf16"))
    chunked.save_model(str(tmp_path / "final"))
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["adapter_model.safetensors"]
    saved, want = load_file(tmp_path / "final" / "adapter_model.safetensors"), chunked.model.state_dict()
    assert saved and all(torch.equal(v, want[k]) and v.dtype == torch.float32 for k, v in saved.items())
