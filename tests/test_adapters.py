"""Family adapters: the float16 guard of BART-like encoder layers, taken as data flow, gives
exactly what the layer's own branch gives, and a layer that does not fit it is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from onnxport._core.adapters import adapter_for
from onnxport.errors import ExportRefusedError

from .seq2seq_models import FAMILIES


def _layer_and_input(weight: float, bias: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """BART's first encoder layer in float16, as transformers runs it and adapted, its last norm's
    first channel set to ``weight`` and ``bias``."""
    model = FAMILIES["bart"]().half()
    with torch.no_grad():
        norm = model.get_encoder().layers[0].final_layer_norm
        norm.weight[0], norm.bias[0] = weight, bias
    adapted = copy.deepcopy(model)
    adapter_for(model.config.model_type).prepare_half(adapted)
    torch.manual_seed(1)
    x = torch.randn(2, 5, model.config.d_model).half()
    return model.get_encoder().layers[0], adapted.get_encoder().layers[0], x


BOUND = torch.finfo(torch.float16).max - 1000


# all finite; finite values above the clamp's bound, which the branch leaves as they are; an overflow, clamped
@pytest.mark.parametrize(("weight", "bias", "clamped"), [(1.0, 0.0, False), (0.0, 65000.0, False), (1e6, 0.0, True)])
def test_the_float16_guard_as_data_flow_gives_what_the_branch_gives(weight, bias, clamped):
    original, adapted, x = _layer_and_input(weight, bias)
    with torch.no_grad():
        want, got = original(x, None), adapted(x, None)
    assert torch.equal(got, want)
    assert bool((want.abs() == BOUND).any()) == clamped
    assert bool((want.abs() > BOUND).any()) == (bias > BOUND)


def test_a_layer_that_asks_otherwise_is_refused():
    _, adapted, x = _layer_and_input(1.0)
    inner = adapted.final_layer_norm.forward

    def asks_twice(h: torch.Tensor) -> torch.Tensor:
        torch.isfinite(h).all()
        return inner(h)

    adapted.final_layer_norm.forward = asks_twice
    with pytest.raises(ExportRefusedError, match="2 times"), torch.no_grad():
        adapted(x, None)
    # in float32 the layer asks nothing and the adapter changes nothing
    model = FAMILIES["bart"]()
    adapter_for("bart").prepare_half(model)
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.isfinite().all()


def test_a_waveform_encoders_output_length_is_integer_arithmetic_while_capturing():
    """Moonshine's encoder computes its output length with float division and int(), which
    torch.export fixes at the traced length; while capturing it is the convolutions' own integer
    arithmetic: the same lengths, and the model as it was afterwards."""
    from .seq2seq_models import SPEECH

    model = SPEECH["moonshine"]()
    encoder = model.get_encoder()
    lengths = list(range(895, 8000, 37))  # from the shortest all three convolutions take
    own = [encoder._get_feat_extract_output_lengths(n) for n in lengths]
    with torch.no_grad():  # what the convolutions give is the truth both must tell
        given = [encoder(torch.zeros(1, n)).last_hidden_state.shape[1] for n in lengths[:12]]
    assert own[:12] == given
    with adapter_for("moonshine").capturing(model):
        assert [encoder._get_feat_extract_output_lengths(n) for n in lengths] == own
        assert encoder._get_feat_extract_output_lengths(torch.tensor(lengths)).tolist() == own
    assert "_get_feat_extract_output_lengths" not in vars(encoder)
