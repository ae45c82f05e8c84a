"""Small save_pretrained folders of several architectures and tasks, built here (random weights,
local tokenizers and processors; nothing downloaded), for the front door's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "model", "file", "is", "good", "bad",
         *(f"w{i}" for i in range(120))]
TEXT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}


def _bert_tokenizer(folder: Path) -> None:
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)


def bert(folder: Path, head: str = "BertForSequenceClassification", tokenizer: bool = True, **extra) -> Path:
    import transformers

    config = transformers.BertConfig(vocab_size=len(WORDS), num_labels=3, architectures=[head], **TEXT, **extra)
    torch.manual_seed(0)
    getattr(transformers, head)(config).eval().save_pretrained(folder)
    if tokenizer:
        _bert_tokenizer(folder)
    return folder


def distilbert_qa(folder: Path) -> Path:
    from transformers import DistilBertConfig, DistilBertForQuestionAnswering

    config = DistilBertConfig(vocab_size=len(WORDS), dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                              max_position_embeddings=64, architectures=["DistilBertForQuestionAnswering"])
    torch.manual_seed(0)
    DistilBertForQuestionAnswering(config).eval().save_pretrained(folder)
    _bert_tokenizer(folder)
    return folder


def roberta_tokens(folder: Path) -> Path:
    from transformers import RobertaConfig, RobertaForTokenClassification

    config = RobertaConfig(vocab_size=len(WORDS) + 4, num_labels=4, pad_token_id=1, **TEXT,
                           architectures=["RobertaForTokenClassification"])
    torch.manual_seed(0)
    RobertaForTokenClassification(config).eval().save_pretrained(folder)
    return folder


def vit(folder: Path) -> Path:
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    config = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                       patch_size=8, num_labels=5, architectures=["ViTForImageClassification"])
    torch.manual_seed(0)
    ViTForImageClassification(config).eval().save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def convnext(folder: Path) -> Path:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=64, num_labels=4,
                            architectures=["ConvNextForImageClassification"])
    torch.manual_seed(0)
    ConvNextForImageClassification(config).eval().save_pretrained(folder)
    return folder


def segformer(folder: Path) -> Path:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                             patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                             decoder_hidden_size=32, num_labels=3, image_size=64,
                             architectures=["SegformerForSemanticSegmentation"])
    torch.manual_seed(0)
    SegformerForSemanticSegmentation(config).eval().save_pretrained(folder)
    return folder


def wav2vec2(folder: Path, head: str = "Wav2Vec2ForCTC") -> Path:
    import transformers

    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, num_labels=3, architectures=[head], do_stable_layer_norm=False)
    torch.manual_seed(0)
    getattr(transformers, head)(config).eval().save_pretrained(folder)
    transformers.Wav2Vec2FeatureExtractor(sampling_rate=4000).save_pretrained(folder)
    return folder


def clip(folder: Path) -> Path:
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config={"vocab_size": len(WORDS), "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "intermediate_size": 64, "max_position_embeddings": 32},
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                           "image_size": 32, "patch_size": 8},
        projection_dim=16, architectures=["CLIPModel"])
    torch.manual_seed(0)
    CLIPModel(config).eval().save_pretrained(folder)
    return folder


def _saved(folder: Path, model: torch.nn.Module, tokenizer: bool = False) -> Path:
    model.config.architectures = [type(model).__name__]
    model.eval().save_pretrained(folder)
    if tokenizer:
        _bert_tokenizer(folder)
    return folder


def bert_head(head: str) -> Callable[[Path], Path]:
    """A BERT folder with another head (masked LM, multiple choice, or none: the bare encoder)."""
    def build(folder: Path) -> Path:
        import transformers

        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=len(WORDS), num_labels=3, **TEXT)
        return _saved(folder, getattr(transformers, head)(config), tokenizer=True)
    return build


def dinov2(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, image_size=32, patch_size=8)
    return _saved(folder, transformers.Dinov2Model(config))


def yolos(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.YolosConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                      image_size=[64, 64], patch_size=16, num_detection_tokens=5, num_labels=3)
    return _saved(folder, transformers.YolosForObjectDetection(config))


def detr(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    backbone = transformers.ResNetConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], embedding_size=16,
                                         out_features=["stage4"])
    config = transformers.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
                                     d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5,
                                     num_labels=3)
    return _saved(folder, transformers.DetrForObjectDetection(config))


def ast(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.ASTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    max_length=64, num_mel_bins=32, num_labels=3)
    _saved(folder, transformers.ASTForAudioClassification(config))
    transformers.ASTFeatureExtractor(num_mel_bins=32, max_length=64).save_pretrained(folder)
    return folder


def whisper_classifier(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                                        decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64,
                                        num_mel_bins=16, max_source_positions=50, num_labels=3, vocab_size=100)
    return _saved(folder, transformers.WhisperForAudioClassification(config))


FOLDERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "bert text-classification": (bert, "text-classification"),
    "distilbert question-answering": (distilbert_qa, "question-answering"),
    "roberta token-classification": (roberta_tokens, "token-classification"),
    "vit image-classification": (vit, "image-classification"),
    "convnext image-classification": (convnext, "image-classification"),
    "segformer semantic-segmentation": (segformer, "semantic-segmentation"),
    "wav2vec2 automatic-speech-recognition": (wav2vec2, "automatic-speech-recognition"),
    "clip zero-shot-image-classification": (clip, "zero-shot-image-classification"),
    "bert fill-mask": (bert_head("BertForMaskedLM"), "fill-mask"),
    "bert multiple-choice": (bert_head("BertForMultipleChoice"), "multiple-choice"),
    "bert feature-extraction": (bert_head("BertModel"), "feature-extraction"),
    "dinov2 image-feature-extraction": (dinov2, "image-feature-extraction"),
    "yolos object-detection": (yolos, "object-detection"),
    "detr object-detection": (detr, "object-detection"),
    "wav2vec2 audio-classification": (lambda f: wav2vec2(f, "Wav2Vec2ForSequenceClassification"), "audio-classification"),
    "ast audio-classification": (ast, "audio-classification"),
    "whisper audio-classification": (whisper_classifier, "audio-classification"),
}
