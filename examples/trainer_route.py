"""The Trainer route: an existing Hugging Face Trainer script, with one line changed.

    python examples/trainer_route.py                 # CPU simulation with a small device budget
    python examples/trainer_route.py --device cuda --device-memory 20GiB --dtype bf16

The model is a tiny GPT-2 built from a config and the data the bytes of the bundled text, so the
script needs no downloads; with your own model and dataset only the marked line differs from a
plain Trainer script.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: F401

import chunkmem
from chunkmem.finetune.corpus import BUNDLED_TEXT
from chunkmem.trainer import ChunkmemTrainer


def byte_blocks(seq_len: int) -> list[dict[str, torch.Tensor]]:
    data = torch.frombuffer(bytearray(BUNDLED_TEXT.read_bytes()), dtype=torch.uint8).long()
    blocks = data[:len(data) // seq_len * seq_len].view(-1, seq_len)
    return [{"input_ids": row, "labels": row} for row in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--device-memory", default="4MiB")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--output", default="/tmp/chunkmem-trainer")
    args = parser.parse_args()

    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                        bos_token_id=10, eos_token_id=10)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(output_dir=args.output, max_steps=100, per_device_train_batch_size=8,
                                 learning_rate=1e-3, max_grad_norm=1.0, logging_steps=10, save_steps=50,
                                 report_to=[], use_cpu=args.device == "cpu")
    # The one changed line; it was: trainer = Trainer(model=model, args=training, train_dataset=...)
    trainer = ChunkmemTrainer(model=model, args=training, train_dataset=byte_blocks(128),
                              chunkmem_config=chunkmem.Config(device=args.device, device_memory=args.device_memory,
                                                              dtype=args.dtype))
    trainer.train()
    trainer.save_model(f"{args.output}/final")  # a Hugging Face directory: from_pretrained loads it
    print(trainer.model.memory_stats())


if __name__ == "__main__":
    main()
