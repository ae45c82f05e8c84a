"""The front door: save_pretrained folders of several architectures and tasks, built here with random
weights and local tokenizers, exported by export_pretrained and the CLI; the files read by the onnx
checker, run by ONNX Runtime, and proven against the transformers model at two sizes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from onnxport import ONNXModel, export_pretrained
from onnxport.compare.exported import FLOAT_FLOOR_MULTIPLE
from onnxport.errors import InvalidArgumentError
from tests import pretrained_folders as folders

ROOT = Path(__file__).resolve().parents[1]

BERT_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]
EXPECTED = {  # task, or the folder's name where one task has several forms: (inputs, outputs)
    "text-classification": (BERT_INPUTS, ["logits"]),
    "fill-mask": (BERT_INPUTS, ["logits"]),
    "multiple-choice": (BERT_INPUTS, ["logits"]),
    "feature-extraction": (BERT_INPUTS, ["last_hidden_state", "pooler_output"]),
    "image-feature-extraction": (["pixel_values"], ["last_hidden_state", "pooler_output"]),
    "object-detection": (["pixel_values"], ["logits", "pred_boxes"]),
    "wav2vec2 audio-classification": (["input_values"], ["logits"]),
    "ast audio-classification": (["input_values"], ["logits"]),
    "whisper audio-classification": (["input_features"], ["logits"]),
    "question-answering": (["input_ids", "attention_mask"], ["start_logits", "end_logits"]),
    "token-classification": (["input_ids", "attention_mask", "token_type_ids"], ["logits"]),
    "image-classification": (["pixel_values"], ["logits"]),
    "semantic-segmentation": (["pixel_values"], ["logits"]),
    "automatic-speech-recognition": (["input_values"], ["logits"]),
    "zero-shot-image-classification": (["input_ids", "attention_mask", "pixel_values"],
                                       ["logits_per_image", "logits_per_text", "text_embeds", "image_embeds"]),
}


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", sorted(folders.FOLDERS))
def test_every_folder_exports_with_its_names_axes_and_proofs(tmp_path, name):
    build, task = folders.FOLDERS[name]
    source = build(tmp_path / "model")
    result = export_pretrained(source, tmp_path / "out")  # task='auto': read from config.json
    inputs, outputs = EXPECTED.get(name, EXPECTED.get(task, ([], [])))
    assert result.task == task and result.inputs == inputs and result.outputs == outputs
    assert result.path == tmp_path / "out" / "model.onnx"
    onnx.checker.check_model(str(result.path), full_check=True)
    graph = onnx.load(str(result.path), load_external_data=False).graph
    assert [v.name for v in graph.input] == inputs and [v.name for v in graph.output] == outputs
    for value in graph.input:  # batch (and sequence, audio length) symbolic, as the record says
        for axis, label in result.axes[value.name].items():
            assert _dims(value)[axis] == label
    assert result.axes[inputs[0]][0] in ("batch", "text_batch")
    if task == "multiple-choice":  # the choices are an axis of their own
        assert result.axes["input_ids"] == {0: "batch", 1: "choices", 2: "sequence"}
    # proven at two sizes of every symbolic axis, each output within the model's own float floor
    assert [p["size"] for p in result.proofs] == ["sample", "one longer on every symbolic axis"]
    for proof in result.proofs:
        assert proof["passed"] and {o["name"] for o in proof["outputs"]} == set(outputs)
        for o in proof["outputs"]:
            assert o["float_distance"] <= FLOAT_FLOOR_MULTIPLE * max(o["float_floor"], 2**-24)
    record = json.loads((tmp_path / "out" / "onnxport.json").read_text())
    assert record["task"] == task and [i["name"] for i in record["inputs"]] == inputs
    assert record["outputs"] == outputs and record["quantization"] is None and len(record["proofs"]) == 2
    assert (tmp_path / "out" / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_int8_from_a_text_file(tmp_path):
    source = folders.bert(tmp_path / "bert")
    lines = tmp_path / "calibration.txt"
    lines.write_text("\n".join(f"the model w{i} is good w{i + 3} file" for i in range(24)) + "\n\n")
    # tokenized to 24 tokens, not the sample's 16: the sequence axis is symbolic
    result = export_pretrained(source, tmp_path / "out", quantize="int8", calibration=lines, calibration_length=24)
    assert result.quantization == {"scheme": "pt2e static INT8", "target": "onnxruntime", "calibration_batches": 3}
    graph = onnx.load(str(result.path), load_external_data=False).graph
    assert [v.name for v in graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(_dims(v)[:2] == ["batch", "sequence"] for v in graph.input)
    assert sum(n.op_type == "QuantizeLinear" for n in graph.node) > 4
    # proven against its pt2e model within twice that model's own rounding floor (or cosine >= 0.9999),
    # on what it was calibrated for: the first calibration batch's lines, at the sample's shapes
    (proof,) = result.proofs
    assert proof["size"] == "first calibration batch"
    assert proof["shapes"] == {"input_ids": [2, 24], "attention_mask": [2, 24], "token_type_ids": [2, 24]}
    for o in proof["outputs"]:
        assert o["cosine_similarity"] >= 0.9999 or 1 - o["cosine_similarity"] <= 2 * (1 - min(o["rounding_floor"]))


def test_the_cli_passes_the_calibration_length_on_and_refuses_it_where_it_means_nothing(tmp_path):
    source = folders.bert(tmp_path / "bert")
    lines = tmp_path / "calibration.txt"
    lines.write_text("\n".join(f"the model w{i} is good w{i + 3} file" for i in range(8)) + "\n")
    settings = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 20}))
    # the flag reaches export_pretrained: the length is held to the folder's tokenizer there
    cases = ((str(source), ["--quantize", "int8", "--calibration", str(lines)],
              "longer than the 20 tokens the folder's tokenizer allows"),
             (str(source), ["--quantize", "dynamic"], "calibration_length sets the tokens of a text file's lines"),
             ("tests.cli_models:tiny_mlp", ["--input-shape", "2,16"], "--calibration-length is for a save_pretrained"))
    for model, argv, said in cases:
        refused = _cli("export", model, "-o", str(tmp_path / "refused"), "--calibration-length", "24", *argv)
        assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr
        assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("scheme, bits, group", [("int4", 4, 32), ("int8-weight-only", 8, None)])
def test_weight_only_needs_no_calibration_and_keeps_torchaos_integers(tmp_path, scheme, bits, group):
    from onnxport.pretrained.export import int4_group

    source = folders.bert(tmp_path / "bert")
    result = export_pretrained(source, tmp_path / "out", quantize=scheme)
    expected = {"scheme": f"torchao int{bits}_weight_only", **({"group_size": group} if group else {})}
    assert result.quantization == expected
    graph = onnx.load(str(result.path), load_external_data=False).graph
    assert [v.name for v in graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(_dims(v)[:2] == ["batch", "sequence"] for v in graph.input)
    integer_type = onnx.TensorProto.INT4 if bits == 4 else onnx.TensorProto.INT8
    weights = [t for t in graph.initializer if t.data_type == integer_type]
    # every Linear of the BERT (6 per layer), its pooler and its classifier
    linears = 6 * folders.TEXT["num_hidden_layers"] + 2
    assert len(weights) == sum(n.op_type == "DequantizeLinear" for n in graph.node) == linears
    (proof,) = result.proofs  # within twice the torchao model's own rounding floor, as the file's ONNX semantics
    assert proof["passed"] and all(o["passed"] for o in proof["outputs"])
    # int4 groups: 128 input features, or the largest power of two dividing every width (32 here)
    assert int4_group(torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.Linear(384, 8))) == 128
    assert int4_group(torch.nn.Sequential(torch.nn.Linear(48, 8), torch.nn.Linear(96, 8))) == 16


def test_dynamic_int8_in_one_command_without_calibration(tmp_path):
    source = folders.bert(tmp_path / "bert")
    done = _cli("export", str(source), "-o", str(tmp_path / "out"), "--quantize", "dynamic")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "out" / "onnxport.json").read_text())
    assert record["quantization"]["scheme"].startswith("pt2e dynamic INT8")
    (proof,) = record["proofs"]  # as deployed: ORT's fused DynamicQuantizeMatMul
    assert proof["passed"] and all(o["passed"] for o in proof["outputs"])
    (logits,) = proof["outputs"]
    # six decimals, or the distance from 1 where six decimals would read 1.000000
    distance = 1 - logits["cosine_similarity"]
    printed = f"1 - {distance:.1e}" if distance < 5e-7 else f"{logits['cosine_similarity']:.6f}"
    assert f"logits cosine {printed} (its rounding floor" in done.stdout
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulInteger") == 6 * folders.TEXT["num_hidden_layers"] + 2 and "QuantizeLinear" not in ops
    assert [v.name for v in graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(_dims(v)[:2] == ["batch", "sequence"] for v in graph.input)


def test_int8_from_a_folder_of_images_through_the_folders_image_processor(tmp_path):
    from PIL import Image

    source = folders.vit(tmp_path / "vit")
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):  # sizes unlike the model's 32x32: the folder's processor resizes them
        Image.fromarray(rng.integers(0, 256, (40 + 7 * i, 50, 3), dtype=np.uint8)).save(images / f"{i}.png")
    result = export_pretrained(source, tmp_path / "out", quantize="int8", calibration=images)
    assert result.quantization["calibration_batches"] == 1
    (proof,) = result.proofs
    assert proof["passed"] and proof["size"] == "first calibration batch"
    assert proof["shapes"] == {"pixel_values": [1, 3, 32, 32]}


@pytest.mark.parametrize("build", [lambda f: folders.wav2vec2(f, "Wav2Vec2ForSequenceClassification"), folders.ast],
                         ids=["waveform", "spectrogram"])
def test_int8_from_a_folder_of_audio_files_through_the_folders_feature_extractor(tmp_path, build):
    import soundfile

    source = build(tmp_path / "model")
    clips = tmp_path / "clips"
    clips.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):  # clips of several lengths: the extractor pads or cuts them to the file's input
        soundfile.write(str(clips / f"{i}.wav"), (0.1 * rng.standard_normal(2000 + 900 * i)).astype(np.float32), 16000)
    result = export_pretrained(source, tmp_path / "out", quantize="int8", calibration=clips)
    assert result.quantization["calibration_batches"] == 1 and result.proofs[0]["passed"]
    # a .npz whose frames the file does not take is named before anything is written
    np.savez(tmp_path / "short.npz", **{result.inputs[0]: np.zeros((2, 10, 32), np.float32)})
    if result.inputs[0] == "input_values" and len(result.axes["input_values"]) == 1:
        (tmp_path / "again").mkdir()
        _refused(tmp_path / "again", "fixes axis 1 at 64", source, quantize="int8", calibration=tmp_path / "short.npz")


def test_the_file_runs_with_the_folders_tokenizer(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = folders.bert(tmp_path / "bert")
    result = export_pretrained(source, tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")  # copied beside the file
    encoded = tokenizer(["the model is good", "a bad file w3 w4 w5 w6 w7"], padding=True, return_tensors="np")
    logits = ONNXModel(result.path)(**dict(encoded))
    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in encoded.items()}).logits.numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)


def test_an_encoder_decoders_encoder_and_a_tower_saved_alone_are_feature_extraction(tmp_path):
    """T5's embeddings come from its encoder alone (the decoder needs ids the task has not got), and
    a text tower saved by itself is a class AutoModel does not load: both export as feature-extraction."""
    import transformers

    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).eval()
    t5.save_pretrained(tmp_path / "t5")
    result = export_pretrained(tmp_path / "t5", tmp_path / "out", task="feature-extraction")
    assert result.inputs == ["input_ids", "attention_mask"] and result.outputs == ["last_hidden_state"]
    ids = torch.tensor([[5, 9, 3, 1], [7, 2, 1, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        expected = t5.encoder(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    got = ONNXModel(result.path)(input_ids=ids.numpy(), attention_mask=mask.numpy())
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # a family transformers' text-encoding table does not list: its encoder class by its naming
    from onnxport.pretrained.tasks import TASKS, model_class

    base = TASKS["feature-extraction"]
    assert model_class(base, ["LongT5ForConditionalGeneration"], "longt5") == "LongT5EncoderModel"
    assert model_class(base, ["BertForMaskedLM"], "bert") == "AutoModelForTextEncoding"  # BertModel, as AutoModel
    assert model_class(base, ["BartForConditionalGeneration"], "bart") == "AutoModel"  # no encoder class

    # Stable Diffusion's text encoder: its own class, with the projection AutoModelForTextEncoding's
    # CLIPTextModel would leave out
    tower = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=16, projection_dim=8))
    folder = folders._saved(tmp_path / "clip", tower)
    result = export_pretrained(folder, tmp_path / "out2")  # task='auto'
    assert result.task == "feature-extraction" and result.outputs == ["text_embeds", "last_hidden_state"]
    assert all(proof["passed"] for proof in result.proofs)


def _refused(tmp_path: Path, match: str, source, **kwargs) -> None:
    out = tmp_path / "out"
    with pytest.raises(InvalidArgumentError, match=match):
        export_pretrained(source, out, **kwargs)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_bad_sources_are_refused_by_name_with_nothing_written(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(tmp_path, "has no config.json", empty)
    _refused(tmp_path, "is not a folder", tmp_path / "missing")
    source = folders.bert(tmp_path / "bert", tokenizer=False)
    _refused(tmp_path, "task='summarize' is not one onnxport exports; give one of: audio-classification", source,
             task="summarize")
    _refused(tmp_path, "text-generation.*export_decoder", source, task="text-generation")
    _refused(tmp_path, "needs calibration data", source, quantize="int8")
    _refused(tmp_path, "quantize must be one of 'int8', 'dynamic'", source, quantize="int2")
    _refused(tmp_path, "calibration is only read with quantize='int8'", source, quantize="int4",
             calibration=tmp_path / "calibration.txt")
    _refused(tmp_path, r"calibration 'x\.csv' does not exist", source, quantize="int8", calibration="x.csv")
    _refused(tmp_path, "calibration_length must be a positive integer, not 0", source, quantize="int8",
             calibration=tmp_path / "calibration.txt", calibration_length=0)
    _refused(tmp_path, r"calibration_length sets the tokens of a text file's lines; calibration='x\.npz'", source,
             quantize="int8", calibration="x.npz", calibration_length=32)
    _refused(tmp_path, "calibration_length=100 is longer than the model's 64 positions", source, quantize="int8",
             calibration=tmp_path / "calibration.txt", calibration_length=100)
    bad = tmp_path / "data.csv"
    bad.write_text("1,2,3\n")
    _refused(tmp_path, r"is a \.csv file; give a text file", source, quantize="int8", calibration=bad)
    text = tmp_path / "calibration.txt"
    text.write_text("the model is good\n")
    _refused(tmp_path, "needs a tokenizer", source, quantize="int8", calibration=text)


def test_custom_code_is_refused_unless_trusted_and_nothing_from_the_folder_runs(tmp_path):
    source = folders.bert(tmp_path / "bert", tokenizer=False)
    config = json.loads((source / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "evil.Model"}
    (source / "config.json").write_text(json.dumps(config))
    (source / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    _refused(tmp_path, "names custom code.*trust_remote_code=True", source)
    assert not (tmp_path / "ran").exists()


def test_unreadable_weights_and_an_unknown_architecture_are_named(tmp_path):
    source = folders.bert(tmp_path / "bert", tokenizer=False)
    (source / "model.safetensors").write_bytes(b"not safetensors")
    _refused(tmp_path, "the weights in .* cannot be", source)
    causal = tmp_path / "causal"
    shutil.copytree(folders.bert(tmp_path / "bert2", tokenizer=False), causal)
    config = json.loads((causal / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForTeleportation"]
    (causal / "config.json").write_text(json.dumps(config))
    _refused(tmp_path, "NoSuchModelForTeleportation, which no task onnxport exports lists", causal)
    # a base checkpoint asked for a head it has not got: transformers would make the head up
    base = folders.bert(tmp_path / "base", head="BertModel", tokenizer=False)
    _refused(tmp_path, r"classifier\.bias, classifier\.weight the folder does not hold \(it was saved as BertModel\)",
             base, task="text-classification")


def test_an_existing_output_folder_keeps_its_other_files(tmp_path):
    source = folders.vit(tmp_path / "vit")
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    result = export_pretrained(source, out)
    assert (out / "README.md").read_text() == "mine" and result.path.is_file()
    assert (out / "preprocessor_config.json").is_file()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxport", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, check=False)


def test_the_cli_exports_a_folder_in_one_command_and_refuses_with_exit_2(tmp_path):
    source = folders.convnext(tmp_path / "convnext")
    done = _cli("export", str(source), "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "image-classification" in done.stdout and "proven at the sample size" in done.stdout
    # each proof's figure, as onnxport.json records it: the worst output against its float floor
    record = json.loads((tmp_path / "out" / "onnxport.json").read_text())
    worst = [max(o["float_distance"] / max(o["float_floor"], 2**-24) for o in p["outputs"]) for p in record["proofs"]]
    assert [f"at most {w:.2f}x its float floor" in done.stdout for w in worst] == [True, True]
    assert (tmp_path / "out" / "model.onnx").is_file() and (tmp_path / "out" / "onnxport.json").is_file()
    refused = _cli("export", str(source), "-o", str(tmp_path / "out2"), "--quantize", "int8")
    assert refused.returncode == 2 and "needs calibration data" in refused.stderr and "Traceback" not in refused.stderr
    wrong = _cli("export", str(source), "-o", str(tmp_path / "out3"), "--input-shape", "1,3,64,64")
    assert wrong.returncode == 2 and "--input-shape is for package.module:callable" in wrong.stderr
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
