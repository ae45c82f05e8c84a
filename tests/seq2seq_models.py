"""Small encoder–decoders of several families, built here with random weights (scaled up so their
greedy and beam searches pick varied tokens and end at different lengths; nothing downloaded)."""

from __future__ import annotations

from collections.abc import Callable

import torch

VOCAB = 100
SMALL = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}


def _ending(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Make the end token likelier (its output row scaled), so searches end at different lengths."""
    with torch.no_grad():
        model.get_output_embeddings().weight[model.config.eos_token_id] *= factor
    return model


def bart_like(config_class: str, model_class: str, ending: float, forced_bos: int | None = None,
               **extra) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        config = getattr(transformers, config_class)(
            vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2, **{"init_std": 0.5, **SMALL, **extra})
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(config).eval()
        if forced_bos is not None:  # as multilingual checkpoints' generation_config.json set it
            model.generation_config.forced_bos_token_id = forced_bos
        return _ending(model, ending)

    return build


def t5_v1_1() -> torch.nn.Module:
    """T5 v1.1: relative position bias, gated-GELU feed-forward, an untied head."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1, initializer_factor=5.0, relative_attention_num_buckets=8)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).eval()
    if model.lm_head.weight is model.shared.weight:  # transformers ties them whatever the config says
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 5.0)
        model.config.tie_word_embeddings = False
    return _ending(model, 3.0)


def t5() -> torch.nn.Module:
    """The original T5: ReLU feed-forward, the head tied to the embeddings (and scaled)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=5.0)
    torch.manual_seed(1)
    return _ending(T5ForConditionalGeneration(config).eval(), 3.0)


def longt5(attention: str = "local") -> torch.nn.Module:
    """A small LongT5: attention within blocks of ``local_radius + 1`` = 5 tokens and their
    neighbours (``'local'``), or with each block of 4 summarised as well (``'transient-global'``)."""
    from transformers import LongT5Config, LongT5ForConditionalGeneration

    config = LongT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, local_radius=4,
                          global_block_size=4, encoder_attention_type=attention, decoder_start_token_id=0,
                          pad_token_id=0, eos_token_id=1, initializer_factor=1.0)
    torch.manual_seed(1)
    return _ending(LongT5ForConditionalGeneration(config).eval(), 3.0)


#: scaled embeddings (Marian, M2M100, mBART), sinusoidal positions (Marian, M2M100), forced
#: language tokens (mBART, M2M100: forced_bos_token_id), the end forced at the limit (BART)
FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "bart": bart_like("BartConfig", "BartForConditionalGeneration", 12.0, forced_eos_token_id=2),
    "t5-v1.1": t5_v1_1,
    "t5": t5,
    "marian": bart_like("MarianConfig", "MarianMTModel", 2.0, scale_embedding=True),
    "m2m100": bart_like("M2M100Config", "M2M100ForConditionalGeneration", 4.0, forced_bos=7, scale_embedding=True),
    "mbart": bart_like("MBartConfig", "MBartForConditionalGeneration", 5.0, forced_bos=9, scale_embedding=True),
    "pegasus": bart_like("PegasusConfig", "PegasusForConditionalGeneration", 2.0, scale_embedding=True),
}

#: Whisper's special tokens in this small vocabulary: every one below no-timestamps, so no
#: generated token counts as a timestamp (transformers treats ids above it as times)
WHISPER_TOKENS = {"pad": 89, "eos": 90, "start": 92, "en": 93, "de": 94, "translate": 95, "transcribe": 96,
                  "no_timestamps": 99}


def whisper(multilingual: bool = True, timestamps: int = 0, init_std: float = 0.5,
            source_positions: int = 100) -> torch.nn.Module:
    """A small Whisper with 2 s of frames (max_source_positions 100), its generation config as a
    multilingual checkpoint's (languages, tasks, suppressed tokens); ``timestamps`` adds that many
    timestamp tokens after no-timestamps (the vocabulary grows by them); ``init_std`` scales the
    random weights (large ones give varied tokens, small ones activations float16 holds well);
    ``source_positions`` 1500 gives a checkpoint's 30 s of frames."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    t = WHISPER_TOKENS
    config = WhisperConfig(vocab_size=VOCAB + timestamps, num_mel_bins=16, max_source_positions=source_positions, max_target_positions=64,
                           pad_token_id=t["pad"], bos_token_id=t["eos"], eos_token_id=t["eos"],
                           decoder_start_token_id=t["start"], init_std=init_std, **SMALL)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=t["start"], eos_token_id=t["eos"], pad_token_id=t["pad"], bos_token_id=t["eos"],
        max_length=64, no_timestamps_token_id=t["no_timestamps"], suppress_tokens=[91, 97, 98],
        begin_suppress_tokens=[t["eos"]], **({"max_initial_timestamp_index": 5} if timestamps else {}),
        **({"is_multilingual": True, "lang_to_id": {"<|en|>": t["en"], "<|de|>": t["de"]},
            "task_to_id": {"translate": t["translate"], "transcribe": t["transcribe"]}} if multilingual else {}))
    return model


def speech2text() -> torch.nn.Module:
    """A small Speech2Text: log-mel frames of any length ``[batch, frames, 20]`` with their mask,
    two stride-2 convolutions (a quarter of the frames reach the encoder layers)."""
    from transformers import Speech2TextConfig, Speech2TextForConditionalGeneration

    config = Speech2TextConfig(vocab_size=VOCAB, max_source_positions=200, max_target_positions=64,
                               input_feat_per_channel=20, input_channels=1, num_conv_layers=2, conv_channels=32,
                               init_std=1.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                               **SMALL)
    torch.manual_seed(0)
    return _ending(Speech2TextForConditionalGeneration(config).eval(), 3.0)


def moonshine() -> torch.nn.Module:
    """A small Moonshine: a 16 kHz waveform of any length with its mask, three strided convolutions
    (one encoder position per 384 samples), rotary positions."""
    from transformers import MoonshineConfig, MoonshineForConditionalGeneration

    config = MoonshineConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=2,
                             decoder_num_hidden_layers=2, encoder_num_attention_heads=4, decoder_num_attention_heads=4,
                             max_position_embeddings=64, initializer_range=1.0, pad_token_id=1, bos_token_id=1,
                             eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    return _ending(MoonshineForConditionalGeneration(config).eval(), 3.0)


def speecht5() -> torch.nn.Module:
    """A small SpeechT5 for speech to text: a waveform, its mask downsampled by its encoder's
    prenet, a text decoder that calls its token ids ``input_values``."""
    from transformers import SpeechT5Config, SpeechT5ForSpeechToText

    config = SpeechT5Config(vocab_size=VOCAB, hidden_size=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                            conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=4, max_text_positions=64, initializer_range=0.5,
                            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    return _ending(SpeechT5ForSpeechToText(config).eval(), 3.0)


def wav2vec2_bert() -> torch.nn.Module:
    """A SpeechEncoderDecoder of a Wav2Vec2 encoder and a BERT decoder: the composite names its
    input ``inputs``, and its decoder is a causal LM that gives logits itself."""
    from transformers import BertConfig, SpeechEncoderDecoderConfig, SpeechEncoderDecoderModel, Wav2Vec2Config

    encoder = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                             num_conv_pos_embedding_groups=4, feat_extract_norm="layer", do_stable_layer_norm=True)
    decoder = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, is_decoder=True, add_cross_attention=True, pad_token_id=1,
                         initializer_range=0.5)
    config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    model = SpeechEncoderDecoderModel(config).eval()
    model.generation_config.update(decoder_start_token_id=0, pad_token_id=1, eos_token_id=2)
    return model


#: Speech encoder–decoders of any length, by name.
SPEECH = {"speech2text": speech2text, "moonshine": moonshine}
#: More of them, held to the split check here (exported by hand: see docs/seq2seq.md).
MORE_SPEECH = {"speecht5": speecht5, "wav2vec2-bert": wav2vec2_bert}
