"""``Quantizer``: pt2e INT8 with our own annotation (PTQ and QAT), and torchao recipes."""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.fx import GraphModule
from torchao.quantization.pt2e.quantizer import Quantizer as _PT2EQuantizerBase

from .._core.axes import ASKED_AXES_KEY, AXES_KEY, carry_axes
from .._core.cpu import WEIGHT_RANGES
from .._core.inputs import INPUT_NAMES_KEY, positional_forward, recorded_input_names
from .._core.torch_helpers import require_module
from ..errors import DependencyError, ExportRefusedError, InvalidArgumentError, OnnxportWarning, check_choice
from ..targets import TARGETS, get_target
from .annotate import AnnotationContext, annotate_graph
from .batch_norm import retarget_inference_batch_norms
from .calibration import read_calibration
from .config import (
    ACTIVATION_MODES,
    BACKENDS,
    PT2E_METHODS,
    QSCHEMES,
    TORCHAO_METHODS,
    WEIGHT_ONLY_QSCHEMES,
    Activations,
    Backend,
    Observer,
    Placement,
    PT2EConfig,
    TargetName,
    TorchaoConfig,
    WeightRange,
)
from .decompose import split_attention, split_silu
from .fold import fold_channel_scales
from .observers import OBSERVERS, activation_qspec, dynamic_activation_qspec, weight_qspec
from .placement import PLACEMENTS, check_skip_names, skip_activations, skip_conv_add, skip_layers
from .spec import QuantSpec, attach_spec
from .weight_only import WEIGHT_ONLY_BITS, drop_bound_reprs, quantize_weight_only

#: Targets whose consumers compute a dynamic activation scale (``DynamicQuantizeLinear``).
DYNAMIC_TARGETS = (None, "onnxruntime")


class AffineActivationWarning(OnnxportWarning):
    """Activations with non-zero zero-points: TensorRT, among others, refuses them."""


def record_names(model: GraphModule, names: tuple[str, ...] | None) -> GraphModule:
    """Keep the keyword names a model was captured with: it takes those inputs positionally, in
    this order, and onnxport's functions map a dict sample onto them."""
    if names:
        model.meta[INPUT_NAMES_KEY] = tuple(names)
    return model


def _finish_pt2e(model: GraphModule, spec: QuantSpec) -> GraphModule:
    """Record ``spec`` and make the converted model an ordinary, picklable module.

    pt2e binds ``train``/``eval`` on the instance to stop users switching an exported graph's
    batch norm and dropout; after convert there is nothing left to switch, and those bound
    closures are what makes the module unpicklable.
    """
    for name in ("train", "eval"):
        model.__dict__.pop(name, None)
    # Unpickling re-traces the generated code with the recorded tracer class; torch.export's
    # module-stack tracer cannot be rebuilt that way, the plain fx tracer can.
    model._tracer_cls = None
    model._tracer_extras = {}
    model.eval()
    return attach_spec(model, spec)


class OnnxportPT2EQuantizer(_PT2EQuantizerBase):
    """The torchao ``Quantizer`` subclass carrying our annotation and placement edits."""

    def __init__(self, ctx: AnnotationContext, placement: str, skip: list[str], float_layers: list[str]) -> None:
        super().__init__()
        self.ctx = ctx
        self.placement = placement
        self.skip = skip
        self.float_layers = float_layers
        self.conv_add_edges: tuple[int, int] | None = None

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        if not self.ctx.is_qat:  # QAT trains the scale and the weights apart: leave them apart
            model = fold_channel_scales(model)
            model = retarget_inference_batch_norms(model)
        if self.ctx.annotation.int8_sigmoid:
            model = split_silu(model)
        if self.ctx.annotation.int8_attention:
            model = split_attention(model)
        return model

    def annotate(self, model: GraphModule) -> GraphModule:
        annotate_graph(model, self.ctx)
        if self.placement == "skip_conv_add":
            self.conv_add_edges = skip_conv_add(model)
            skipped, adds = self.conv_add_edges
            if skipped == 0:
                raise InvalidArgumentError(
                    f"qdq_placement='skip_conv_add' found no conv→add edge to leave unquantized: the "
                    f"model has {adds} quantized add node(s), none fed by a single-user convolution. "
                    f"It is a residual-network placement; use qdq_placement='per_op' for this model."
                )
        if self.skip:
            skip_activations(model, self.skip)
        if self.float_layers:
            skip_layers(model, self.float_layers)
        return model

    def validate(self, model: GraphModule) -> None:
        pass


def _release_device_caches() -> None:
    """Forget the models torchao's (and torch.ao's) unbounded device memo holds.

    ``_assert_and_get_unique_device`` is an ``lru_cache(maxsize=None)`` keyed by the module, so
    every graph that prepare/convert sees stays alive for the life of the process: about 150 MB
    per ResNet-50 quantization, which a sensitivity search repeats once per layer (the first
    ResNet-50 search ran out of 24 GB). It is only a memo; clearing it is safe.
    """
    import torch.ao.quantization.fx.utils as fx_utils
    import torchao.utils as ao_utils

    for memo in (getattr(ao_utils, "_assert_and_get_unique_device", None),
                 getattr(fx_utils, "assert_and_get_unique_device", None)):
        if hasattr(memo, "cache_clear"):
            memo.cache_clear()


def _model_device_check(model: torch.nn.Module) -> None:
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type != "cpu":
            raise InvalidArgumentError(
                f"Quantizer runs on the CPU, but the model has tensors on {tensor.device}; pass "
                f"model.cpu() (onnxport does not move your model itself)."
            )


def capture_program(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], dynamic_batch: bool,
             dynamic_axes: Any = None, names: tuple[str, ...] | None = None) -> GraphModule:
    """torch.export ``model`` as one graph, with a symbolic batch (``dynamic_batch``) and the
    symbolic ``dynamic_axes`` (by ``names``, the keyword names, or ``input``/``input_<i>``);
    the captured axes are kept in the graph's meta for ``export_qdq``."""
    from .._core.axes import capture_with_axes, fixed_in_capture, resolve_axes, specialized_error, tracing_inputs
    from .._core.capture import default_names
    from .._core.inputs import forward_aliases
    from .._core.torch_helpers import without_kv_cache

    keywords = names
    names = tuple(names or default_names("input", len(inputs)))
    axes = resolve_axes(dynamic_axes, dynamic_batch=dynamic_batch, names=names, inputs=inputs,
                        aliases=forward_aliases(model, names, keywords))
    inputs = tracing_inputs(inputs, names, axes)

    def export(dynamic_shapes: tuple | None) -> Any:
        with warnings.catch_warnings(), without_kv_cache(model):
            warnings.simplefilter("ignore", FutureWarning)
            return torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes, strict=False)

    try:
        exported, guards = capture_with_axes(export, axes, names, inputs, model)
    except InvalidArgumentError:
        raise
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0]
        text = f"{type(error).__name__} {error}".lower()
        if any(k in text for k in ("data-dependent", "datadependent", "control flow", "could not guard", "constraint")):
            extra = " (or pass dynamic_batch=False if the model fixes its batch size)" if dynamic_batch else ""
            advice = f"Remove data-dependent Python control flow from forward{extra}."
        else:  # the model itself failed on these inputs: the advice is about the inputs, not the tracer
            shapes = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in inputs)
            advice = (f"The model failed on the calibration inputs ({shapes}): check that each batch has the dtype "
                      f"and shape forward expects.")
        raise ExportRefusedError(
            f"pt2e quantization needs a model that torch.export can capture as one graph; "
            f"torch.export failed with {type(error).__name__}: {first}. {advice}"
        ) from error
    # check_guards=False: the guard submodule is unpicklable, and our batch is free anyway.
    module = exported.module(check_guards=False)
    fixed = fixed_in_capture(module, names, axes)
    if fixed:
        raise specialized_error(model, axes, fixed, guards)
    module.meta[AXES_KEY] = [axes.get(name, {}) for name in names]
    asked = resolve_axes(dynamic_axes, dynamic_batch=False, names=names, inputs=inputs,
                         aliases=forward_aliases(model, names, keywords)) if dynamic_axes else {}
    module.meta[ASKED_AXES_KEY] = [asked.get(name, {}) for name in names]
    return module


class Quantizer:
    """Quantize a PyTorch model: pt2e INT8 (exportable as ONNX Q/DQ) or a torchao recipe.

    Args:
        backend: ``'pt2e'`` (static PTQ or QAT, our own annotation) or ``'torchao'``.
        method: pt2e: ``'static'`` (default) or ``'qat'``; torchao: ``'int8_weight_only'``,
            ``'int8_dynamic'`` or ``'int4_weight_only'`` (required).
        qscheme: pt2e weights ``'per_channel'`` (output-channel axis; axis 1 for transposed convs,
            the default) or ``'per_tensor'``; torchao weight-only: ``'per_group'`` (``group_size``
            input features per scale; the default for int4) or ``'per_channel'`` (the default for
            int8).
        symmetric: pt2e: activations symmetric int8 with zero-point 0 (what TensorRT needs);
            ``False`` gives affine activations, with a warning. torchao weight-only: the weights'
            mapping — ``True`` zero-points 0, ``False`` one zero-point per block.
        observer: activation observer for calibration: ``'histogram'`` (default; the best
            agreement in ``bench/quantizer.py``), ``'minmax'`` or ``'percentile'`` (99.99th).
        qdq_placement: ``'per_op'`` (every operator's inputs quantized, both inputs of every add)
            or ``'skip_conv_add'`` (the residual branch's conv reaches its add unquantized).
        skip_activations: module names whose output activations stay float.
        float_layers: module names left entirely in float (weights and outputs): what
            :func:`onnxport.quantize_within_budget` chooses, and what :func:`onnxport.sensitivity`
            tries one at a time.
        group_size: input features per scale for ``qscheme='per_group'`` (default 128); it must
            divide every quantized layer's width. ONNX Runtime fuses a group of a power of two
            from 16 up into ``MatMulNBits``.
        quantize_embeddings: torchao weight-only: quantize ``nn.Embedding`` weights too (grouped
            along the embedding width). Needed when an embedding shares its weight with a
            quantized ``lm_head`` (tied embeddings).
        target: a deployment preset for pt2e (see docs/targets.md):
            ``'tensorrt'`` — int8, every zero-point 0, per-channel weights, Q/DQ on both add
            inputs (the default behaviour, recorded as a target); ``'onnxruntime'`` — outputs of
            ReLU/ReLU6 on the unsigned range [0, max] (uint8, zero-point 0, so ONNX Runtime drops
            the ReLU and fuses every conv), other activations int8 symmetric (written as uint8
            zero-point 128); ``'qnn'`` — uint8 affine activations (or uint16 with
            ``activation_bits=16``), int8 per-channel weights.
        activation_bits: 8, or 16 for ``target='qnn'`` (A16W8, exported at opset 21).
        weight_range: pt2e: ``'portable'`` — int8 weights on [-64, 64], which ONNX Runtime's and
            OpenVINO's U8S8 kernels compute exactly on every x86 CPU, VNNI or not (without VNNI
            they add two products in a saturating int16); ``'full'`` — [-127, 127], for
            deployments known to have VNNI/AMX or ARM dot products. ``None`` (default) takes the
            target's: portable for ``'onnxruntime'`` and for dynamic activations, full otherwise.
            Recorded in the QuantSpec.
        activations: pt2e: ``'static'`` (scales from calibration, the default) or ``'dynamic'``:
            each linear layer's input is quantized at run time from its own range (uint8 on
            [0, 255], per tensor, as ONNX ``DynamicQuantizeLinear`` computes it), weights int8 per
            channel; no calibration data (``quantize`` takes one example batch, to capture the
            model), convolutions and every other operator stay float. ``export_qdq`` writes it as
            ``DynamicQuantizeLinear`` + ``MatMulInteger``. For no target or ``'onnxruntime'``.
    """

    def __init__(
        self,
        backend: Backend = "pt2e",
        method: str | None = None,
        *,
        qscheme: str | None = None,
        symmetric: bool = True,
        observer: Observer = "histogram",
        qdq_placement: Placement = "per_op",
        skip_activations: Sequence[str] | None = None,
        float_layers: Sequence[str] | None = None,
        group_size: int = 128,
        quantize_embeddings: bool = False,
        target: TargetName | None = None,
        activation_bits: int = 8,
        weight_range: WeightRange | None = None,
        activations: Activations = "static",
    ) -> None:
        self.backend = check_choice(backend, BACKENDS, "backend")
        self.activations = check_choice(activations, ACTIVATION_MODES, "activations")
        if self.activations == "dynamic":
            if backend != "pt2e" or method not in (None, "static"):
                raise InvalidArgumentError(
                    f"activations='dynamic' is a pt2e scheme without training; drop backend={backend!r}, "
                    f"method={method!r} (or use Quantizer(backend='torchao', method='int8_dynamic'), which has no "
                    f"ONNX form)."
                )
            if target not in DYNAMIC_TARGETS:
                raise InvalidArgumentError(
                    f"activations='dynamic' is written as DynamicQuantizeLinear, which target={target!r} does not "
                    f"run as INT8; use target='onnxruntime' (or none), or static activations for {target!r}."
                )
        self.target = None if target is None else check_choice(target, TARGETS, "target")
        record = get_target(self.target)
        if weight_range is not None:
            check_choice(weight_range, WEIGHT_RANGES, "weight_range")
            if backend != "pt2e":
                raise InvalidArgumentError(f"weight_range={weight_range!r} is a pt2e setting; use backend='pt2e'.")
        # dynamic activations are uint8 on every x86 consumer: the U8S8 kernels need the portable range
        portable_default = record.annotation.portable_weights or self.activations == "dynamic"
        self.weight_range = weight_range or ("portable" if portable_default else "full")
        if target is not None and backend != "pt2e":
            raise InvalidArgumentError(f"target={target!r} is a pt2e preset; use backend='pt2e'.")
        sixteen = [name for name in TARGETS if 16 in get_target(name).annotation.activation_bits]
        if activation_bits not in record.annotation.activation_bits:
            raise InvalidArgumentError(
                f"activation_bits must be 8, or 16 with target={' or '.join(map(repr, sixteen))} (A16W8), "
                f"not {activation_bits!r}."
            )
        self.activation_bits = activation_bits
        if record.rules.needs_symmetric and not symmetric:
            raise InvalidArgumentError(
                f"target={target!r} needs symmetric activations ({record.consumer} rejects non-zero zero-points); "
                f"drop symmetric=False or choose target='qnn'."
            )
        if record.annotation.forces_affine:
            symmetric = False  # e.g. QNN reads affine unsigned activations
        if backend == "pt2e":
            self.method = check_choice(method or "static", PT2E_METHODS, "method")
        else:
            if method is None:
                raise InvalidArgumentError(
                    f"Quantizer(backend='torchao') needs a method: one of {', '.join(map(repr, TORCHAO_METHODS))}."
                )
            self.method = check_choice(method, TORCHAO_METHODS, "method")
        if self.method in WEIGHT_ONLY_BITS:
            default = "per_group" if self.method == "int4_weight_only" else "per_channel"
            self.qscheme = check_choice(qscheme or default, WEIGHT_ONLY_QSCHEMES, "qscheme")
        else:
            self.qscheme = check_choice(qscheme or "per_channel", QSCHEMES, "qscheme")
        if quantize_embeddings and self.method not in WEIGHT_ONLY_BITS:
            raise InvalidArgumentError(
                "quantize_embeddings=True is for the torchao weight-only methods ('int4_weight_only', "
                "'int8_weight_only'); pt2e and int8_dynamic leave embeddings float."
            )
        self.quantize_embeddings = bool(quantize_embeddings)
        self.observer = check_choice(observer, OBSERVERS, "observer")
        self.qdq_placement = check_choice(qdq_placement, PLACEMENTS, "qdq_placement")
        if skip_activations is not None and (
            isinstance(skip_activations, str) or not all(isinstance(s, str) for s in skip_activations)
        ):
            raise InvalidArgumentError(
                f"skip_activations must be a list of module names such as ['layer1.0.relu'], not {skip_activations!r}."
            )
        self.skip_activations = list(skip_activations or [])
        if float_layers is not None and (isinstance(float_layers, str) or not all(isinstance(s, str) for s in float_layers)):
            raise InvalidArgumentError(
                f"float_layers must be a list of module names such as ['layer4.1.conv2'], not {float_layers!r}."
            )
        self.float_layers = list(float_layers or [])
        if self.activations == "dynamic" and self.skip_activations:
            raise InvalidArgumentError(
                "skip_activations leaves static activation pairs out; with activations='dynamic' nothing's output is "
                "quantized. Use float_layers to keep whole layers float."
            )
        if not isinstance(group_size, int) or group_size <= 0:
            raise InvalidArgumentError(f"group_size must be a positive integer, not {group_size!r}.")
        self.group_size = group_size
        self.symmetric = bool(symmetric)
        if not self.symmetric and backend == "pt2e" and not record.annotation.forces_affine:
            warnings.warn(
                "symmetric=False gives activations non-zero zero-points, which some consumers "
                "(TensorRT) refuse; keep the default for TensorRT.",
                AffineActivationWarning,
                stacklevel=2,
            )

    @property
    def config(self) -> PT2EConfig | TorchaoConfig:
        """The choices this quantizer resolved (target defaults applied), as one typed object."""
        if self.backend == "pt2e":
            return PT2EConfig(
                method=self.method, activations=self.activations, qscheme=self.qscheme,
                symmetric=self.symmetric, observer=self.observer, qdq_placement=self.qdq_placement,
                skip_activations=tuple(self.skip_activations), float_layers=tuple(self.float_layers),
                target=self.target, activation_bits=self.activation_bits,
                weight_range=self.weight_range,
            )
        return TorchaoConfig(
            method=self.method, qscheme=self.qscheme, symmetric=self.symmetric,
            group_size=self.group_size if self.qscheme == "per_group" else None,
            quantize_embeddings=self.quantize_embeddings,
        )

    @classmethod
    def from_config(cls, config: PT2EConfig | TorchaoConfig) -> Quantizer:
        """The quantizer a :class:`PT2EConfig` or :class:`TorchaoConfig` describes, validated as
        the keyword form is: ``Quantizer.from_config(q.config)`` quantizes as ``q`` does."""
        if isinstance(config, PT2EConfig):
            return cls("pt2e", config.method, activations=config.activations, qscheme=config.qscheme,
                       symmetric=config.symmetric, observer=config.observer, qdq_placement=config.qdq_placement,
                       skip_activations=list(config.skip_activations), float_layers=list(config.float_layers),
                       target=config.target, activation_bits=config.activation_bits, weight_range=config.weight_range)
        if isinstance(config, TorchaoConfig):
            return cls("torchao", config.method, qscheme=config.qscheme, symmetric=config.symmetric,
                       group_size=config.group_size or 128, quantize_embeddings=config.quantize_embeddings)
        raise InvalidArgumentError(
            f"config must be a PT2EConfig or a TorchaoConfig (onnxport.quantize), not {type(config).__name__}."
        )

    def __repr__(self) -> str:
        return (
            f"Quantizer(backend={self.backend!r}, method={self.method!r}, qscheme={self.qscheme!r}, "
            f"symmetric={self.symmetric}, observer={self.observer!r}, qdq_placement={self.qdq_placement!r}, "
            f"skip_activations={self.skip_activations!r}, float_layers={self.float_layers!r}, target={self.target!r}, "
            f"weight_range={self.weight_range!r}, activations={self.activations!r})"
        )

    # -- the record ----------------------------------------------------------------------
    def spec(self) -> QuantSpec:
        """The :class:`QuantSpec` this quantizer writes on the models it returns."""
        if self.backend == "pt2e" and self.activations == "dynamic":
            return QuantSpec(
                backend="pt2e", method="dynamic", weight_bits=8, activation_bits=None, qscheme=self.qscheme,
                symmetric=False, placement=None, skipped_modules=(), float_layers=tuple(self.float_layers),
                observer=None, dynamic_activations=True, target=self.target, weight_range=self.weight_range,
            )
        if self.backend == "pt2e":
            return QuantSpec(
                backend="pt2e", method=self.method, weight_bits=8, activation_bits=self.activation_bits,
                qscheme=self.qscheme,
                symmetric=self.symmetric and get_target(self.target).annotation.activations == "symmetric",
                placement=self.qdq_placement, skipped_modules=tuple(self.skip_activations),
                float_layers=tuple(self.float_layers),
                observer=self.observer if self.method == "static" else "fake_quant", target=self.target,
                weight_range=self.weight_range,
            )
        if self.method in WEIGHT_ONLY_BITS:
            return QuantSpec(
                backend="torchao", method=self.method, weight_bits=WEIGHT_ONLY_BITS[self.method],
                activation_bits=None, qscheme=self.qscheme, symmetric=self.symmetric,
                group_size=self.group_size if self.qscheme == "per_group" else None,
                quantized_embeddings=self.quantize_embeddings,
            )
        return QuantSpec(
            backend="torchao", method=self.method, weight_bits=8, activation_bits=None,
            qscheme="per_channel", symmetric=True, dynamic_activations=True,
        )

    def _pt2e_quantizer(self, is_qat: bool) -> OnnxportPT2EQuantizer:
        per_channel = self.qscheme == "per_channel"
        portable = self.weight_range == "portable"
        if self.activations == "dynamic":
            ctx = AnnotationContext(
                activation=dynamic_activation_qspec(),
                weight=weight_qspec(per_channel, False, axis=0, portable=portable),
                weight_transposed=weight_qspec(per_channel, False, axis=1, portable=portable),
                is_qat=False, dynamic=True,
            )
            return OnnxportPT2EQuantizer(ctx, "per_op", [], self.float_layers)
        activation = activation_qspec(self.observer, self.symmetric, is_qat)
        post_relu = None
        annotation = get_target(self.target).annotation
        scheme = annotation.activations
        if scheme == "affine_unsigned":
            activation = activation_qspec(self.observer, False, is_qat, unsigned=True, bits=self.activation_bits)
        elif scheme == "symmetric_unsigned_after_relu":
            post_relu = activation_qspec(self.observer, False, is_qat, unsigned=True)
        ctx = AnnotationContext(
            activation=activation,
            weight=weight_qspec(per_channel, is_qat, axis=0, portable=portable),
            weight_transposed=weight_qspec(per_channel, is_qat, axis=1, portable=portable),
            is_qat=is_qat,
            post_relu=post_relu,
            annotation=annotation,
        )
        return OnnxportPT2EQuantizer(ctx, self.qdq_placement, self.skip_activations, self.float_layers)

    # -- PTQ -------------------------------------------------------------------------------
    def quantize(
        self,
        model: torch.nn.Module,
        calibration_dl: Iterable[Any] | None = None,
        max_calibration_samples: int | None = 1024,
        dynamic_batch: bool = True,
        dynamic_axes: Mapping[str, Any] | None = None,
    ) -> torch.nn.Module:
        """Return a quantized copy of ``model``; the model passed in is never modified.

        Args:
            model: a float ``nn.Module`` on the CPU.
            calibration_dl: pt2e static: an iterable of batches (a DataLoader works), each the
                inputs (a tensor or a tuple) or an ``(inputs, target)`` pair.
            max_calibration_samples: stop calibrating after this many samples (never overshoots:
                the last batch is trimmed); ``None`` uses every batch.
            dynamic_batch: pt2e: capture with a symbolic batch dimension, so the quantized model
                runs at any batch size and ``export_qdq(dynamic_batch=True)`` can keep it.
            dynamic_axes: pt2e: more symbolic axes, in ``torch.onnx.export``'s form (``{input_name:
                {axis: 'label'}}`` or ``{input_name: [axes]}``; names are the calibration batches'
                keyword names, or ``input``/``input_<i>``), e.g. a sequence length: the model is
                captured with them, calibrated on batches that may differ along them, and
                ``export_qdq`` writes them. Scales never depend on the length. An axis the model
                fixes is refused, naming it.
        """
        require_module(model)
        _model_device_check(model)
        if self.backend == "torchao":
            return self._torchao(model)
        if self.method == "qat":
            raise InvalidArgumentError(
                "method='qat' trains before it converts: call prepare(model, example_inputs), train "
                "the returned model, then convert(prepared)."
            )
        if max_calibration_samples is not None and (
            not isinstance(max_calibration_samples, int) or max_calibration_samples <= 0
        ):
            raise InvalidArgumentError(
                f"max_calibration_samples must be a positive integer or None, not {max_calibration_samples!r}."
            )
        if self.skip_activations:
            check_skip_names(model, self.skip_activations)
        if self.float_layers:
            check_skip_names(model, self.float_layers, "float_layers")
        batches, names = read_calibration(calibration_dl, model, max_calibration_samples, dynamic_axes=dynamic_axes)
        work = copy.deepcopy(model).eval()
        with positional_forward(work, names):
            captured = capture_program(work, batches[0], dynamic_batch, dynamic_axes, names)
        quantized = self._quantize_captured(captured, batches, dynamic_batch)
        carry_axes(captured, quantized)
        return record_names(quantized, names)

    def _quantize_captured(self, captured: GraphModule, batches: list[tuple[torch.Tensor, ...]],
                           dynamic_batch: bool) -> GraphModule:
        """Annotate, calibrate and convert a captured graph (consumed): the part of ``quantize``
        a search repeats, capturing once."""
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        quantizer = self._pt2e_quantizer(is_qat=False)
        prepared = prepare_pt2e(captured, quantizer)
        # dynamic activations observe nothing ahead: one batch checks that the prepared model runs
        self._calibrate(prepared, batches[:1] if self.activations == "dynamic" else batches, dynamic_batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            converted = convert_pt2e(prepared)
        _release_device_caches()
        return _finish_pt2e(converted, self.spec())

    @staticmethod
    def _calibrate(prepared: GraphModule, batches: list[tuple[torch.Tensor, ...]], dynamic_batch: bool) -> None:
        from tqdm.auto import tqdm

        size = batches[0][0].shape[0] if batches[0][0].dim() else None
        usable = batches if dynamic_batch else [b for b in batches if (b[0].shape[0] if b[0].dim() else None) == size]
        if len(usable) < len(batches):
            warnings.warn(
                f"{len(batches) - len(usable)} calibration batch(es) differ in batch size from the first "
                f"({size}) and were skipped: the model was captured with a fixed batch (dynamic_batch=False).",
                OnnxportWarning,
                stacklevel=3,
            )
        with torch.no_grad():
            for inputs in tqdm(usable, desc="calibrating", unit="batch", leave=False, disable=None):
                prepared(*inputs)

    # -- QAT -------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, example_inputs: Any, dynamic_batch: bool = True,
                dynamic_axes: Mapping[str, Any] | None = None) -> GraphModule:
        """QAT: return a trainable copy of ``model`` with fake-quantization inserted.

        Train it as usual (it is in training mode), then call :meth:`convert`.
        ``dynamic_batch`` and ``dynamic_axes`` are as for :meth:`quantize`.
        """
        if self.backend != "pt2e" or self.method != "qat":
            raise InvalidArgumentError("prepare() is for Quantizer(backend='pt2e', method='qat'); use quantize().")
        from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

        from .._core.inputs import as_input_tuple, keyword_inputs

        require_module(model)
        _model_device_check(model)
        names, inputs = (keyword_inputs(example_inputs, "example_inputs") if isinstance(example_inputs, Mapping)
                         else (None, as_input_tuple(example_inputs, "example_inputs")))
        if self.skip_activations:
            check_skip_names(model, self.skip_activations)
        if self.float_layers:
            check_skip_names(model, self.float_layers, "float_layers")
        work = copy.deepcopy(model).train()
        with positional_forward(work, names):
            captured = capture_program(work, inputs, dynamic_batch, dynamic_axes, names)
        prepared = prepare_qat_pt2e(captured, self._pt2e_quantizer(is_qat=True))
        prepared.meta["onnxport_qat_pending"] = self.spec()
        carry_axes(captured, prepared)
        return record_names(prepared, names)

    def convert(self, prepared: GraphModule) -> GraphModule:
        """QAT: turn a trained model from :meth:`prepare` into the quantized model."""
        from torchao.quantization.pt2e import move_exported_model_to_eval
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

        if not isinstance(prepared, GraphModule) or "onnxport_qat_pending" not in prepared.meta:
            raise InvalidArgumentError("convert() takes the model returned by Quantizer.prepare().")
        spec = prepared.meta.pop("onnxport_qat_pending")
        names = recorded_input_names(prepared)
        records = {key: prepared.meta[key] for key in (AXES_KEY, ASKED_AXES_KEY) if key in prepared.meta}
        move_exported_model_to_eval(prepared)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            converted = convert_pt2e(prepared)
        _release_device_caches()
        converted = _finish_pt2e(converted, spec)
        converted.meta.update(records)
        return record_names(converted, names)

    # -- torchao -----------------------------------------------------------------------------
    def _torchao(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.method in WEIGHT_ONLY_BITS:
            work = quantize_weight_only(
                model, self.method, group_size=self.group_size if self.qscheme == "per_group" else None,
                symmetric=self.symmetric, embeddings=self.quantize_embeddings,
            )
            return attach_spec(work, self.spec())
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        work = copy.deepcopy(model).eval()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_(work, Int8DynamicActivationInt8WeightConfig())
        except Exception as error:
            raise DependencyError(
                f"torchao could not apply '{self.method}' on this CPU: {type(error).__name__}: "
                f"{(str(error).strip().splitlines() or [''])[0]}."
            ) from error
        drop_bound_reprs(work)
        return attach_spec(work, self.spec())
