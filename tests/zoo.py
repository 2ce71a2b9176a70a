"""Tiny Hugging Face models of many architectures nobody here wrote, built offline from configs.

Each `Arch` builds its model (seeded, dropout off, so two builds are equal and training is
deterministic), makes batches and computes the loss the model's own head defines. Only
architectures the installed transformers has are listed (`available()`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH, IMAGE, LABELS = 128, 8, 2, 16, 3
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture: its model class and config (names in `transformers`), and its input kind."""

    name: str
    model: str  # class name in transformers, e.g. "LlamaForCausalLM"
    config: str  # config class name
    kwargs: dict[str, Any]
    inputs: str  # "causal" | "masked" | "seq2seq" | "image" | "speech" (CTC) | "speech2text" | "contrastive"

    def build(self, seed: int = 0) -> nn.Module:
        import transformers

        torch.manual_seed(seed)
        config = getattr(transformers, self.config)(**self.kwargs)
        return getattr(transformers, self.model)(config)

    def batches(self, steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        if self.inputs == "image":
            size = self.kwargs.get("image_size", IMAGE)
            return [{"pixel_values": torch.randn(BATCH, 3, size, size, generator=gen),
                     "labels": torch.randint(0, LABELS, (BATCH,), generator=gen)} for _ in range(steps)]
        if self.inputs == "speech":  # raw audio, 800 samples: 79 frames after the feature encoder
            return [{"input_values": torch.randn(BATCH, 800, generator=gen),
                     "labels": torch.randint(3, VOCAB // 4, (BATCH, SEQ), generator=gen)} for _ in range(steps)]
        if self.inputs == "speech2text":  # log-mel features
            return [{"input_features": torch.randn(BATCH, self.kwargs["num_mel_bins"], 32, generator=gen),
                     "labels": torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)} for _ in range(steps)]
        if self.inputs == "contrastive":  # captions and their images
            return [{"input_ids": torch.randint(3, VOCAB, (2 * BATCH, SEQ), generator=gen),
                     "pixel_values": torch.randn(2 * BATCH, 3, IMAGE, IMAGE, generator=gen)}
                    for _ in range(steps)]
        out = []
        for _ in range(steps):
            ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)  # 0-2: special tokens of some configs
            out.append({"input_ids": ids, "labels": ids.roll(1, dims=1) if self.inputs == "seq2seq" else ids})
        return out


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    contrastive = "input_ids" in batch and "pixel_values" in batch  # CLIP computes its loss when asked
    return model(**batch, **({"return_loss": True} if contrastive else {})).loss.float()


def _decoder(name: str, model: str, config: str, **kwargs: Any) -> Arch:
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Arch(name, model, config, common | kwargs, "causal")


LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64, pad_token_id=0, **NO_DROPOUT)

ZOO: list[Arch] = [
    _decoder("gpt2", "GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    _decoder("llama", "LlamaForCausalLM", "LlamaConfig", **LLAMA_LIKE),
    _decoder("mistral", "MistralForCausalLM", "MistralConfig", **LLAMA_LIKE),
    _decoder("qwen2", "Qwen2ForCausalLM", "Qwen2Config", **LLAMA_LIKE),
    _decoder("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
             attention_dropout=0.0),
    _decoder("opt", "OPTForCausalLM", "OPTConfig", hidden_size=32, ffn_dim=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
             attention_dropout=0.0),
    _decoder("bloom", "BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
             attention_dropout=0.0),
    _decoder("falcon", "FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0),
    _decoder("phi", "PhiForCausalLM", "PhiConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0),
    _decoder("mixtral", "MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
             **LLAMA_LIKE),
    Arch("bert", "BertForMaskedLM", "BertConfig", BERT_LIKE, "masked"),
    Arch("roberta", "RobertaForMaskedLM", "RobertaConfig", BERT_LIKE | dict(pad_token_id=1), "masked"),
    Arch("distilbert", "DistilBertForMaskedLM", "DistilBertConfig",
         dict(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64,
              dropout=0.0, attention_dropout=0.0, pad_token_id=0), "masked"),
    Arch("t5", "T5ForConditionalGeneration", "T5Config",
         dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
              dropout_rate=0.0, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0), "seq2seq"),
    Arch("bart", "BartForConditionalGeneration", "BartConfig",
         dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, decoder_start_token_id=2), "seq2seq"),
    Arch("vit", "ViTForImageClassification", "ViTConfig",
         dict(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=64, num_labels=LABELS, **NO_DROPOUT), "image"),
    Arch("convnext", "ConvNextForImageClassification", "ConvNextConfig",
         dict(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, patch_size=2, num_labels=LABELS),
         "image"),
    Arch("resnet", "ResNetForImageClassification", "ResNetConfig",
         dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
              num_labels=LABELS), "image"),
    Arch("swin", "SwinForImageClassification", "SwinConfig",
         dict(image_size=2 * IMAGE, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
              window_size=4, num_labels=LABELS, drop_path_rate=0.0, **NO_DROPOUT), "image"),
    # Audio: a convolutional feature encoder, and a convolution whose weight is a weight-norm parametrization.
    Arch("wav2vec2", "Wav2Vec2ForCTC", "Wav2Vec2Config",
         dict(vocab_size=VOCAB // 4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
              num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
              feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
              ctc_loss_reduction="mean"), "speech"),
    Arch("whisper", "WhisperForConditionalGeneration", "WhisperConfig",
         dict(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32, max_source_positions=16,
              max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
              dropout=0.0), "speech2text"),
    # Two towers, text and vision, and a loss between them.
    Arch("clip", "CLIPModel", "CLIPConfig",
         dict(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=32),
              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=IMAGE, patch_size=4), projection_dim=16), "contrastive"),
]


# Models whose modules depend on the data: a mixture of experts that calls only the experts its router
# picked (SwitchTransformers keeps one module per expert), and layers skipped at random (BART's layer drop).
_BART = next(a for a in ZOO if a.name == "bart")
DATA_DEPENDENT = [
    Arch("switch", "SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig",
         dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
              num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64,
              router_jitter_noise=0.0, router_z_loss_coef=0.0, router_aux_loss_coef=0.0, dropout_rate=0.0,
              pad_token_id=0, eos_token_id=2, decoder_start_token_id=0), "seq2seq"),
    dataclasses.replace(_BART, name="bart-layerdrop",
                        kwargs=_BART.kwargs | dict(encoder_layerdrop=0.5, decoder_layerdrop=0.5)),
]


def available() -> list[Arch]:
    """The architectures of ZOO that the installed transformers has."""
    import transformers

    return [a for a in ZOO if hasattr(transformers, a.model) and hasattr(transformers, a.config)]


def by_name(name: str) -> Arch:
    return next(a for a in ZOO if a.name == name)


Loss = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
