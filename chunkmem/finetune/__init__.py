"""`chunkmem finetune`: fine-tuning a Hugging Face causal LM in chunks, and its parts."""
