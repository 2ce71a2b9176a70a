"""ChunkmemDPOTrainer: TRL's DPOTrainer with the policy and its reference under one chunkmem budget trains as the
plain DPOTrainer does."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import chunkmem  # noqa: E402
from chunkmem.dpo import ChunkmemDPOTrainer  # noqa: E402


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character: built here, since tests download nothing."""
    chars = ["<pad>", "<eos>", *"abcdefghijklmnopqrstuvwxyz .?"]
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def preferences() -> Dataset:
    return Dataset.from_dict({"prompt": ["what is up?", "say hi.", "name a fruit.", "count."] * 4,
                              "chosen": [" the sky", " hi", " apple", " one two"] * 4,
                              "rejected": [" no", " bye bye", " rock", " zero"] * 4})


def fit(trainer_cls: type, policy: torch.nn.Module, reference: torch.nn.Module, output: Path, **extra):
    args = trl.DPOConfig(output_dir=str(output), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                         logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
                         save_strategy="no", dataloader_num_workers=0)
    trainer = trainer_cls(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                          train_dataset=preferences(), processing_class=char_tokenizer(), **extra)
    trainer.train()
    return trainer


def test_dpo_trainer_on_one_budget_below_both_models_data_matches_plain_dpo_trainer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, pad_token_id=0,
                                          eos_token_id=1))
    budget = 6 * 2**20
    plain = fit(trl.DPOTrainer, policy, policy, tmp_path / "plain")
    ours = fit(ChunkmemDPOTrainer, policy, policy, tmp_path / "ours",
               chunkmem_config=chunkmem.Config(device="cpu", dtype="fp32", device_memory=budget))
    logged = [[(h["loss"], h["grad_norm"], h["rewards/margins"]) for h in t.state.log_history if "loss" in h]
              for t in (plain, ours)]
    assert len(logged[1]) == 6 and logged[1][-1][0] < logged[1][0][0]  # it trains
    assert logged[1] == logged[0]  # fp32: the same losses, gradient norms and reward margins, bit for bit
    assert all(torch.equal(ours.model.state_dict()[k], v) for k, v in plain.model.state_dict().items())
    assert isinstance(ours.ref_model, chunkmem.ChunkedModel) and ours.ref_model.runtime is ours.model.runtime
    store = ours.model.runtime.store
    assert all(set(g.chunks) == {"param"} for g in store.groups if not g.trainable)
    stats = ours.manager.memory_stats()  # type: ignore[union-attr]
    assert stats["device_bytes_peak"] <= budget < stats["model_data_bytes"] and stats["h2d_bytes"] > 0
