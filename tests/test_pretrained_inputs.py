"""The front door's example inputs and its answers to model code that does not fit them: token ids laid
out as a tokenizer lays them out, sizes read from a composite config, feature frames of any
length, a length cache set aside, an axis the model's code fixes written fixed (and said so), and a
model that does not run on its example refused before anything is written."""

from __future__ import annotations

import copy
import json
import warnings

import onnx
import pytest
import torch
import transformers

from onnxport import export_pretrained
from onnxport._core.adapters import adapter_for
from onnxport._core.axes import second_size
from onnxport.errors import ExportRefusedError, FixedShapeWarning
from onnxport.pretrained.inputs import build_signature
from onnxport.pretrained.tasks import get_task

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
IMAGE = {**SMALL, "image_size": 32, "patch_size": 8}


def _built(config_class: str, model_class: str, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**options)
    return getattr(transformers, model_class)(config).eval()


def _both_sizes(signature) -> list[dict[str, torch.Tensor]]:
    feeds = {n: t.numpy() for n, t in signature.as_dict().items()}
    return [signature.as_dict(), {n: torch.from_numpy(v) for n, v in second_size(feeds, signature.axes).items()}]


def test_token_ids_carry_the_special_tokens_where_a_tokenizer_puts_them():
    # BART's classifier pools at the last end-of-sequence token and raises on a row without one
    bart = _built("BartConfig", "BartForSequenceClassification", d_model=32, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  vocab_size=100, max_position_embeddings=64, num_labels=3)
    signature = build_signature(bart, get_task("text-classification"))
    config = bart.config
    for sample in _both_sizes(signature):
        ids, mask = sample["input_ids"], sample["attention_mask"]
        assert (ids[:, 0] == config.bos_token_id).all() and (ids[mask == 0] == config.pad_token_id).all()
        last = mask.sum(-1) - 1
        assert (ids[torch.arange(len(ids)), last] == config.eos_token_id).all()
        words = ids[:, 1:][(mask[:, 1:] == 1) & (torch.arange(1, ids.shape[1]) < last[:, None])]
        assert not set(words.tolist()) & {config.bos_token_id, config.eos_token_id, config.pad_token_id}
        with torch.no_grad():
            assert bart(**sample).logits.shape == (len(ids), 3)
    # a decoder's classifier pools at its last token that is not padding: the padded row gives what
    # the same row gives unpadded
    llama = _built("LlamaConfig", "LlamaForSequenceClassification", **SMALL, num_key_value_heads=2, vocab_size=100,
                   max_position_embeddings=64, pad_token_id=0, num_labels=3)
    sample = build_signature(llama, get_task("text-classification")).as_dict()
    length = int(sample["attention_mask"][0].sum())
    with torch.no_grad():
        padded = llama(**sample).logits[0]
        alone = llama(input_ids=sample["input_ids"][:1, :length]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-5)


def test_a_composite_models_images_have_its_vision_configs_size():
    model = _built("SiglipConfig", "SiglipForImageClassification", vision_config=IMAGE, num_labels=3,
                   text_config={**SMALL, "vocab_size": 100})
    signature = build_signature(model, get_task("image-classification"))
    assert list(signature.sample[0].shape) == [1, 3, 32, 32]
    with torch.no_grad():
        assert model(**signature.as_dict()).logits.shape == (1, 3)


def test_feature_frames_of_any_length_are_made_from_the_features_width(tmp_path):
    model = _built("Wav2Vec2BertConfig", "Wav2Vec2BertForCTC", **SMALL, feature_projection_input_dim=40,
                   vocab_size=20, conv_depthwise_kernel_size=3, add_adapter=False, position_embeddings_type="rotary")
    signature = build_signature(model, get_task("automatic-speech-recognition"))
    assert signature.names == ["input_features"] and signature.axes == {"input_features": {0: "batch", 1: "frames"}}
    for sample in _both_sizes(signature):
        with torch.no_grad():
            assert model(**sample).logits.shape[:2] == sample["input_features"].shape[:2]
    # given in memory, it is captured in its family's context too (its rotary table's cached
    # length set aside): the frames stay symbolic, and the model is left as it was, its training
    # mode too (exported and proven in eval mode: the file's proofs pass only without dropout)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FixedShapeWarning)
        result = export_pretrained(model, tmp_path / "onnx", task="automatic-speech-recognition")
    assert result.axes == {"input_features": {0: "batch", 1: "frames"}}
    assert not [name for name, module in model.named_modules() if "forward" in vars(module)]
    assert all(module.training for module in model.modules())


class _Rotary(torch.nn.Module):
    """A position table kept with the length it was made for, as Wav2Vec2-Conformer's rotary one is."""

    def __init__(self) -> None:
        super().__init__()
        self.cached_sequence_length = None
        self.cached_rotary_positional_embedding = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length == self.cached_sequence_length and self.cached_rotary_positional_embedding is not None:
            return self.cached_rotary_positional_embedding
        self.cached_sequence_length = length
        self.cached_rotary_positional_embedding = torch.arange(length, dtype=x.dtype).cos()
        return self.cached_rotary_positional_embedding


class _WithRotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = _Rotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.rotary(x)[None, :, None]


def _capture_with_symbolic_length(model: torch.nn.Module) -> torch.export.ExportedProgram:
    x = torch.randn(1, 12, 4)
    model(x)  # the front door runs the model once before it captures it
    length = torch.export.Dim("length", min=2, max=100)
    return torch.export.export(model, (x,), dynamic_shapes=({1: length},), strict=False)


def test_a_length_cache_is_set_aside_so_the_length_stays_symbolic():
    with pytest.raises(Exception, match="length"):  # the cached length fixes the axis
        _capture_with_symbolic_length(_WithRotary())
    model = _WithRotary()
    with adapter_for("wav2vec2-conformer").capturing(model):
        program = _capture_with_symbolic_length(model)
        assert model.rotary.cached_rotary_positional_embedding is None  # no traced table left behind
        x = torch.randn(1, 30, 4)
        torch.testing.assert_close(program.module()(x), x + torch.arange(30.0).cos()[None, :, None])
        # a deep copy (pt2e's capture makes one) sets aside its own table, never the original's
        model.rotary.cached_sequence_length = "the original's"
        copied = copy.deepcopy(model)
        copied.rotary.cached_sequence_length = None
        _capture_with_symbolic_length(copied)
        assert model.rotary.cached_sequence_length == "the original's"
    assert "forward" not in vars(model.rotary)  # the model as it was once the capture is done


def _vit(**changes) -> torch.nn.Module:
    return _built("ViTConfig", "ViTForImageClassification", **IMAGE, num_labels=3, **changes)


class _LenHead(transformers.ViTForImageClassification):
    def forward(self, pixel_values=None, **kwargs):
        out = super().forward(pixel_values=pixel_values, **kwargs)
        out["logits"] = out.logits.reshape(len(pixel_values), -1)  # len() is a Python int: the batch fixed
        return out


def test_an_axis_the_models_code_fixes_is_written_fixed_and_said_so(tmp_path):
    torch.manual_seed(0)
    vit = _LenHead(transformers.ViTConfig(**IMAGE, num_labels=3, architectures=["ViTForImageClassification"])).eval()
    with pytest.warns(FixedShapeWarning, match=r"'pixel_values' axis 0 \('batch'\) = 1 fixed") as caught:
        result = export_pretrained(vit, tmp_path / "out")
    # it names the model's line, without export_onnx's advice (the front door takes no dynamic_axes)
    message = str(next(w.message for w in caught if w.category is FixedShapeWarning))
    assert "test_pretrained_inputs.py" in message and "dynamic_axes" not in message
    graph = onnx.load(str(result.path)).graph
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim] == [1, 3, 32, 32]
    assert result.axes == {"pixel_values": {}} and [p["size"] for p in result.proofs] == ["sample"]
    assert result.proofs[0]["passed"]
    record = json.loads((tmp_path / "out" / "onnxport.json").read_text())
    assert record["inputs"] == [{"name": "pixel_values", "axes": {}}]


def test_a_model_that_does_not_run_on_its_example_is_refused_with_nothing_written(tmp_path):
    vit = _vit()

    def forward(pixel_values=None, **kwargs):
        raise RuntimeError("this family needs 512 positions")

    vit.forward = forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ExportRefusedError, match=r"does not run on the example inputs built from its config "
                                                     r"\(pixel_values \[1, 3, 32, 32\]\): RuntimeError: this family"):
            export_pretrained(vit, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_vision_tower_saved_alone_is_an_image_feature_extractor(tmp_path):
    from onnxport.pretrained.source import load_folder, load_module

    tower = _built("CLIPVisionConfig", "CLIPVisionModel", **IMAGE)
    assert load_module(tower, "auto").task.name == "image-feature-extraction"
    tower.save_pretrained(tmp_path / "tower")
    assert load_folder(tmp_path / "tower", "auto", trust_remote_code=False).task.name == "image-feature-extraction"


def test_inputs_follow_what_the_model_reads_not_only_its_task():
    # ImageGPT classifies images given as colour-cluster ids; GroupViT's features take text and images
    image_gpt = _built("ImageGPTConfig", "ImageGPTForImageClassification", n_embd=32, n_layer=1, n_head=2,
                       n_positions=64, vocab_size=17, num_labels=3)
    signature = build_signature(image_gpt, get_task("image-classification"))
    assert signature.names == ["input_ids", "attention_mask"] and int(signature.sample[0].max()) < 17
    group_vit = _built("GroupViTConfig", "GroupViTModel", projection_dim=32, projection_intermediate_dim=64,
                       text_config={**SMALL, "vocab_size": 100},
                       vision_config={**IMAGE, "depths": [1, 1, 1], "num_group_tokens": [8, 4, 0],
                                      "num_output_groups": [8, 4, 4]})
    signature = build_signature(group_vit, get_task("feature-extraction"))
    assert signature.names == ["input_ids", "attention_mask", "pixel_values"]
    for model, sample in ((image_gpt, build_signature(image_gpt, get_task("image-classification")).as_dict()),
                          (group_vit, signature.as_dict())):
        with torch.no_grad():
            model(**sample)


def test_a_document_model_takes_word_boxes():
    layoutlm = _built("LayoutLMConfig", "LayoutLMForSequenceClassification", **SMALL, vocab_size=100,
                      max_position_embeddings=64, max_2d_position_embeddings=1024, num_labels=3)
    signature = build_signature(layoutlm, get_task("text-classification"))
    assert signature.names[-1] == "bbox" and signature.axes["bbox"] == {0: "batch", 1: "sequence"}
    for sample in _both_sizes(signature):
        boxes = sample["bbox"]
        assert boxes.shape == (*sample["input_ids"].shape, 4) and 0 <= int(boxes.min()) and int(boxes.max()) <= 1000
        assert (boxes[..., 2] >= boxes[..., 0]).all() and (boxes[..., 3] >= boxes[..., 1]).all()
        with torch.no_grad():
            layoutlm(**sample)


def test_a_markup_model_takes_each_tokens_xpath():
    markup = _built("MarkupLMConfig", "MarkupLMForTokenClassification", **SMALL, vocab_size=100,
                    max_position_embeddings=64, max_depth=6, xpath_unit_hidden_size=8, num_labels=3)
    signature = build_signature(markup, get_task("token-classification"))
    assert signature.names[-2:] == ["xpath_tags_seq", "xpath_subs_seq"]
    for sample in _both_sizes(signature):
        for name, limit in (("xpath_tags_seq", 256), ("xpath_subs_seq", 1024)):
            assert sample[name].shape == (*sample["input_ids"].shape, 6) and int(sample[name].max()) < limit
        with torch.no_grad():
            given = markup(**sample).logits
            # the model falls back to padding XPaths without them: the inputs are read
            assert not torch.allclose(given, markup(input_ids=sample["input_ids"],
                                                    attention_mask=sample["attention_mask"]).logits)
