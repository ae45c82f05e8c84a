"""export_seq2seq and generate on encoder–decoder folders: the files as promised, and the tokens
transformers' generate picks, family by family, greedy and beam search, on batches with padding."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from onnxport.errors import ExportRefusedError, InvalidArgumentError
from onnxport.llm import export_seq2seq, generate
from tests.conftest import families

from .seq2seq_models import FAMILIES, SMALL, VOCAB, WHISPER_TOKENS, bart_like, longt5, whisper


def _source(model, rows: int = 3, length: int = 9, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Prompts with left padding on two rows (transformers' tokenizers pad seq2seq sources on the right
    by default; left padding is the harder case for positions, and generate must honour the mask either way)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, VOCAB, (rows, length))
    mask = np.ones_like(ids)
    pad = model.config.pad_token_id
    mask[1, :3], ids[1, :3] = 0, pad
    mask[2, -2:], ids[2, -2:] = 0, pad  # right padding too
    return ids, mask


def _transformers(model, ids, mask, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **kwargs).numpy()


SEARCHES = [
    {"max_new_tokens": 12},
    {"max_new_tokens": 12, "num_beams": 3},
    {"max_new_tokens": 10, "num_beams": 4, "length_penalty": 2.0, "early_stopping": True},
    {"max_new_tokens": 10, "num_beams": 3, "num_return_sequences": 2, "early_stopping": "never", "length_penalty": 0.5},
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made: dict[str, tuple] = {}
    #: each model's weights and forward as they were given to export_seq2seq
    before: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            model = FAMILIES[family]()
            folder = tmp_path_factory.mktemp(family) / "onnx"
            before[family] = {k: v.clone() for k, v in model.state_dict().items()}, model.forward
            made[family] = model, export_seq2seq(model, folder)
        return made[family]

    get.before = before
    return get


# bart: learned positions and its adapter; t5: relative position bias and a tied, scaled head (the rest,
# Marian's sinusoidal positions and logits bias among them, repeat these with variations: -m slow)
@pytest.mark.parametrize("family", families(sorted(FAMILIES), by_default=("bart", "t5")))
def test_files_generate_what_transformers_generates(family, exported):
    model, result = exported(family)
    assert result.token_agreement == 1.0 and result.agreement and result.encoder_agreement
    ids, mask = _source(model)
    ended_early = False
    for search in SEARCHES:
        expected = _transformers(model, ids, mask, **search)
        got = generate(result.folder, ids, mask, **search)
        assert got.shape == expected.shape and np.array_equal(got, expected), (search, got, expected)
        ended_early |= bool((got[:, 1:-1] == model.config.eos_token_id).any())
    # the searches are not vacuous: some rows end before the limit
    assert ended_early
    # forced language tokens (mBART, M2M100) come right after the start token
    forced = model.generation_config.forced_bos_token_id
    if forced is not None:
        assert (generate(result.folder, ids, mask, max_new_tokens=3)[:, 1] == forced).all()


def test_the_files_are_one_encoder_and_one_decoder_with_a_growing_cache(exported):
    model, result = exported("t5")
    layers = model.config.num_decoder_layers
    encoder = onnx.load(str(result.encoder))
    decoder = onnx.load(str(result.decoder))
    onnx.checker.check_model(encoder, full_check=True)
    onnx.checker.check_model(decoder, full_check=True)
    assert [i.name for i in encoder.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in encoder.graph.output] == ["last_hidden_state"] + [
        f"present.{i}.encoder.{k}" for i in range(layers) for k in ("key", "value")]
    names = [i.name for i in decoder.graph.input]
    assert names[:2] == ["input_ids", "encoder_attention_mask"]
    assert names[2:6] == ["past_key_values.0.decoder.key", "past_key_values.0.decoder.value",
                          "past_key_values.0.encoder.key", "past_key_values.0.encoder.value"]
    assert len(names) == 2 + 4 * layers
    assert [o.name for o in decoder.graph.output] == ["logits"] + [
        f"present.{i}.decoder.{k}" for i in range(layers) for k in ("key", "value")]
    # one graph for every step: no If holding two, and the cache lengths are symbolic
    assert not any(n.op_type == "If" for n in decoder.graph.node)
    past = decoder.graph.input[2].type.tensor_type.shape.dim
    assert past[2].dim_param == "past_sequence" and past[0].dim_param == "batch"
    cross = decoder.graph.input[4].type.tensor_type.shape.dim
    assert cross[2].dim_param == "source"
    # the encoder file holds no decoder weights (the decoder's part of the trace is dead there)
    query = model.decoder.block[0].layer[0].SelfAttention.q.weight.detach().numpy()

    def holds(graph: onnx.GraphProto) -> bool:  # as stored, or transposed for a MatMul
        arrays = [onnx.numpy_helper.to_array(t) for t in graph.initializer]
        return any(np.array_equal(a, query) or np.array_equal(a.T, query) for a in arrays if a.ndim == 2)

    assert holds(decoder.graph) and not holds(encoder.graph)
    folder = result.folder
    assert json.loads((folder / "generation_config.json").read_text())["decoder_start_token_id"] == 0
    assert json.loads((folder / "config.json").read_text())["model_type"] == "t5"
    assert "t5" in result.summary() and "100.0%" in result.summary()


def test_a_generator_loads_the_folder_once_and_generates_the_same(exported):
    from onnxport.llm import Seq2SeqGenerator

    model, result = exported("t5")
    generator = Seq2SeqGenerator(result.folder)
    ids, mask = _source(model)
    for search in SEARCHES[:2]:
        assert np.array_equal(generator.generate(ids, mask, **search), generate(result.folder, ids, mask, **search))
        assert np.array_equal(generate(generator, ids, mask, **search), _transformers(model, ids, mask, **search))
    with pytest.raises(InvalidArgumentError, match="no encoder_model.onnx"):
        Seq2SeqGenerator(result.folder.parent)


def test_a_generator_process_never_imports_torch(exported):
    import subprocess
    import sys

    _, result = exported("t5")
    script = ("import sys, numpy as np\n"
              "from onnxport.llm import Seq2SeqGenerator\n"
              f"ids = Seq2SeqGenerator({str(result.folder)!r}).generate(np.array([[5, 6, 7]]), np.ones((1, 3), np.int64), "
              "max_new_tokens=2)\n"
              "print('torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout


def test_sampling_is_seeded(exported):
    model, result = exported("bart")
    ids, mask = _source(model)
    first = generate(result.folder, ids, mask, max_new_tokens=8, do_sample=True, top_k=20, seed=4)
    again = generate(result.folder, ids, mask, max_new_tokens=8, do_sample=True, top_k=20, seed=4)
    other = generate(result.folder, ids, mask, max_new_tokens=8, do_sample=True, top_k=20, seed=5)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    greedy = generate(result.folder, ids, mask, max_new_tokens=8)
    assert not np.array_equal(first, greedy)
    # a generation config that samples is followed by default, and do_sample=False overrides it
    config = result.folder / "generation_config.json"
    saved = config.read_text()
    config.write_text(json.dumps({**json.loads(saved), "do_sample": True, "top_k": 20}))
    try:
        assert not np.array_equal(generate(result.folder, ids, mask, max_new_tokens=8, seed=4), greedy)
        assert np.array_equal(generate(result.folder, ids, mask, max_new_tokens=8, do_sample=False), greedy)
    finally:
        config.write_text(saved)


@pytest.fixture(scope="module")
def whisper_files(tmp_path_factory):
    model = whisper()
    return model, export_seq2seq(model, tmp_path_factory.mktemp("whisper") / "onnx")


def _features(rows: int = 3) -> np.ndarray:
    return torch.randn(rows, 16, 200, generator=torch.Generator().manual_seed(5)).numpy()


def _text_tokens(row: np.ndarray, prompt: int) -> list[int]:
    """What WhisperForConditionalGeneration.generate returns for a row: the text tokens only (the
    prompt, the end token and the padding after it stripped)."""
    tokens = row[prompt:].tolist()
    if WHISPER_TOKENS["eos"] in tokens:
        tokens = tokens[:tokens.index(WHISPER_TOKENS["eos"])]
    return tokens


@pytest.mark.parametrize("options", [{"language": "de"}, {"language": "en", "task": "translate"}, {},
                                     {"language": "de", "num_beams": 3}])
def test_whisper_from_features_generates_what_transformers_generates(whisper_files, options):
    from transformers.generation.utils import GenerationMixin

    model, result = whisper_files
    assert result.token_agreement == 1.0 and result.shape.frames == 200
    features = _features()
    got = generate(result.folder, input_features=features, max_new_tokens=20, **options)
    t = WHISPER_TOKENS
    assert (got[:, 0] == t["start"]).all() and (got[:, 3] == t["no_timestamps"]).all()
    assert (got[:, 2] == t["translate" if options.get("task") == "translate" else "transcribe"]).all()
    if "language" in options:
        assert (got[:, 1] == t[options["language"]]).all()
    else:  # detected as transformers detects it
        with torch.no_grad():
            detected = model.detect_language(input_features=torch.from_numpy(features)).numpy().ravel()
        assert got[:, 1].tolist() == detected.tolist()
    with torch.no_grad():
        # the same search from the same prompt, by transformers' generic generate ...
        plain = GenerationMixin.generate(model, torch.from_numpy(features), decoder_input_ids=torch.from_numpy(got[:, :4]),
                                         max_new_tokens=20, num_beams=options.get("num_beams", 1)).numpy()
        # ... and by Whisper's own, which returns the text tokens only
        whispered = model.generate(input_features=torch.from_numpy(features), max_new_tokens=20,
                                   **{**options, "language": options.get("language") or "en"}).numpy()
    assert np.array_equal(got, plain)
    if "language" in options:
        for row, theirs in zip(got, whispered):
            assert _text_tokens(row, 4) == [x for x in theirs.tolist() if x != t["pad"]]


def test_longt5_local_attention_generates_at_lengths_in_and_out_of_whole_blocks(tmp_path):
    """LongT5 splits its source into blocks of 5, padding the last one only where the length is not
    a whole number of blocks (a branch on the length, which its adapter's capture takes out): the
    file, captured at one length, generates what transformers generates at 9 (padded) and 10
    (whole) tokens, with padding on both sides."""
    model = longt5()
    result = export_seq2seq(model, tmp_path / "onnx")
    assert result.token_agreement == 1.0
    for length in (9, 10):
        ids, mask = _source(model, length=length)
        for search in SEARCHES[:2]:
            assert np.array_equal(generate(result.folder, ids, mask, **search), _transformers(model, ids, mask, **search))


@pytest.mark.slow  # a whole capture (48 s on 2 cores) to see a refusal: CI is over its 30 minutes
def test_longt5_transient_global_attention_is_refused_naming_the_fixed_length(tmp_path):
    # torch.export proves the source length fixed (its global blocks' count guards on it): the
    # export says which axis and leaves nothing behind
    with pytest.raises(InvalidArgumentError, match="fixes the size of 'input_ids' axis 1"):
        export_seq2seq(longt5("transient-global"), tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_english_only_whisper_takes_no_language(whisper_files, tmp_path):
    import shutil

    # an English-only checkpoint differs from the multilingual one only in its generation config
    # (the same seed gives the same weights, and export writes that config as the model has it):
    # the exported files with that config are what exporting the English-only model writes
    _, result = whisper_files
    folder = tmp_path / "onnx"
    shutil.copytree(result.folder, folder)
    whisper(multilingual=False).generation_config.to_json_file(folder / "generation_config.json")
    got = generate(folder, input_features=_features(2), max_new_tokens=6)
    assert (got[:, :2] == [WHISPER_TOKENS["start"], WHISPER_TOKENS["no_timestamps"]]).all()
    english = whisper(multilingual=False)
    with torch.no_grad():
        theirs = english.generate(input_features=torch.from_numpy(_features(2)), max_new_tokens=6).numpy()
    for row, their in zip(got, theirs):
        assert _text_tokens(row, 2) == [x for x in their.tolist() if x != WHISPER_TOKENS["pad"]]
    with pytest.raises(InvalidArgumentError, match="English-only"):
        generate(folder, input_features=_features(2), language="de")


def test_whisper_at_30_seconds_gets_a_genai_config_that_names_its_files(whisper_files, tmp_path):
    import dataclasses
    import shutil

    from onnxport.llm.seq2seq import genai_names, write_genai_config

    _, short = whisper_files  # 2 s of frames: onnxruntime-genai's Whisper takes 30 s only
    assert short.genai_config is None and not (short.folder / "genai_config.json").exists()
    model = whisper(source_positions=1500)
    result = export_seq2seq(model, tmp_path / "onnx")
    assert result.genai_config == result.folder / "genai_config.json" and result.shape.frames == 3000
    config = json.loads(result.genai_config.read_text())
    # onnxruntime-genai binds by name and feeds only what it names: every input of both files is
    # named, and every name is the named file's input or output
    for file, (inputs, outputs) in genai_names(config, result.shape.layers).items():
        graph = onnx.load(result.folder / file, load_external_data=False).graph
        assert set(inputs) == {v.name for v in graph.input}
        assert set(outputs) <= {v.name for v in graph.output}
    described = config["model"]
    assert described["type"] == "whisper" and described["vocab_size"] == VOCAB
    assert described["decoder_start_token_id"] == WHISPER_TOKENS["start"]
    assert described["eos_token_id"] == WHISPER_TOKENS["eos"]
    decoder = described["decoder"]
    assert decoder["num_hidden_layers"] == SMALL["decoder_layers"]
    assert decoder["num_attention_heads"] * decoder["head_size"] == SMALL["d_model"]
    assert not config["search"]["past_present_share_buffer"]  # present = past + new, not a buffer
    # a configuration naming what the files lack is refused before it is written
    stage = tmp_path / "stage"
    shutil.copytree(result.folder, stage, ignore=shutil.ignore_patterns("genai_config.json"))
    with pytest.raises(ExportRefusedError, match=r"present\.2\.encoder\.key"):
        write_genai_config(model, dataclasses.replace(result.shape, layers=3), stage)
    assert not (stage / "genai_config.json").exists()


def test_a_shared_embedding_is_stored_once_and_both_files_read_it(tmp_path):
    import shutil

    import transformers

    # a table of 8200 x 32 float32 (1 MB): large enough to be worth sharing
    config = transformers.BartConfig(vocab_size=8200, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2, init_std=0.5, **SMALL)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval()
    table = model.get_input_embeddings().weight.detach().numpy()
    result = export_seq2seq(model, tmp_path / "onnx")
    assert result.shared_weights and result.token_agreement == 1.0
    # the decoder's copy of the table is the encoder's bytes, read from the encoder's data file
    decoder = onnx.load(result.decoder, load_external_data=False)
    location = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in decoder.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    assert {n for n, file in location.items() if file == "encoder_model.onnx.data"} == set(result.shared_weights)
    assert {file for n, file in location.items() if n not in result.shared_weights} == {"decoder_model.onnx.data"}
    stored = sum(f.stat().st_size for f in result.folder.iterdir() if "model.onnx" in f.name)
    assert table.nbytes < stored < 1.9 * table.nbytes  # once, not twice
    onnx.checker.check_model(str(result.decoder))
    # BART's encoder, decoder and head share the table: each file holds it once (the head reads it
    # transposed, not as a second, folded copy; at 1 MB the exporter keeps it out of onnxslim's
    # constant folding, as it does at real sizes)
    for path in (result.encoder, result.decoder):
        graph = onnx.load(str(path)).graph
        copies = [t.name for t in graph.initializer if sorted(t.dims) == sorted(table.shape)
                  and np.array_equal(np.sort(onnx.numpy_helper.to_array(t), axis=None), np.sort(table, axis=None))]
        assert len(copies) == 1, (path.name, copies)
    full = onnx.load(str(result.decoder))
    assert any(np.array_equal(onnx.numpy_helper.to_array(t), table) for t in full.graph.initializer)
    ids, mask = _source(model)
    np.testing.assert_array_equal(generate(result.folder, ids, mask, max_new_tokens=8),
                                  _transformers(model, ids, mask, max_new_tokens=8))
    # a folder that lost the encoder's data file is named, not a raw runtime error
    broken = tmp_path / "broken"
    shutil.copytree(result.folder, broken)
    (broken / "encoder_model.onnx.data").unlink()
    with pytest.raises(InvalidArgumentError, match=r"encoder_model\.onnx\.data"):
        generate(broken, ids, mask, max_new_tokens=2)


def test_bad_input_is_named_and_nothing_is_written(tmp_path, exported):
    import transformers

    out = tmp_path / "out"
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(InvalidArgumentError, match="decoder-only.*export_decoder"):
        export_seq2seq(llama, out)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64))
    with pytest.raises(InvalidArgumentError, match="not an encoder-decoder"):
        export_seq2seq(bert, out)
    bart = FAMILIES["bart"]()
    with pytest.raises(InvalidArgumentError, match="folder"):
        export_seq2seq(bart, tmp_path / "model.onnx")
    with pytest.raises(InvalidArgumentError, match="precision"):
        export_seq2seq(bart, out, precision="int3")
    with pytest.raises(InvalidArgumentError, match="config.json"):
        export_seq2seq(tmp_path, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert all(p.dtype == torch.float32 for p in bart.parameters())

    model, result = exported("bart")
    ids, mask = _source(model)
    with pytest.raises(InvalidArgumentError, match="input_features"):
        generate(result.folder, input_features=np.zeros((1, 16, 200), np.float32))
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        generate(result.folder, ids + 1000)
    with pytest.raises(InvalidArgumentError, match="num_return_sequences"):
        generate(result.folder, ids, mask, num_beams=2, num_return_sequences=3)
    with pytest.raises(InvalidArgumentError, match="positions"):
        generate(result.folder, ids, mask, max_new_tokens=100)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "encoder_model.onnx").write_bytes(result.encoder.read_bytes())
    with pytest.raises(InvalidArgumentError, match="decoder_model.onnx"):
        generate(empty, ids)


def test_the_model_given_is_not_changed(exported):
    model, _ = exported("bart")
    before, forward = exported.before["bart"]
    assert model.forward == forward and not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _word_tokenizer(folder, special: dict[str, int], prompt: tuple[int, ...] = ()):
    """A word-level tokenizer over the small vocabulary: ``w{i}`` for id i, the model's special
    tokens named, and ``prompt`` ids (Whisper's language and task tokens) special as a real
    checkpoint's tokenizer marks them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {**{f"<{name}>": index for name, index in special.items()}, **{f"<|{i}|>": i for i in prompt}}
    vocab = {**{f"w{i}": i for i in range(VOCAB) if i not in names.values()}, **names}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w3",
                                        additional_special_tokens=[f"<|{i}|>" for i in prompt],
                                        **{f"{name}_token": f"<{name}>" for name in special})
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_cli_exports_a_text_folder_and_generates_text(tmp_path, capsys):
    """(A speech folder through the command line: Moonshine in test_seq2seq_speech.py, and Whisper's
    ``--audio`` in the long-form test below.)"""
    from onnxport.cli import main

    bart = FAMILIES["bart"]()
    source = tmp_path / "bart"
    bart.save_pretrained(source)
    tokenizer = _word_tokenizer(source, {"pad": 1, "eos": 2})
    out = tmp_path / "bart-onnx"
    assert main(["export", str(source), "-o", str(out)]) == 0
    assert "100.0%" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file() and (out / "encoder_model.onnx").is_file()
    assert main(["generate", str(out), "--text", "w11 w12 w13 w14", "--text", "w50 w51", "--max-new-tokens", "6",
                 "--num-beams", "2"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    batch = tokenizer(["w11 w12 w13 w14", "w50 w51"], return_tensors="np", padding=True)
    expected = _transformers(bart, batch["input_ids"], batch["attention_mask"], max_new_tokens=6, num_beams=2)
    assert printed == tokenizer.batch_decode(expected, skip_special_tokens=True)
    assert main(["generate", str(out), "--ids", "11,12,13", "--max-new-tokens", "4"]) == 0
    ids = np.array([[11, 12, 13]])
    assert capsys.readouterr().out.split() == [",".join(map(str, _transformers(bart, ids, np.ones_like(ids),
                                                                                  max_new_tokens=4)[0]))]


@pytest.fixture(scope="module")
def trained_bart():
    """A small BART trained for a few seconds to reverse six tokens: its greedy tokens carry
    meaning, so a quantized file's agreement with them is a fair measure."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=48, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=32,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0)
    model = BartForConditionalGeneration(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        source = torch.randint(10, 48, (64, 6), generator=generator)
        target = torch.cat([source.flip(1), torch.full((64, 1), 2)], 1)
        loss = model(input_ids=source, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    source = torch.randint(10, 48, (16, 6), generator=generator).numpy()
    expected = _transformers(model, source, np.ones_like(source), max_new_tokens=8)
    assert (expected[:, 1:7] == source[:, ::-1]).mean() > 0.95  # it learnt the task
    return model, source, expected


# 'ort-cpu' by default: its integers are the portable file's, then moved into MatMulNBits (the portable
# int4 step itself runs by default in the decoder tests of test_llm.py)
@pytest.mark.parametrize(("precision", "flavour"), [pytest.param("int4", "portable", marks=pytest.mark.slow),
                                                    pytest.param("int8", "portable", marks=pytest.mark.slow),
                                                    ("int4", "ort-cpu")])
def test_weight_only_files_of_a_trained_model_generate_its_tokens(trained_bart, precision, flavour, tmp_path):
    from onnxport.exporters.weight_only import file_weights

    model, source, expected = trained_bart
    result = export_seq2seq(model, tmp_path / "onnx", precision=precision, group_size=32, flavour=flavour)
    assert result.agreement and result.encoder_agreement
    # every Linear of the encoder, the decoder and the cross-attention, and the head tied to the
    # embeddings, is stored as torchao's integers, once, in the file that reads it; the lookups
    # keep the float table, and the model given stays tied
    stored = {**file_weights(result.encoder), **file_weights(result.decoder)}
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head.weight" in linears and set(stored) == linears
    table = model.get_input_embeddings().weight.detach().numpy()
    decoder = onnx.load(result.decoder)
    assert any(i.data_type == onnx.TensorProto.FLOAT and np.array_equal(onnx.numpy_helper.to_array(i), table)
               for i in decoder.graph.initializer)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert all(w["dtype"] == (onnx.TensorProto.INT4 if precision == "int4" else onnx.TensorProto.INT8)
               for w in stored.values())
    assert not set(file_weights(result.encoder)) & set(file_weights(result.decoder))
    # 'ort-cpu': the integers in ONNX Runtime's MatMulNBits, held once in memory (read back as above)
    assert {r for w in stored.values() for r in w["readers"]} == ({"MatMulNBits"} if flavour == "ort-cpu" else {"MatMul"})
    if flavour == "ort-cpu":  # BART's attention fused as in the fp32 'ort-cpu' file
        assert result.fusions["decoder_model.onnx"].get("MultiHeadAttention", 0) == 2 * model.config.decoder_layers
    got = generate(result.folder, source, np.ones_like(source), max_new_tokens=8)
    assert got.shape == expected.shape and (got == expected).mean() >= 0.9


@pytest.mark.slow  # float16 seq2seq runs by default through the BART test below (ort-cpu, from the CLI)
def test_fp16_whisper_generates_what_the_half_model_generates(tmp_path):
    from transformers.generation.utils import GenerationMixin

    # weights of a trained model's scale: float16's rounding then stays well inside the proof's bound
    # on every CPU (at init_std 0.5 the logits reach cosine 0.99994 with the half model, near 0.9999)
    model = whisper(init_std=0.2)
    result = export_seq2seq(model, tmp_path / "onnx", precision="fp16")
    encoder = onnx.load(str(result.encoder), load_external_data=False)
    assert encoder.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model given is left in float32
    features = _features(2)
    got = generate(result.folder, input_features=features, max_new_tokens=10, language="de")
    with torch.no_grad():
        half = GenerationMixin.generate(model.half(), torch.from_numpy(features).half(),
                                        decoder_input_ids=torch.from_numpy(got[:, :4]), max_new_tokens=10).numpy()
    assert got.shape == half.shape and (got == half).mean() >= 0.9


def test_fp16_file_from_the_llm_command_clamps_where_the_half_model_clamps(tmp_path, capsys):
    """In float16 BART's encoder layers clamp their output when some value is not finite
    (``if not torch.isfinite(x).all()``, a branch torch.export cannot capture): the file holds that
    clamp as data flow and clamps exactly when the half model does. Through ``onnxport llm`` on a
    saved folder, in 'ort-cpu': the folder's model is loaded and halved in place, then fused."""
    from onnxport.cli import main

    model = bart_like("BartConfig", "BartForConditionalGeneration", 12.0, init_std=0.2)()
    ids, mask = _source(model)
    with torch.no_grad():
        # one channel of the last encoder layer overflows float16; the decoder reads that channel
        # through zero weights, so a file that did not clamp would give infinity times zero: NaN
        model.get_encoder().layers[-1].final_layer_norm.weight[0] = 1e6
        for layer in model.get_decoder().layers:
            layer.encoder_attn.k_proj.weight[:, 0] = 0
            layer.encoder_attn.v_proj.weight[:, 0] = 0
    source, out = tmp_path / "bart", tmp_path / "bart-onnx"
    model.save_pretrained(source)
    half = model.half()
    with torch.no_grad():
        clamped = half.get_encoder()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))[0]
    assert (clamped.abs() == torch.finfo(torch.float16).max - 1000).any()  # the model's branch was taken
    assert main(["llm", str(source), "-o", str(out), "--precision", "fp16", "--flavour", "ort-cpu"]) == 0
    assert "fp16, ort-cpu" in capsys.readouterr().out
    ops = {node.op_type for node in onnx.load(str(out / "encoder_model.onnx"), load_external_data=False).graph.node}
    assert "Where" in ops and ({"IsInf", "IsNaN"} & ops)
    decoder = onnx.load(str(out / "decoder_model.onnx"), load_external_data=False)
    assert "MultiHeadAttention" in {n.op_type for n in decoder.graph.node}
    assert decoder.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    got = generate(out, ids, mask, max_new_tokens=8)
    expected = _transformers(half, ids, mask, max_new_tokens=8)
    assert got.shape == expected.shape and (got == expected).mean() >= 0.9


# t5: attention with its relative position bias; bart's fusion (no bias) also runs in the default run
# in the trained BART's int4 'ort-cpu' file
@pytest.mark.parametrize("family", families(["bart", "t5"], by_default=("t5",)))
def test_ort_cpu_flavour_fuses_attention_and_generates_the_same_tokens(family, tmp_path):
    model = FAMILIES[family]()
    result = export_seq2seq(model, tmp_path / "onnx", flavour="ort-cpu")
    layers = result.shape.layers
    # self- and cross-attention of every decoder layer, and the encoder's, as MultiHeadAttention
    assert result.fusions["decoder_model.onnx"]["MultiHeadAttention"] == 2 * layers
    encoder_layers = model.config.num_layers if family == "t5" else model.config.encoder_layers
    assert result.fusions["encoder_model.onnx"]["MultiHeadAttention"] == encoder_layers
    assert "MultiHeadAttention" in result.summary()
    ids, mask = _source(model)
    for search in SEARCHES[:2]:
        assert np.array_equal(generate(result.folder, ids, mask, **search), _transformers(model, ids, mask, **search))


@pytest.fixture(scope="module")
def whisper_timestamps(tmp_path_factory):
    """A small Whisper with 20 timestamp tokens (0.00 to 0.38 s), exported."""
    model = whisper(timestamps=20)
    return model, export_seq2seq(model, tmp_path_factory.mktemp("whisper_timestamps") / "onnx")


def _whisper_rows(got: np.ndarray, theirs: Any, prompt: int) -> None:
    """Our rows (prompt, text, end token, padding) hold the text tokens Whisper's generate returns."""
    sequences = theirs["sequences"] if isinstance(theirs, dict) else theirs
    pad = WHISPER_TOKENS["pad"]
    for row, expected in zip(got, sequences.numpy()):
        text = _text_tokens(row, prompt)
        while text and text[-1] == pad:  # a row whose last window ran out of new tokens ends unfinished
            text.pop()
        assert text == [x for x in expected.tolist() if x != pad]


@pytest.mark.parametrize("options", [{"language": "de"}, {"language": "en", "num_beams": 2}])
def test_whisper_with_timestamps_generates_what_transformers_generates(whisper_timestamps, options):
    model, result = whisper_timestamps
    features = _features()
    t = WHISPER_TOKENS
    got = generate(result.folder, input_features=features, return_timestamps=True, max_new_tokens=20, **options)
    # no no-timestamps token in the prompt, and the text opens with a timestamp (the ids after it)
    assert (got[:, 3] > t["no_timestamps"]).all()
    with torch.no_grad():
        # after the last pair of timestamps in the window, Whisper decodes the rest of the audio
        # again from there, as a further segment: the segments are what it returns
        theirs = model.generate(input_features=torch.from_numpy(features), return_timestamps=True, max_new_tokens=20,
                                **options)
    _whisper_rows(got, theirs, 3)


@pytest.mark.parametrize("options", [{"language": "de"}, {"language": "en", "num_beams": 2}, {}])
def test_whisper_longer_than_its_window_generates_what_transformers_generates(whisper_timestamps, options):
    """Audio past the encoder's window (here 200 frames, 2 s), rows of three lengths: decoded a
    window at a time from where each row's last complete segment ended, timestamps on by
    themselves, as transformers' long-form generate does it."""
    model, result = whisper_timestamps
    features = torch.randn(3, 16, 530, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 530, dtype=torch.long)
    mask[1, 410:] = 0
    mask[2, 250:] = 0
    got = generate(result.folder, input_features=features.numpy(), attention_mask=mask.numpy(), max_new_tokens=20,
                   **options)
    with torch.no_grad():
        theirs = model.generate(input_features=features, attention_mask=mask, return_timestamps=True,
                                max_new_tokens=20, return_segments=True, **{"language": "en", **options})
    _whisper_rows(got, theirs, 3)
    # not one window: segments start in later windows, and one seeks to a timestamp inside a window
    starts = [[float(segment["start"]) for segment in row] for row in theirs["segments"]]
    assert max(map(max, starts)) >= 4.0 and any(s % 2.0 > 0.01 for row in starts for s in row[1:]), starts
    # one row alone needs no mask
    alone = generate(result.folder, input_features=features[2:, :, :250].numpy(), max_new_tokens=20, **options)
    assert np.array_equal(alone[0], got[2, :alone.shape[1]]) and (got[2, alone.shape[1]:] == WHISPER_TOKENS["pad"]).all()


def test_cli_transcribes_a_sound_file_longer_than_the_window(whisper_timestamps, tmp_path, capsys):
    """A clip of 5 s for a 2 s window: the whole clip, not its first window, as Whisper's
    long-form generate transcribes it."""
    import shutil

    import soundfile
    from transformers import WhisperFeatureExtractor

    from onnxport.cli import main

    model, result = whisper_timestamps
    folder = tmp_path / "whisper"
    shutil.copytree(result.folder, folder)
    extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, n_samples=32000, chunk_length=2, hop_length=160)
    extractor.save_pretrained(folder)
    t = WHISPER_TOKENS
    stamps = tuple(range(t["no_timestamps"] + 1, model.config.vocab_size))
    tokenizer = _word_tokenizer(folder, {"pad": t["pad"], "eos": t["eos"]},
                                prompt=(t["start"], t["en"], t["de"], t["translate"], t["transcribe"], t["no_timestamps"],
                                        *stamps))
    wave = (np.sin(np.arange(80000) / 7.0) * np.sin(np.arange(80000) / 3100.0)).astype(np.float32) * 0.3
    soundfile.write(tmp_path / "long.wav", wave, 16000)
    assert main(["generate", str(folder), "--audio", str(tmp_path / "long.wav"), "--language", "de",
                 "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.strip()
    features = extractor(wave, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest")
    assert features["input_features"].shape[-1] == 500
    with torch.no_grad():
        theirs = model.generate(input_features=features["input_features"], language="de", max_new_tokens=12,
                                return_timestamps=True, return_segments=True)
    assert printed == tokenizer.batch_decode(theirs["sequences"], skip_special_tokens=True)[0]
    assert float(theirs["segments"][0][-1]["start"]) >= 2.0  # past the first window
    # a sound file at another rate than the feature extractor's is refused, naming the rate it needs
    soundfile.write(tmp_path / "clip8k.wav", wave[:24000], 8000)
    assert main(["generate", str(folder), "--audio", str(tmp_path / "clip8k.wav")]) == 2
    assert "16000 Hz" in capsys.readouterr().err


def test_whisper_longer_than_its_window_is_refused_without_what_it_needs(whisper_timestamps):
    _, result = whisper_timestamps
    features = np.zeros((2, 16, 300), np.float32)
    with pytest.raises(InvalidArgumentError, match="return_timestamps=True"):
        generate(result.folder, input_features=features[:1], return_timestamps=False, language="en")
    with pytest.raises(InvalidArgumentError, match="give attention_mask"):
        generate(result.folder, input_features=features, language="en")
    with pytest.raises(InvalidArgumentError, match=r"shaped \[batch, frames\] = \[2, 300\]"):
        generate(result.folder, input_features=features, attention_mask=np.ones((2, 200), np.int64), language="en")
    with pytest.raises(InvalidArgumentError, match="num_return_sequences"):
        generate(result.folder, input_features=features[:1], language="en", num_beams=2, num_return_sequences=2)
    with pytest.raises(InvalidArgumentError, match=r"\[batch, 16, frames\]"):
        generate(result.folder, input_features=np.zeros((1, 12, 300), np.float32), language="en")
