"""Speech encoder–decoders that take audio of any length with a mask (Speech2Text's log-mel frames,
Moonshine's waveform): the encoder file takes the source and its mask at any length and gives the
decoder the mask of its own output positions, computed as the model computes it; the pair
generates what transformers generates on padded batches of lengths the export never saw."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from onnxport.errors import ExportRefusedError, InvalidArgumentError
from onnxport.llm import export_seq2seq, generate

from .seq2seq_models import MORE_SPEECH, SPEECH


def _batch(model, seconds: list[float], seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Clips of these lengths, padded on the right to the longest as the feature extractors pad
    them (zeros, masked): log-mel frames at 100 a second, or 16 kHz samples."""
    rng = np.random.default_rng(seed)
    waveform = model.main_input_name == "input_values"
    steps = [int(s * (16000 if waveform else 100)) for s in seconds]
    width = () if waveform else (model.config.input_feat_per_channel,)
    source = np.zeros((len(steps), max(steps), *width), np.float32)
    mask = np.zeros((len(steps), max(steps)), np.int64)
    for row, n in enumerate(steps):
        source[row, :n] = rng.standard_normal((n, *width)) * (0.1 if waveform else 1.0)
        mask[row, :n] = 1
    return source, mask


def _transformers(model, source, mask, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return model.generate(**{model.main_input_name: torch.from_numpy(source)},
                              attention_mask=torch.from_numpy(mask), **kwargs).numpy()


def _check_files(model, folder) -> None:
    """The encoder takes any length and gives the model's own mask of its output positions."""
    import onnxruntime as ort

    encoder = onnx.load(str(folder / "encoder_model.onnx"), load_external_data=False)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in encoder.graph.input}
    source = model.main_input_name
    assert list(inputs) == [source, "attention_mask"]
    assert isinstance(inputs[source][1], str) and inputs["attention_mask"][1] == inputs[source][1]
    assert encoder.graph.output[-1].name == "encoder_attention_mask"
    decoder = onnx.load(str(folder / "decoder_model.onnx"), load_external_data=False)
    assert [i.name for i in decoder.graph.input][:2] == ["input_ids", "encoder_attention_mask"]

    session = ort.InferenceSession(str(folder / "encoder_model.onnx"), providers=["CPUExecutionProvider"])
    for seconds in ([1.3, 0.6], [0.45, 0.9, 0.9]):
        features, mask = _batch(model, seconds)
        theirs = model.get_encoder()(torch.from_numpy(features), attention_mask=torch.from_numpy(mask))
        got = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {source: features, "attention_mask": mask})))
        length = theirs.last_hidden_state.shape[1]
        expected = getattr(theirs, "attention_mask", None)
        if expected is None:
            expected = model.model._get_feature_vector_attention_mask(length, torch.from_numpy(mask))
        assert got["last_hidden_state"].shape[1] == length
        # a padded row's mask ends early: the decoder must not read its padding
        assert np.array_equal(got["encoder_attention_mask"], expected.numpy())
        assert got["encoder_attention_mask"][1].sum() < length or got["encoder_attention_mask"][0].sum() < length


def _check_generation(model, folder) -> None:
    """Padded batches of lengths the export never saw generate what transformers generates."""
    source, mask = _batch(model, [1.1, 0.5, 0.8])
    for search in ({"max_new_tokens": 12}, {"max_new_tokens": 10, "num_beams": 3}):
        got = generate(folder, **{model.main_input_name: source}, attention_mask=mask, **search)
        assert np.array_equal(got, _transformers(model, source, mask, **search))
    # one clip alone, no mask given: all of it is audio
    n = int(mask[1].sum())
    alone = generate(folder, **{model.main_input_name: source[1:2, :n]}, max_new_tokens=12)
    assert np.array_equal(alone, _transformers(model, source[1:2, :n], mask[1:2, :n], max_new_tokens=12))


def _check_bad_input(model, folder) -> None:
    source, mask = _batch(model, [0.5, 0.4])
    name = model.main_input_name
    other = "input_features" if name == "input_values" else "input_values"
    with pytest.raises(InvalidArgumentError, match=f"give {name}"):
        generate(folder, input_ids=[[3, 4, 5]])
    with pytest.raises(InvalidArgumentError, match=f"give {name}"):
        generate(folder, **{other: source})
    with pytest.raises(InvalidArgumentError, match="attention_mask must be 0/1 and shaped"):
        generate(folder, **{name: source}, attention_mask=mask[:, :-3])
    with pytest.raises(InvalidArgumentError, match="Whisper's"):
        generate(folder, **{name: source}, attention_mask=mask, language="de")
    with pytest.raises(InvalidArgumentError, match=f"{name} must be"):
        generate(folder, **{name: source[..., None]})


@pytest.mark.parametrize("family", sorted(MORE_SPEECH))
def test_other_speech_families_run_apart_as_their_own_forward_runs(family):
    """SpeechT5 (its mask downsampled in its encoder's prenet, its decoder's ids called
    input_values) and a Wav2Vec2 + BERT SpeechEncoderDecoder (the composite's input called inputs,
    its decoder giving logits itself): their shapes are read and the two files' forwards compute
    what each model's own forward computes on a padded batch."""
    from onnxport.llm.seq2seq_model import check_split, sample_source, seq2seq_shape, start_token

    model = MORE_SPEECH[family]()
    shape = seq2seq_shape(model)
    assert shape.source == "input_values" and shape.speech_mask and shape.source_dims == (None,)
    check_split(model, shape, start_token(model))
    _, mask = sample_source(model, 2, 6)
    assert mask[1].sum() < mask[0].sum()  # the check ran a padded row


def test_a_model_whose_forward_does_more_than_its_decoder_and_head_is_refused(tmp_path):
    """Its decoder file runs the decoder and head apart from the model's forward: a forward that
    changes the logits on the way out is found before anything is written."""
    from transformers import Speech2TextForConditionalGeneration

    class Tempered(Speech2TextForConditionalGeneration):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits / 2.0
            return output

    model = SPEECH["speech2text"]()
    model.__class__ = Tempered
    with pytest.raises(ExportRefusedError, match="do not compute what its own forward computes"):
        export_seq2seq(model, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def _exported_through_the_cli(model, tmp_path, capsys):
    """A saved folder with its feature extractor and tokenizer, exported by ``onnxport export``
    and transcribing a sound file by ``onnxport generate --audio``, as transformers does."""
    import soundfile
    from transformers import Wav2Vec2FeatureExtractor

    from onnxport.cli import main

    from .test_seq2seq import _word_tokenizer

    source = tmp_path / "model"
    model.save_pretrained(source)
    extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=False,
                                         return_attention_mask=True)
    extractor.save_pretrained(source)
    tokenizer = _word_tokenizer(source, {"pad": 1, "eos": 2})
    out = tmp_path / "onnx"
    assert main(["export", str(source), "-o", str(out), "--task", "automatic-speech-recognition"]) == 0
    assert "100.0%" in capsys.readouterr().out
    wave = (np.sin(np.arange(14000) / 5.0) * 0.3).astype(np.float32)
    soundfile.write(tmp_path / "clip.wav", wave, 16000)
    assert main(["generate", str(out), "--audio", str(tmp_path / "clip.wav"), "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out.strip()
    given = extractor(wave, sampling_rate=16000, return_tensors="np")
    theirs = _transformers(model, given["input_values"], given["attention_mask"], max_new_tokens=8)
    assert printed == tokenizer.batch_decode(theirs, skip_special_tokens=True)[0]
    assert main(["generate", str(out), "--audio", str(tmp_path / "clip.wav"), "--language", "de"]) == 2
    assert "Whisper's" in capsys.readouterr().err
    return out


@pytest.mark.parametrize("family", sorted(SPEECH))
def test_speech_of_any_length_exports_and_generates_what_transformers_generates(family, tmp_path, capsys):
    """Speech2Text by the Python API from the model; Moonshine by the command line from its
    saved folder, a sound file through its own feature extractor."""
    model = SPEECH[family]()
    if model.main_input_name == "input_values":
        folder = _exported_through_the_cli(model, tmp_path, capsys)
    else:
        result = export_seq2seq(model, tmp_path / "onnx")
        assert result.token_agreement == 1.0 and result.shape.source_dims == (None, 20)
        folder = result.folder
    _check_files(model, folder)
    _check_generation(model, folder)
    _check_bad_input(model, folder)
