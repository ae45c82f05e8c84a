"""Real public model code for the zoo: Hugging Face ``transformers`` models built from small
configs with seeded random weights (nothing is downloaded), held as users hold them — returning
a ``ModelOutput`` and called with the input the model's own ``forward`` names first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

IMAGE = 64  # pixels per side: small enough for CI, large enough for four stages of striding
TOKENS = 16
#: symbolic-sequence checks: shorter than traced, traced, longer (the zoo's position tables hold 64)
LENGTHS = (8, TOKENS, 48)
VOCAB = 500


_SHAPES = {"image": (3, IMAGE, IMAGE), "tokens": (TOKENS,), "audio": (16, 32)}  # audio: (mel bins, frames)


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build the model, and a sample input (batch 2) of the right kind.

    ``shape`` is one sample's shape without the batch; by default the test suite's small one.
    """

    name: str
    build: Callable[[], torch.nn.Module]
    kind: str  # 'image' | 'tokens' | 'audio'
    shape: tuple[int, ...] | None = None

    def sample(self, batch: int = 2, seed: int = 0, length: int | None = None) -> torch.Tensor:
        """A batch of inputs; ``length``: tokens per row instead of the default (text models)."""
        generator = torch.Generator().manual_seed(seed)
        shape = (batch, *(self.shape or _SHAPES[self.kind]))
        if length is not None:
            shape = (batch, length, *shape[2:])
        if self.kind == "tokens":
            return torch.randint(3, VOCAB, shape, generator=generator)
        return torch.randn(*shape, generator=generator)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = self.build()
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if norms:
            # Some model code initialises batch-norm scales like weights (transformers'
            # EfficientNet: γ ~ N(0, 0.02)); with the initial statistics (mean 0, variance 1) a
            # deep CNN's activations then shrink layer by layer to subnormal floats and its logits
            # to 1e-34: nothing to compare, and FP32 runs 10x slow on denormals. torch's own
            # initialisation (γ = 1, β = 0) and statistics measured on a few batches, as training
            # would leave them, keep every layer in range.
            for norm in norms:
                norm.reset_parameters()
                norm.momentum = None  # a cumulative average over the batches below
            model.train()
            with torch.no_grad():
                for seed in range(3):
                    model(self.sample(batch=4, seed=100 + seed))
        return model.eval()


def _t():
    import transformers

    return transformers


_TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def zoo() -> list[ZooModel]:
    """Every zoo model (vision, text and audio)."""
    t = _t()
    return [
        ZooModel("ResNet", lambda: t.ResNetForImageClassification(t.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], layer_type="bottleneck",
            num_labels=10)), "image"),
        ZooModel("ConvNeXt", lambda: t.ConvNextForImageClassification(t.ConvNextConfig(
            hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_labels=10)), "image"),
        ZooModel("MobileNetV2", lambda: t.MobileNetV2ForImageClassification(t.MobileNetV2Config(
            depth_multiplier=0.35, image_size=IMAGE, num_labels=10)), "image"),
        ZooModel("EfficientNet", lambda: t.EfficientNetForImageClassification(t.EfficientNetConfig(
            width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, image_size=IMAGE, num_labels=10)), "image"),
        ZooModel("RegNet", lambda: t.RegNetForImageClassification(t.RegNetConfig(
            embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], groups_width=8, num_labels=10)),
            "image"),
        ZooModel("ViT", lambda: t.ViTForImageClassification(t.ViTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=IMAGE,
            patch_size=16, num_labels=10)), "image"),
        ZooModel("Swin", lambda: t.SwinForImageClassification(t.SwinConfig(
            image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
            num_labels=10)), "image"),
        ZooModel("BERT", lambda: t.BertForSequenceClassification(t.BertConfig(
            **_TEXT, max_position_embeddings=64, num_labels=4)), "tokens"),
        ZooModel("DistilBERT", lambda: t.DistilBertForSequenceClassification(t.DistilBertConfig(
            vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64,
            num_labels=4)), "tokens"),
        ZooModel("RoBERTa", lambda: t.RobertaForSequenceClassification(t.RobertaConfig(
            **_TEXT, max_position_embeddings=66, num_labels=4)), "tokens"),
        ZooModel("GPT-2", lambda: t.GPT2LMHeadModel(t.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
            use_cache=False)), "tokens"),
        ZooModel("Llama", lambda: t.LlamaForCausalLM(t.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False)), "tokens"),
        ZooModel("Whisper encoder", lambda: t.WhisperModel(t.WhisperConfig(
            vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
            max_source_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1)).get_encoder(), "audio"),
    ]
