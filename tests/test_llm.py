"""LLM decoders with a key/value cache: export_decoder's files generate what transformers generates.

Every model is built here from a config (random weights, or trained in the test on a synthetic
task); nothing is downloaded. The oracle is transformers' own ``generate``: greedy, 64 new tokens,
a batch of two prompts, the second padded on the left.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

transformers = pytest.importorskip("transformers")

from onnxport import DecoderFile, export_decoder, generate
from onnxport.errors import ExportRefusedError, InvalidArgumentError
from onnxport.llm.names import past_names
from onnxport.passes.ort_fusions import OrtFusionPass
from tests.conftest import families

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
_SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _config(family: str, layers: int = 2):
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    extra = {
        "llama": {}, "qwen2": {}, "mistral": {}, "phi3": {"pad_token_id": 0},
        "qwen3": {"head_dim": 16}, "gemma": {"head_dim": 16},
        # a window shorter than the text: its layers must attend to the last 16 tokens only
        "gemma2": {"head_dim": 16, "sliding_window": 16},
    }[family]
    configs = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
               "phi3": "Phi3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config"}
    return getattr(transformers, configs[family])(**{**_SMALL, "num_hidden_layers": layers}, **extra)


def _model(family: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(_config(family, layers)).eval()


def _prompts(seed: int = 1, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # the second prompt is three tokens shorter, padded on the left
    return ids, mask


def _transformers_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int = 64) -> np.ndarray:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out.numpy()


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


# llama: the base; gemma2: soft-capping and alternating windows (qwen3's q/k norms, phi3's fused
# projections and GPT-2's learned positions and Conv1D are captured the same way for their 'ort-cpu'
# tests, which run by default and generate token for token; qwen2, mistral, gemma repeat these)
@pytest.mark.parametrize("family", families(["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gpt2"],
                                            by_default=("llama", "gemma2")))
def test_fp32_decoder_generates_what_transformers_generates(family, tmp_path):
    model = _model(family)
    result = export_decoder(model, tmp_path / "decoder.onnx")
    assert isinstance(result, DecoderFile) and Path(result).is_file() and result.agreement and result.deployed

    header = onnx.load_model(str(result), load_external_data=False)
    layers = model.config.num_hidden_layers
    assert [i.name for i in header.graph.input] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    assert [o.name for o in header.graph.output] == ["logits"] + [
        f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    inputs = {i.name: _dims(i) for i in header.graph.input}
    assert inputs["input_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"][0] == "batch" and isinstance(inputs["attention_mask"][1], str)
    assert inputs["past_key_values.0.key"][0::2] == ["batch", "past_sequence"]

    ids, mask = _prompts()
    expected = _transformers_greedy(model, ids, mask)
    got = generate(result, ids, mask, max_new_tokens=64, eos_token_id=None)
    np.testing.assert_array_equal(got, expected)


@pytest.fixture(scope="module")
def ort_cpu_llama(tmp_path_factory):
    # three layers: the first two captured, the second repeated (onnxport.llm.repeat), then fused
    model = _model("llama", layers=3)
    return model, export_decoder(model, tmp_path_factory.mktemp("ort-cpu") / "llama.onnx", flavour="ort-cpu")


def _check_fusions(result: DecoderFile) -> None:
    assert result.fusions, "the 'ort-cpu' flavour fused nothing"
    in_file = [n.op_type for n in onnx.load_model(str(result), load_external_data=False).graph.node]
    for op, count in result.fusions.items():
        assert in_file.count(op) == count, (op, count, in_file.count(op))


def test_ort_cpu_flavour_fuses_and_generates_the_same_tokens(ort_cpu_llama):
    model, result = ort_cpu_llama
    _check_fusions(result)
    layers = model.config.num_hidden_layers
    assert result.repeated and layers == 3
    # each layer: one GroupQueryAttention, and its two residual adds with the RMS norms after
    # them as SkipSimplifiedLayerNormalization (the first norm reads the embedding: no add)
    assert result.fusions == {"GroupQueryAttention": layers, "SkipSimplifiedLayerNormalization": 2 * layers,
                              "RMSNormalization": 1, "RotaryEmbedding": 2 * layers}
    graph = ir.load(str(result))
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert kv_heads < heads
    attentions = [n for n in graph.graph if n.op_type == "GroupQueryAttention"]
    for attention in attentions:
        assert attention.domain == "com.microsoft"
        assert (attention.attributes["num_heads"].value, attention.attributes["kv_num_heads"].value) == (heads, kv_heads)
        # the cache stays grouped and is the file's own past and present: the kernel appends to
        # it, no Concat or Expand copies it to every query head
        past_key, past_value = attention.inputs[3:5]
        assert past_key.is_graph_input() and past_value.is_graph_input()
        assert all(out.is_graph_output() for out in attention.outputs[1:3])
    assert {v.name for a in attentions for v in a.outputs[1:3]} == {v.name for v in graph.graph.outputs[1:]}
    assert not {"Attention", "Concat"} & {n.op_type for v in graph.graph.outputs for n in [v.producer()] if n is not None}
    ids, mask = _prompts(seed=2)
    np.testing.assert_array_equal(generate(result, ids, mask, 64, eos_token_id=None),
                                  _transformers_greedy(model, ids, mask))


def test_generating_with_a_written_file_never_imports_torch(ort_cpu_llama):
    # a process that only generates holds ONNX Runtime and NumPy: torch alone costs ~0.3 GB
    _, result = ort_cpu_llama
    script = ("import sys, numpy as np\n"
              "from onnxport.llm import generate\n"
              f"ids = generate({str(result)!r}, np.array([[5, 6, 7]]), np.ones((1, 3), np.int64), 2)\n"
              "print(ids.shape, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout


def test_ort_cpu_int4_file_holds_matmul_nbits_with_the_portable_files_integers(tmp_path):
    # ORT fusing the pair at load kept both the file's int4 tensors and its repacked copies in
    # memory; written as MatMulNBits, the file holds them once
    from onnxport.exporters.weight_only import file_weights

    model = _model("llama")
    portable = export_decoder(model, tmp_path / "portable.onnx", precision="int4", group_size=32)
    fused = export_decoder(model, tmp_path / "ort-cpu.onnx", precision="int4", group_size=32, flavour="ort-cpu")
    header = onnx.load_model(str(fused), load_external_data=False)
    # the weights beside the file at every size, which ONNX Runtime maps instead of copying
    assert Path(f"{fused}.data").is_file() and all(t.data_location == onnx.TensorProto.EXTERNAL
                                                   for t in header.graph.initializer if t.ByteSize() > 1024)
    nodes = header.graph.node
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert [n.op_type for n in nodes].count("MatMulNBits") == linears and "DequantizeLinear" not in {n.op_type for n in nodes}
    assert {a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"} == {4}
    held, written = file_weights(portable), file_weights(fused)
    assert held.keys() == written.keys() and len(held) == linears
    for name, entry in written.items():  # the very integers, scales and blocks torchao gave the portable file
        assert entry["readers"] == ["MatMulNBits"] and entry["block_size"] == held[name]["block_size"] == 32
        assert np.array_equal(entry["q"], held[name]["q"]) and np.array_equal(entry["scale"], held[name]["scale"])
    # proven with float activations (level 0, torchao's arithmetic), measured as deployed (level 4)
    assert fused.agreement and fused.deployed is not None
    assert fused.runtime_fusions.get("MatMulNBits") == linears


def test_ort_cpu_flavour_of_gpt2(tmp_path):
    model = _model("gpt2")
    result = export_decoder(model, tmp_path / "decoder.onnx", flavour="ort-cpu")  # opset 23: its own Attention
    _check_fusions(result)
    assert result.fusions == {"GroupQueryAttention": 2, "SkipLayerNormalization": 5}
    with warnings.catch_warnings():
        # below opset 23 the fusions are onnxscript's; where its attention rules write a graph
        # ONNX Runtime refuses, the exporter keeps attention in standard operators and says so
        warnings.simplefilter("ignore")
        older = export_decoder(model, tmp_path / "opset18.onnx", flavour="ort-cpu", opset_version=18)
    _check_fusions(older)
    assert older.fusions.get("SkipLayerNormalization") == 5
    ids, mask = _prompts(seed=2)
    expected = _transformers_greedy(model, ids, mask)
    np.testing.assert_array_equal(generate(result, ids, mask, 64, eos_token_id=None), expected)
    np.testing.assert_array_equal(generate(older, ids, mask, 64, eos_token_id=None), expected)


def test_fusion_pass_on_a_hand_built_rms_norm():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3, 8]))
    weight = ir.Value(name="w", const_value=ir.tensor(np.linspace(0.5, 1.5, 8, dtype=np.float32)))
    two = ir.Value(name="two", const_value=ir.tensor(np.float32(2.0)))
    eps = ir.Value(name="eps", const_value=ir.tensor(np.float32(1e-6)))
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([-1], np.int64)))
    nodes = [ir.node("Pow", [x, two])]
    nodes.append(ir.node("ReduceMean", [nodes[-1].outputs[0], axes], {"keepdims": 1, "noop_with_empty_axes": 0}))
    nodes.append(ir.node("Add", [nodes[-1].outputs[0], eps]))
    nodes.append(ir.node("Sqrt", [nodes[-1].outputs[0]]))
    nodes.append(ir.node("Reciprocal", [nodes[-1].outputs[0]]))
    nodes.append(ir.node("Mul", [x, nodes[-1].outputs[0]]))
    nodes.append(ir.node("Mul", [weight, nodes[-1].outputs[0]]))
    out = nodes[-1].outputs[0]
    out.name, out.type, out.shape = "y", ir.TensorType(ir.DataType.FLOAT), ir.Shape([2, 3, 8])
    graph = ir.Graph([x], [out], nodes=nodes, initializers=[weight, two, eps, axes], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    fusion = OrtFusionPass()
    assert fusion(model).modified
    assert fusion.fusions == {"SimplifiedLayerNormalization": 1}
    assert not fusion(model).modified and fusion.fusions == {}  # idempotent, and honest about it


def _train_sequence_model(steps: int = 300) -> torch.nn.Module:
    """A small Llama trained to continue arithmetic sequences (start + k·step mod 32, step 1–3,
    read from the prompt): greedy decoding then has clear margins at every token."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x = _sequences(32, 32, generator)
        loss = model(input_ids=x, labels=x).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


def _sequences(n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, 32, (n, 1), generator=generator)
    step = torch.randint(1, 4, (n, 1), generator=generator)
    return (start + step * torch.arange(length)) % 32


@pytest.fixture(scope="module")
def trained_llama() -> torch.nn.Module:
    return _train_sequence_model()


@pytest.mark.slow
def test_int4_decoder_of_a_trained_model_generates_its_tokens(trained_llama, tmp_path):
    from onnxport.quantize.weight_only import quantize_weight_only

    model = trained_llama
    result = export_decoder(model, tmp_path / "int4.onnx", precision="int4", group_size=32)
    assert result.agreement and result.token_agreement == 1.0
    file = onnx.load_model(str(result), load_external_data=False)
    int4 = [t for t in file.graph.initializer if t.data_type == onnx.TensorProto.INT4]
    assert len(int4) == 2 * 7 + 1  # q/k/v/o, gate/up/down per layer, and the head
    assert result.runtime_fusions.get("MatMulNBits") == len(int4)  # ONNX Runtime runs every one as MatMulNBits

    prompts = _sequences(4, 6, torch.Generator().manual_seed(5))
    truth = _sequences(4, 6 + 24, torch.Generator().manual_seed(5))
    torchao_model = quantize_weight_only(model, "int4_weight_only", group_size=32, symmetric=True, embeddings=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torchao_model.generate(input_ids=prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
    fused = export_decoder(model, tmp_path / "int4-ort-cpu.onnx", precision="int4", group_size=32, flavour="ort-cpu")
    assert fused.agreement and fused.fusions["GroupQueryAttention"] == 2
    assert fused.runtime_fusions.get("MatMulNBits") == len(int4)
    for file in (result, fused):
        got = generate(file, prompts, max_new_tokens=24)
        agreement = float((got[:, 6:] == expected.numpy()[:, 6:]).mean())
        assert agreement == 1.0, f"{file.flavour} int4 file vs the torchao model: {agreement:.1%} of greedy tokens agree"
        assert (got == truth.numpy()).all(), f"the {file.flavour} int4 file no longer continues the sequences"


@pytest.mark.slow
def test_fp16_decoder_of_a_trained_model_generates_what_the_half_model_generates(trained_llama, tmp_path):
    model = trained_llama
    result = export_decoder(model, tmp_path / "fp16.onnx", precision="fp16")
    assert next(model.parameters()).dtype == torch.float32  # the model given is left as it was
    assert result.agreement and result.token_agreement == 1.0
    file = onnx.load_model(str(result), load_external_data=False)
    f16 = onnx.TensorProto.FLOAT16
    assert {v.name: v.type.tensor_type.elem_type for v in file.graph.input if v.name.startswith("past_key_values")} \
        == {name: f16 for name in past_names(2)}
    assert {v.type.tensor_type.elem_type for v in file.graph.output} == {f16}  # logits and the cache
    assert all(t.data_type in (f16, onnx.TensorProto.INT64) for t in file.graph.initializer if len(t.dims) == 2)

    prompts = _sequences(4, 6, torch.Generator().manual_seed(5))
    truth = _sequences(4, 6 + 24, torch.Generator().manual_seed(5))
    half = copy.deepcopy(model).half()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = half.generate(input_ids=prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
    # the fused file's float16 GroupQueryAttention and skip norms too
    fused = export_decoder(model, tmp_path / "fp16-ort-cpu.onnx", precision="fp16", flavour="ort-cpu")
    assert fused.agreement and fused.fusions["GroupQueryAttention"] == 2
    for file in (result, fused):
        got = generate(file, prompts, max_new_tokens=24)
        np.testing.assert_array_equal(got, expected.numpy())
        assert (got == truth.numpy()).all(), f"the {file.flavour} fp16 file no longer continues the sequences"


def test_seeded_sampling_repeats_and_seeds_differ(ort_cpu_llama):
    _, result = ort_cpu_llama
    ids, mask = _prompts()
    first = generate(result, ids, mask, 16, do_sample=True, seed=7, temperature=2.0, eos_token_id=None)
    again = generate(result, ids, mask, 16, do_sample=True, seed=7, temperature=2.0, eos_token_id=None)
    other = generate(result, ids, mask, 16, do_sample=True, seed=8, temperature=2.0, eos_token_id=None)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    top1 = generate(result, ids, mask, 16, do_sample=True, seed=9, top_k=1, eos_token_id=None)
    np.testing.assert_array_equal(top1, generate(result, ids, mask, 16, eos_token_id=None))  # top_k=1 is greedy

    with pytest.raises(InvalidArgumentError, match="positions"):
        generate(result, ids, mask, max_new_tokens=250)
    with pytest.raises(InvalidArgumentError, match="left"):
        generate(result, ids, torch.flip(mask, [1]), 4)


def test_bad_inputs_are_named_and_nothing_is_written(tmp_path):
    out = tmp_path / "out.onnx"
    with pytest.raises(InvalidArgumentError, match="config.json"):
        export_decoder(tmp_path, out)
    with pytest.raises(InvalidArgumentError, match="precision"):
        export_decoder(_model("llama"), out, precision="int3")
    with pytest.raises(InvalidArgumentError, match="language-model head"):
        export_decoder(transformers.LlamaModel(_config("llama")), out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1,
                                                                           num_heads=2, d_kv=16))
    with pytest.raises(InvalidArgumentError, match="encoder-decoder"):
        export_decoder(t5, out)
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                                   state_size=4, expand=2))
    with pytest.raises(ExportRefusedError, match="neither flavour"):
        export_decoder(mamba, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_exports_a_folder_with_its_genai_config_and_generates(tmp_path, capsys):
    model = _model("llama")
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    out = tmp_path / "onnx"
    run = subprocess.run([sys.executable, "-m", "onnxport", "llm", str(folder), "-o", str(out), "--precision", "int4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    assert (out / "model.onnx").is_file()
    config = json.loads((out / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "model.onnx" and decoder["num_hidden_layers"] == 2
    assert decoder["num_key_value_heads"] == 2 and decoder["head_size"] == 16
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert config["search"]["past_present_share_buffer"] is False

    from onnxport.cli import main

    assert main(["generate", str(out / "model.onnx"), "--ids", "5,17,33,2", "--ids", "9,4", "--max-new-tokens", "5"]) == 0
    printed = [[int(t) for t in line.split(",")] for line in capsys.readouterr().out.strip().splitlines()]
    expected = generate(out / "model.onnx", [[5, 17, 33, 2], [0, 0, 9, 4]], [[1, 1, 1, 1], [0, 0, 1, 1]], max_new_tokens=5)
    assert printed == [expected[0].tolist(), expected[1, 2:].tolist()] and len(printed[1]) == 7

    assert main(["llm", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "save_pretrained" in capsys.readouterr().err


@pytest.mark.parametrize("family", families(["qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2"],
                                            by_default=("qwen3", "phi3", "gemma2")))
def test_ort_cpu_decoder_of_every_family_generates_what_transformers_generates(family, tmp_path):
    # (Llama's and GPT-2's 'ort-cpu' files have their own tests above)
    model = _model(family)
    result = export_decoder(model, tmp_path / "decoder.onnx", flavour="ort-cpu")
    _check_fusions(result)
    layers = model.config.num_hidden_layers
    assert result.fusions.get("RotaryEmbedding") == 2 * layers
    # Gemma 2 caps its attention logits, which SDPA cannot: its attention stays in standard operators
    assert result.fusions.get("GroupQueryAttention") == (None if family == "gemma2" else layers)
    assert "Attention" not in result.fusions
    assert result.fusions.get("SkipSimplifiedLayerNormalization", 0) >= 2 * layers
    ids, mask = _prompts(seed=3)
    np.testing.assert_array_equal(generate(result, ids, mask, 64, eos_token_id=None),
                                  _transformers_greedy(model, ids, mask))


def _moe(family: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    small = {**_SMALL, "num_hidden_layers": layers}
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**small, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                             head_dim=16)
    elif family == "deepseek_v3":  # routed and shared experts after a dense layer; MLA's latent cache
        # its checkpoints give every head its own keys and values, as transformers' MLA expects
        config = transformers.DeepseekV3Config(**{**small, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
                                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                               kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                               v_head_dim=16)
    else:
        config = transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(("family", "flavour"), [("qwen3_moe", "ort-cpu"), ("mixtral", "portable")])
def test_int4_mixture_of_experts_stores_its_experts_as_torchao_integers(family, flavour, tmp_path):
    from onnxport.exporters.weight_only import file_weights, quantized_weights
    from onnxport.quantize.weight_only import quantize_weight_only

    # three layers: the second one's experts repeated for the third (each layer's experts route
    # their own number of tokens: the copy's sizes are its own)
    model = _moe(family, layers=3)
    result = export_decoder(model, tmp_path / "moe.onnx", precision="int4", group_size=16, flavour=flavour)
    assert result.agreement and result.repeated
    # every expert weight is int4 in blocks of 16 input features: 'ort-cpu' holds each 3-D weight in
    # ONNX Runtime's QMoE kernel (packed, gate and up rows interleaved, read back as torchao's);
    # portable, each expert's matrix is a weight-only MatMul of its own ([in, out], blocks along
    # axis 0, as a linear's), read in place. The proof already held the integers equal to torchao's.
    experts = {k: v for k, v in file_weights(result.path).items() if ".experts." in k}
    torchao_model = quantize_weight_only(model, "int4_weight_only", group_size=16, symmetric=True, embeddings=False)
    expected = {f"{w.module}.weight": w for w in quantized_weights(torchao_model) if w.kind == "experts"}
    if flavour == "portable":
        expected = {f"{m.module}.weight": m for w in expected.values() for m in w.expert_matrices()}
    count = model.config.num_local_experts if flavour == "portable" else 1
    assert set(experts) == set(expected) and len(experts) == 2 * model.config.num_hidden_layers * count
    for name, entry in experts.items():
        q, _, _, attrs = expected[name].onnx_layout()
        assert entry["dtype"] == ir.DataType.INT4 and entry["block_size"] == 16 == attrs["block_size"]
        assert entry["axis"] == attrs["axis"] == (2 if flavour == "ort-cpu" else 0)
        assert np.array_equal(entry["q"], q)
        assert entry["readers"] == (["QMoE"] if flavour == "ort-cpu" else ["MatMul"])
    if flavour == "portable":  # each expert's matrix is torchao's slice of its 3-D integers
        for w in quantized_weights(torchao_model):
            if w.kind == "experts":
                stacked = np.stack([experts[f"{m.module}.weight"]["q"].T for m in w.expert_matrices()])
                assert np.array_equal(stacked, w.qdata)
    assert next(model.parameters()).dtype == torch.float32 and not hasattr(model.model.layers[0].mlp.experts,
                                                                           "parametrizations")
    # at ONNX Runtime's unoptimised level a portable file computes by its ONNX semantics (dequantize,
    # then a float MatMul: torchao's own arithmetic); an 'ort-cpu' file's MatMulNBits and QMoE state
    # accuracy level 4 (int8 activations, CPU-dependent) at every level, which the 90 % bound covers
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ids, mask = _prompts(seed=5)
    got = generate(result, ids, mask, 16, eos_token_id=None, session_options=options)
    agreement = float((got[:, 7:] == _transformers_greedy(torchao_model, ids, mask, new=16)[:, 7:]).mean())
    assert agreement >= 0.9, f"{agreement:.1%} of the int4 file's greedy tokens are the torchao model's"


# portable routed experts by default through DeepSeek-V3's (shared experts, grouped sigmoid routing) and,
# int4, Mixtral's in the test above; ORT's MoE kernel through Mixtral's
@pytest.mark.parametrize(("family", "flavour"), [pytest.param("qwen3_moe", "portable", marks=pytest.mark.slow),
                                               pytest.param("qwen3_moe", "ort-cpu", marks=pytest.mark.slow),
                                               ("mixtral", "ort-cpu"), ("deepseek_v3", "portable")])
def test_mixture_of_experts_decoders_generate_what_transformers_generates(family, flavour, tmp_path):
    # transformers' default experts run through a custom operator torch.onnx cannot translate; the
    # export captures onnxport's routed experts and proves the file against the model as it is
    from onnxport.errors import OnnxportWarning, WeakerCheckWarning

    model = _moe(family)
    default = model.config._experts_implementation
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", WeakerCheckWarning)  # proven on the float floor, in float64 too
        result = export_decoder(model, tmp_path / "moe", flavour=flavour)
    assert model.config._experts_implementation == default  # the model is given back as it was
    if family == "deepseek_v3":
        # its cache is the compressed keys and values and their rotary part, one "head" each: the
        # file carries what the model caches, which onnxruntime-genai cannot allocate
        graph_inputs = {v.name: v for v in onnx.load_model(str(result), load_external_data=False).graph.input}
        dims = [[d.dim_param or d.dim_value for d in graph_inputs[f"past_key_values.0.{kind}"].type.tensor_type.shape.dim]
                for kind in ("key", "value")]
        assert dims == [["batch", 1, "past_sequence", 16], ["batch", 1, "past_sequence", 8]]
        assert result.genai_config is None and not (tmp_path / "moe" / "genai_config.json").exists()
        assert any(issubclass(w.category, OnnxportWarning) and "genai_config" in str(w.message) for w in caught)
    graph = onnx.load_model(str(result), load_external_data=False).graph
    ops = Counter((n.domain, n.op_type) for n in graph.node)
    if flavour == "portable":  # standard operators; each expert's matrices stored on their own
        assert {domain for domain, _ in ops} <= {"", "ai.onnx"}
        experts = getattr(model.config, "num_experts", None) or model.config.n_routed_experts
        # one expert's tokens found per expert and layer (DeepSeek-V3's first layer is dense)
        assert ops[("", "NonZero")] == experts * (model.config.num_hidden_layers - (family == "deepseek_v3"))
        assert not [i.name for i in graph.initializer if len(i.dims) == 3]
    else:  # every layer's experts in ONNX Runtime's kernel (Qwen3-MoE's router does not renormalise: Mixtral's does)
        assert ops[("com.microsoft", "MoE")] == model.config.num_hidden_layers == result.fusions["MoE"]
        assert {n.op_type for n in graph.node if any(".experts." in i for i in n.input)} == {"MoE"}
    ids, mask = _prompts(seed=5)
    np.testing.assert_array_equal(generate(result, ids, mask, 32, eos_token_id=None),
                                  _transformers_greedy(model, ids, mask, new=32))


def _experts_module(bias: bool, act: str = "silu") -> torch.nn.Module:
    """Mixtral's experts, given a bias on both products when ``bias`` (transformers' experts
    interface takes one; no family of this size has it and a plain gated SiLU)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(3)
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4, hidden_act=act)
    experts = MixtralExperts(config).eval()
    for weight in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(weight, std=0.2)
    if bias:
        experts.has_bias = True
        experts.gate_up_proj_bias = torch.nn.Parameter(torch.randn(4, 96) * 0.1)
        experts.down_proj_bias = torch.nn.Parameter(torch.randn(4, 32) * 0.1)
    return experts


class _Routed(torch.nn.Module):
    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def _layout_experts(layout: str) -> torch.nn.Module:
    """transformers' experts of three layouts: Mixtral's (gate and up rows concatenated, [experts,
    out, in]); gpt-oss's (transposed [experts, in, out], biased, its own clamped gate on interleaved
    rows); NemotronH's (no gate: up, activation, down)."""
    torch.manual_seed(5)
    if layout == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        experts = GptOssExperts(transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=5))
    elif layout == "nemotron_h":
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        experts = NemotronHExperts(transformers.NemotronHConfig(hidden_size=32, moe_intermediate_size=24, n_routed_experts=5))
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        experts = MixtralExperts(transformers.MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=5))
    for _, parameter in experts.named_parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return experts.eval()


@pytest.mark.parametrize(("layout", "dtype"), [("mixtral", torch.float32), ("gpt_oss", torch.float32),
                                               ("nemotron_h", torch.float32), ("gpt_oss", torch.float16)])
def test_routed_experts_read_each_experts_weights_in_place_and_compute_what_batched_experts_compute(layout, dtype):
    # the portable experts run expert by expert on the rows that chose it: no expert's matrices are
    # copied per token (transformers' batched_mm gathers them, which made a 128-token prefill 16x
    # eager's time), an expert no token chose runs on zero rows, and sentinel ids are dropped
    from onnxport._core.capture import torch_program
    from onnxport.llm.experts import exportable_experts, routed_experts_forward
    from onnxport.runtime import make_session

    # (float16: half router weights too, as gpt-oss's; the sums are float32, which ONNX Runtime's
    # CPU ScatterND needs to add at all)
    experts = _layout_experts(layout).to(dtype)
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(7, 32, generator=generator).to(dtype)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(7)])  # expert 4: never chosen
    weights = torch.rand(7, 2, generator=generator).to(dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    experts.config._experts_implementation_internal = "batched_mm"
    with torch.no_grad():
        expected = experts(hidden, index, weights).float().numpy()
        np.testing.assert_allclose(routed_experts_forward(experts, hidden, index, weights).float().numpy(), expected,
                                   **tolerance)
        sentinel = index.clone()
        sentinel[0, 1] = 5  # expert parallelism's "not on this rank", its weight zero
        zeroed = weights.clone()
        zeroed[0, 1] = 0
        np.testing.assert_allclose(routed_experts_forward(experts, hidden, sentinel, zeroed).float().numpy(),
                                   experts(hidden, index.where(sentinel < 5, 0), zeroed).float().numpy(), **tolerance)
    with exportable_experts(_Routed(experts).eval()):
        program = torch_program(_Routed(experts).eval(), (hidden, index, weights), opset_version=18,
                                input_names=["hidden", "index", "weights"], output_names=["out"],
                                axes={"hidden": {0: "tokens"}, "index": {0: "tokens"}, "weights": {0: "tokens"}})
    assert experts.config._experts_implementation_internal == "batched_mm"
    # each product reads one expert's matrix: a constant, or a Gather of one index from the 3-D
    # weight (the optimizer folds small ones); nothing indexes a weight by the data
    graph = program.model.graph
    products = [n for n in graph if n.op_type in ("Gemm", "MatMul")]
    assert len(products) == 2 * 5
    for node in products:
        weight = node.inputs[1]
        source = weight.producer()
        if source is not None:
            assert source.op_type == "Gather" and source.inputs[0].const_value is not None
            assert source.inputs[1].const_value is not None and source.inputs[1].const_value.numpy().ndim == 0
        else:
            assert weight.const_value is not None and len(weight.shape) == 2
    assert not [n for n in graph if n.op_type == "GatherND" and n.inputs[0].const_value is not None]
    proto = ir.serde.serialize_model(program.model)
    session = make_session(proto.SerializeToString())
    for rows in (7, 1):
        got = session.run(None, {"hidden": hidden[:rows].numpy(), "index": index[:rows].numpy(),
                                 "weights": weights[:rows].numpy()})[0]
        np.testing.assert_allclose(got.astype(np.float32), expected[:rows], **tolerance)


@pytest.mark.parametrize(("bias", "act", "kernel"), [(False, "silu", True), (True, "silu", True), (False, "gelu", False)])
def test_experts_in_onnx_runtimes_moe_kernel_compute_what_batched_experts_compute(bias, act, kernel):
    # the kernel takes router logits: the file feeds it the router's own weights (here not summing
    # to one, as OLMoE's and Qwen3-MoE's) and must give back exactly their weighted sum
    from onnxport._core.capture import torch_program
    from onnxport.llm.experts import exportable_experts, translation_table
    from onnxport.passes.moe_kernel import MoEInterleavePass
    from onnxport.runtime import make_session

    experts = _experts_module(bias, act)
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 32, generator=generator)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=generator)
    experts.config._experts_implementation_internal = "batched_mm"
    with torch.no_grad():
        expected = experts(hidden, index, weights).numpy()
    with exportable_experts(_Routed(experts), kernel=True) as taken:
        assert (taken == [experts]) is kernel
        with torch.no_grad():  # the kernel's own eager arithmetic on the interleaved layout
            np.testing.assert_allclose(experts(hidden, index, weights).numpy(), expected, rtol=1e-5, atol=1e-6)
        program = torch_program(_Routed(experts), (hidden, index, weights), opset_version=18,
                                input_names=["hidden", "index", "weights"], output_names=["out"],
                                axes={"hidden": {0: "tokens"}, "index": {0: "tokens"}, "weights": {0: "tokens"}},
                                custom_translation_table=translation_table() if taken else None)
    # the module is given back as it was: its own weights, its own implementation
    assert all(torch.equal(p, before[n]) for n, p in experts.named_parameters())
    assert experts.config._experts_implementation_internal == "batched_mm"
    # the node states the model's layout; the CPU kernel takes gate and up rows interleaved
    assert MoEInterleavePass()(program.model).modified is kernel
    proto = ir.serde.serialize_model(program.model)
    assert sum(n.op_type == "MoE" and n.domain == "com.microsoft" for n in proto.graph.node) == int(kernel)
    session = make_session(proto.SerializeToString())
    for rows in (6, 1):
        got = session.run(None, {"hidden": hidden[:rows].numpy(), "index": index[:rows].numpy(),
                                 "weights": weights[:rows].numpy()})[0]
        np.testing.assert_allclose(got, expected[:rows], rtol=1e-5, atol=1e-6)


def test_a_capture_past_the_routed_experts_limit_gathers_them_and_says_so():
    # the routed form adds nodes per expert, and torch.onnx's optimizer costs about the square of a
    # graph's node count: past the limit a capture gathers the experts per token, with a warning,
    # where an eager run (the float floor's) still routes them
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from onnxport._core.capture import torch_program
    from onnxport.errors import PerformanceWarning
    from onnxport.llm.experts import ROUTED_EXPERTS_LIMIT, exportable_experts

    experts = MixtralExperts(transformers.MixtralConfig(hidden_size=8, intermediate_size=8,
                                                        num_local_experts=ROUTED_EXPERTS_LIMIT + 1)).eval()
    hidden, index, weights = torch.randn(3, 8), torch.tensor([[0, 5], [ROUTED_EXPERTS_LIMIT, 1], [2, 3]]), torch.rand(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with exportable_experts(_Routed(experts), capture=False):
            pass
    with pytest.warns(PerformanceWarning, match="batched_mm"), exportable_experts(_Routed(experts)):
        program = torch_program(_Routed(experts).eval(), (hidden, index, weights), opset_version=18,
                                input_names=["hidden", "index", "weights"], output_names=["out"],
                                axes={"hidden": {0: "tokens"}, "index": {0: "tokens"}, "weights": {0: "tokens"}})
    graph = program.model.graph
    assert not [n for n in graph if n.op_type == "NonZero"]
    # each 3-D weight indexed by the tokens' choices: a copy per token
    assert len([n for n in graph if n.op_type in ("Gather", "GatherND") and n.inputs[0].const_value is not None
                and n.inputs[0].const_value.shape.rank() == 3 and n.inputs[1].const_value is None]) == 2
