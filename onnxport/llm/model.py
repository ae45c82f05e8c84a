"""The causal LM a decoder file is exported from: loading it, its cache's shape, and the forward
the exporter captures (flat past key/values in, logits and flat present key/values out)."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DependencyError, ExportRefusedError, InvalidArgumentError
from .names import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS, past_names, present_names


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder file's cache and vocabulary look like, read from the model's config."""

    model_type: str
    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    vocab: int
    max_positions: int | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    #: the cache's (and the logits') element type: the file computes in the model's precision
    cache_dtype: str = "float32"
    #: the values' heads and width where they differ from the keys' (a latent cache, DeepSeek's
    #: MLA: one "head" of the compressed keys and values, and the rotary part beside it)
    value_heads: int | None = None
    value_dim: int | None = None

    def cache_shapes(self, batch: int, length: int) -> list[tuple[int, int, int, int]]:
        """Each past (and present) tensor's shape, in the file's order (per layer its key, then its value)."""
        key = (batch, self.kv_heads, length, self.head_dim)
        value = (batch, self.value_heads or self.kv_heads, length, self.value_dim or self.head_dim)
        return [key, value] * self.layers

    @property
    def plain_cache(self) -> bool:
        """Keys and values of the same heads and width: the cache onnxruntime-genai allocates."""
        return (self.value_heads or self.kv_heads) == self.kv_heads and (self.value_dim or self.head_dim) == self.head_dim

    @property
    def input_names(self) -> list[str]:
        return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_names(self.layers)]

    @property
    def output_names(self) -> list[str]:
        return [LOGITS, *present_names(self.layers)]


def _measured_cache(model: torch.nn.Module, layers: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The heads and width of the keys and of the values the model itself caches, from one
    two-token step with an empty cache: a config names the attention's heads, and a latent cache
    (DeepSeek's MLA keeps its compressed keys and values and their rotary part, one "head" each)
    is not those. ``None`` where the step fails or the layers differ (``check_cache`` then names it)."""
    from transformers import DynamicCache

    parameter = next(iter(model.parameters()), None)
    if parameter is None or parameter.device.type == "meta":
        return None
    ids = torch.zeros(1, 2, dtype=torch.long)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                        **{_cache_keyword(model): DynamicCache()})
        flat = _cache_tensors(returned_cache(out))
    except Exception:  # noqa: BLE001 — the config's shape stands, and check_cache refuses by name
        return None
    keys, values = {tuple(t.shape) for t in flat[0::2]}, {tuple(t.shape) for t in flat[1::2]}
    if len(flat) != 2 * layers or len(keys) != 1 or len(values) != 1:
        return None
    (key,), (value,) = keys, values
    return (key[1], key[3]), (value[1], value[3])


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def decoder_shape(model: torch.nn.Module) -> DecoderShape:
    """The cache shape the exporter promises, from ``model.config`` (checked against a real
    forward by :func:`check_cache`)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # type: ignore[operator]  # a call_function node's target
    heads, hidden = _first(text, "num_attention_heads", "n_head"), _first(text, "hidden_size", "n_embd")
    layers = _first(text, "num_hidden_layers", "n_layer")
    if heads is None or hidden is None or layers is None:
        raise ExportRefusedError(
            f"{type(model).__name__} ({getattr(config, 'model_type', '?')}) has no attention heads in its config, so "
            f"its cache is not per-layer keys and values; neither flavour can express it, and nothing was written."
        )
    heads, hidden = int(heads), int(hidden)
    generation = getattr(model, "generation_config", None)
    kv_heads, head_dim = int(_first(text, "num_key_value_heads") or heads), int(_first(text, "head_dim") or hidden // heads)
    measured = _measured_cache(model, int(layers))
    value_heads = value_dim = None
    if measured is not None:
        (kv_heads, head_dim), (value_heads, value_dim) = measured
    return DecoderShape(
        model_type=str(getattr(config, "model_type", type(model).__name__)),
        layers=int(layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        value_heads=value_heads if value_heads != kv_heads else None,
        value_dim=value_dim if value_dim != head_dim else None,
        heads=heads,
        hidden=hidden,
        vocab=int(text.vocab_size),
        max_positions=_first(text, "max_position_embeddings", "n_positions"),
        bos_token_id=_first(generation, "bos_token_id") if generation is not None else text.bos_token_id,
        eos_token_id=_first(generation, "eos_token_id") if generation is not None else text.eos_token_id,
        pad_token_id=_first(generation, "pad_token_id") if generation is not None else getattr(text, "pad_token_id", None),
    )


def load_causal_lm(model_or_folder: Any, argument: str = "model_or_folder") -> torch.nn.Module:
    """A transformers causal LM as given, or loaded in float32 from a local ``save_pretrained``
    folder (nothing is downloaded). Anything else is refused, naming what it is."""
    if isinstance(model_or_folder, (str, os.PathLike)):
        return load_folder(Path(model_or_folder), argument, _check_causal_config, "causal LM")
    if not isinstance(model_or_folder, torch.nn.Module):
        raise InvalidArgumentError(
            f"{argument} must be a transformers causal LM or the path of a save_pretrained folder, "
            f"not {type(model_or_folder).__name__}."
        )
    config = getattr(model_or_folder, "config", None)
    if config is None or not hasattr(model_or_folder, "get_output_embeddings"):
        raise InvalidArgumentError(
            f"{argument} is a {type(model_or_folder).__name__}, not a transformers model: export_decoder "
            f"exports transformers causal LMs (AutoModelForCausalLM); use export_onnx for other modules."
        )
    _check_causal_config(config, f"{type(model_or_folder).__name__}")
    if model_or_folder.get_output_embeddings() is None:  # type: ignore[operator]  # transformers' configs are untyped here
        raise InvalidArgumentError(
            f"{type(model_or_folder).__name__} has no language-model head (get_output_embeddings() is None), "
            f"so it gives no logits to generate from; load it with AutoModelForCausalLM."
        )
    return model_or_folder


def load_folder(folder: Path, argument: str, auto_class_of: Callable[[Any, str], Any], kind: str) -> torch.nn.Module:
    """The model ``save_pretrained`` wrote in ``folder``, in float32 (nothing is downloaded), by the
    Auto class ``auto_class_of(config, what)`` picks for its config (or refuses, naming why)."""
    if not folder.is_dir():
        raise InvalidArgumentError(
            f"{argument} '{folder}' is not a folder: give a transformers model, or the folder "
            f"save_pretrained wrote (with config.json and the weights)."
        )
    if not (folder / "config.json").is_file():
        raise InvalidArgumentError(
            f"{argument} '{folder}' has no config.json, so it is not a folder save_pretrained wrote; "
            f"give the folder that holds config.json and the weights."
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # transformers raises ValueError, OSError, KeyError alike
        raise InvalidArgumentError(f"transformers cannot read {folder / 'config.json'}: {error}") from error
    auto = auto_class_of(config, f"The model in '{folder}'")
    try:
        model = auto.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except Exception as error:
        raise DependencyError(
            f"transformers could not load the {kind} in '{folder}': {type(error).__name__}: "
            f"{(str(error).strip().splitlines() or [''])[0]}"
        ) from error
    return model.eval()


def _check_causal_config(config: Any, what: str) -> Any:
    """The Auto class of a causal LM's config, or a refusal naming what it is."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    if getattr(config, "is_encoder_decoder", False):
        raise InvalidArgumentError(
            f"{what} is an encoder-decoder ({config.model_type}); export_decoder exports decoder-only "
            f"causal LMs, whose one file takes its own past keys and values."
        )
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise InvalidArgumentError(
            f"{what} ({getattr(config, 'model_type', type(config).__name__)}) has no causal-LM head in "
            f"transformers (AutoModelForCausalLM does not know its config), so it cannot generate."
        )
    return AutoModelForCausalLM


def _cache_keyword(forward: Any) -> str:
    """The name ``forward`` takes its cache by: transformers renames ``past_key_values`` to ``cache``
    family by family (the old name warns, and goes in 5.40)."""
    target = forward.forward if isinstance(forward, torch.nn.Module) else forward
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The cache a transformers output returns (``cache`` where the family renamed ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ExportRefusedError(f"the model returned a {type(cache).__name__} cache, which has no per-layer keys and values")
    flat = []
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ExportRefusedError(f"its cache layer {type(layer).__name__} keeps no key and value tensors")
        flat += [keys, values]
    return flat


def cached_call(model: torch.nn.Module, layers: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """One step of ``model`` with its past as flat tensors: ``(logits, *present)``.

    The cache is a plain growing ``DynamicCache`` for every layer, sliding-window ones included
    (the mask keeps their window): a window-sized cache would make the file's present shape
    depend on the length, which one graph cannot express.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(layers):
        cache.update(past[2 * i], past[2 * i + 1], i)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, **{_cache_keyword(model): cache})
    return (out.logits, *_cache_tensors(returned_cache(out)))


@contextlib.contextmanager
def cached_forward(model: torch.nn.Module, shape: DecoderShape) -> Iterator[torch.nn.Module]:
    """``model`` whose forward takes the file's inputs positionally and returns its outputs as a
    flat tuple, for as long as the block runs; the model keeps its module paths (the file's
    weight names) and is left as it was."""
    from .._core.inputs import forward_replaced

    layers = shape.layers

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cached_call(type(model).forward.__get__(model), layers, input_ids, attention_mask, position_ids, past)

    # parameter names must be identifiers; the file's input names are given to the exporter
    with forward_replaced(model, forward, [n.replace(".", "_") for n in shape.input_names]):
        yield model


def check_cache(model: torch.nn.Module, shape: DecoderShape, sample: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Run the model once on ``sample`` and refuse an attention whose cache the file cannot carry
    as ``[batch, heads, past + sequence, width]`` keys and values per layer (``shape.cache_shapes``)."""
    batch, length = sample[0].shape
    past = sample[3].shape[2]
    try:
        with torch.no_grad():
            outputs = cached_call(model, shape.layers, *sample[:3], tuple(sample[3:]))  # type: ignore[call-arg]  # the sample is (ids, mask, positions, *past)
    except ExportRefusedError as error:
        raise ExportRefusedError(
            f"{type(model).__name__}'s attention cannot be exported with a key/value cache: {error}; "
            f"neither flavour can express it."
        ) from error
    except Exception as error:
        raise ExportRefusedError(
            f"{type(model).__name__} does not run with a past of plain key/value tensors "
            f"({type(error).__name__}: {str(error).strip()[:200]}), so neither flavour can express its "
            f"attention; nothing was written."
        ) from error
    expected = shape.cache_shapes(batch, past + length)
    present = outputs[1:]
    if len(present) != 2 * shape.layers or any(tuple(t.shape) != e for t, e in zip(present, expected)):
        got = sorted({tuple(t.shape) for t in present})
        raise ExportRefusedError(
            f"{type(model).__name__}'s cache is not {shape.layers} layers of keys and values shaped "
            f"[batch, heads, past + sequence, width] = {sorted(set(expected))} (it gave {len(present)} tensors "
            f"shaped {got}); neither flavour can express that attention, and nothing was written."
        )
    return list(outputs)
