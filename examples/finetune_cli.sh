#!/usr/bin/env bash
# The command-line route: fine-tune with `chunkmem finetune`, resume, and load the result.
#
#   bash examples/finetune_cli.sh            # CPU simulation; on a GPU machine set DEVICE=cuda
set -euo pipefail
DEVICE="${DEVICE:-cpu}"
DTYPE="${DTYPE:-$([ "$DEVICE" = cpu ] && echo fp32 || echo bf16)}"  # bf16 is slow on most CPUs
OUT="${OUT:-/tmp/chunkmem-example}"
rm -rf "$OUT"

# 1. The bundled tiny GPT-2 on the bundled text, with a device budget of 4 MiB: smaller than the
#    model data (about 13 MiB), so chunks move between host and device every step.
#    --stop-after leaves after 60 steps, as a killed or time-sliced job would.
chunkmem finetune --output "$OUT/gpt2" --device "$DEVICE" --device-memory 4MiB \
  --steps 120 --save-every 30 --eval-every 30 --stop-after 60

# 2. Continue from the newest checkpoint to the end; the result equals an uninterrupted run.
chunkmem finetune --output "$OUT/gpt2" --device "$DEVICE" --device-memory 4MiB \
  --steps 120 --save-every 30 --eval-every 30 --resume

# 3. A LLaMA-style model from a config, LoRA adapters on frozen weights (bf16 on a GPU), activation
#    checkpointing and gradient accumulation. With a real checkpoint, pass its directory instead
#    (config.json + *.safetensors + tokenizer files): weights stream into chunks shard by shard.
chunkmem finetune --model "$(dirname "$0")/llama_config.json" --output "$OUT/llama" --device "$DEVICE" \
  --dtype "$DTYPE" --lora-rank 8 --grad-ckpt --grad-accum 2 --batch-size 4 --steps 20 --lr 3e-3

# 4. The outputs are ordinary Hugging Face directories.
python3 - "$OUT" <<'PY'
import sys
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(f"{sys.argv[1]}/gpt2")
prompt = torch.tensor([list(b"Alice was ")])
out = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=10)
print(bytes(out[0].tolist()).decode("utf-8", "replace"))
PY
