"""Where a model comes from: a ``save_pretrained`` folder, ``timm:NAME``, or a module in memory —
each becomes the model, its task and its config, with nothing downloaded and nothing from the
folder run unless ``trust_remote_code=True``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._core.adapters import adapter_for
from ..errors import DependencyError, InvalidArgumentError
from .tasks import Task, get_task, infer_task, model_class

#: Files a folder may hold that a deployment needs beside the model (tokenizers, processors,
#: generation settings); copied into the output folder when present.
COMPANION_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "preprocessor_config.json", "processor_config.json", "image_processor_config.json",
    "feature_extractor_config.json", "chat_template.jinja",
)
TIMM_PREFIX = "timm:"


@dataclass
class Loaded:
    """A model ready to export: the module (eval mode, float32), its task, where it came from.

    A source without a transformers config (timm) states the rest itself: ``image_size`` (channels,
    height, width of its ``pixel_values``), ``preprocess`` (PIL images to the pixels it was trained
    on, for calibration images) and ``preprocessing`` (the same, as a record for the deployment).
    """

    model: torch.nn.Module
    task: Task
    folder: Path | None = None
    description: str = ""
    preprocessor: dict[str, Any] = field(default_factory=dict)
    image_size: tuple[int, int, int] | None = None
    preprocess: Callable[[list[Any]], torch.Tensor] | None = None
    preprocessing: dict[str, Any] | None = None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidArgumentError(f"{what} '{path}' cannot be read as JSON: {error}; fix or replace the file.") from error
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{what} '{path}' holds a {type(data).__name__}, not a JSON object.")
    return data


def _preprocessor(folder: Path) -> dict[str, Any]:
    for name in ("preprocessor_config.json", "feature_extractor_config.json"):
        if (folder / name).is_file():
            return _read_json(folder / name, "The preprocessor config")
    return {}


def load_folder(folder: Path, task_name: str, *, trust_remote_code: bool) -> Loaded:
    """A ``save_pretrained`` folder's model for ``task_name`` (``'auto'``: from its config)."""
    if not folder.is_dir():
        raise InvalidArgumentError(
            f"source '{folder}' is not a folder: give the folder save_pretrained wrote (config.json and the "
            f"weights), 'timm:NAME', or package.module:callable for your own model."
        )
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise InvalidArgumentError(
            f"source '{folder}' has no config.json, so it is not a folder save_pretrained wrote; give the folder "
            f"that holds config.json and the weights."
        )
    raw = _read_json(config_file, "The config")
    if raw.get("auto_map") and not trust_remote_code:
        raise InvalidArgumentError(
            f"'{config_file}' names custom code (auto_map: {sorted(raw['auto_map'])}), which would run from the "
            f"folder; nothing was run. Pass trust_remote_code=True (--trust-remote-code) if you trust its code."
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises ValueError, KeyError, OSError alike
        raise InvalidArgumentError(
            f"transformers cannot read '{config_file}' ({type(error).__name__}: {_first_line(error)}); an unknown "
            f"model_type needs a newer transformers, or trust_remote_code=True for custom code."
        ) from error
    vision = _takes_pixels(config)
    task = infer_task(getattr(config, "architectures", None), vision=vision, where=f"'{config_file}'") \
        if task_name == "auto" else get_task(task_name)
    adapter = adapter_for(getattr(config, "model_type", ""))
    import transformers

    auto = getattr(transformers, model_class(task, getattr(config, "architectures", None),
                                             getattr(config, "model_type", "")))
    try:
        try:
            model, info = auto.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                               trust_remote_code=trust_remote_code, output_loading_info=True,
                                               **adapter.load_kwargs)
        except ValueError as error:
            if "attn_implementation" not in adapter.load_kwargs or "attn" not in str(error).lower():
                raise
            # a family without that attention implementation: its own default
            model, info = auto.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                               trust_remote_code=trust_remote_code, output_loading_info=True)
    except ValueError as error:  # the Auto class does not know this config for this task
        raise InvalidArgumentError(
            f"task={task.name!r} does not fit the {getattr(config, 'model_type', '?')} model in '{folder}' "
            f"({_first_line(error)}); pass the task the model was trained for, or task='auto'."
        ) from error
    except OSError as error:
        raise InvalidArgumentError(
            f"the weights in '{folder}' cannot be read ({_first_line(error)}); the folder needs model.safetensors "
            f"or pytorch_model.bin as save_pretrained wrote them."
        ) from error
    except Exception as error:  # a corrupt safetensors raises its own types
        raise InvalidArgumentError(
            f"the weights in '{folder}' cannot be loaded ({type(error).__name__}: {_first_line(error)}); replace "
            f"them with the files save_pretrained wrote."
        ) from error
    _all_weights_read(info, model, task, folder, getattr(config, "architectures", None))
    return Loaded(model.eval(), task, folder, f"{type(model).__name__} from '{folder}'", _preprocessor(folder))


def _all_weights_read(info: dict[str, Any], model: torch.nn.Module, task: Task, folder: Path,
                      architectures: list[str] | None) -> None:
    """Refuse a model whose weights the folder does not all hold: transformers fills those at
    random (a classifier head on a base checkpoint), and the file would compute what the random
    weights compute, proven faithful to them. (A head of another size fails to load instead.)"""
    absent = sorted(set(info.get("missing_keys", ())))
    if not absent:
        return
    shown = ", ".join(absent[:4]) + (f" and {len(absent) - 4} more" if len(absent) > 4 else "")
    saved = f" (it was saved as {architectures[0]})" if architectures else ""
    raise InvalidArgumentError(
        f"task={task.name!r} loads '{folder}' as a {type(model).__name__}, whose weights {shown} the folder does not "
        f"hold{saved}: transformers would fill them at random. Nothing was written. Pass the task the folder was "
        f"saved for (task='auto' reads it), or load and fine-tune the model yourself and give it to "
        f"export_pretrained in memory."
    )


def _takes_pixels(config: Any, architectures: list[str] | None = None) -> bool:
    """Whether the model reads pixels, by transformers' own table of vision models or its
    architecture's main input (a vision tower saved alone, as CLIP's, is in no table): a bare
    vision model's task is then image-feature-extraction, not feature-extraction."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_MAPPING_NAMES

    if getattr(config, "model_type", "") in MODEL_FOR_IMAGE_MAPPING_NAMES:
        return True
    architectures = architectures or getattr(config, "architectures", None) or []
    # transformers' own class attribute; nothing from the folder runs
    classes = [getattr(transformers, name, None) for name in architectures if isinstance(name, str)]
    return any(getattr(c, "main_input_name", None) == "pixel_values" for c in classes if c is not None)


#: The tasks a timm model does: its classifier's logits, or (``num_classes=0``) its pooled embedding.
TIMM_OUTPUTS = {"image-classification": "logits", "image-feature-extraction": "pooler_output"}


class NamedOutputs(torch.nn.Module):
    """A module that returns a tensor (timm's), giving it as the task's named field, as a
    transformers model gives its outputs; ``pooled``: a timm classifier's pooled features (the
    input of its classifier, timm's ``forward_head(..., pre_logits=True)``) instead of its logits."""

    def __init__(self, model: torch.nn.Module, name: str, *, pooled: bool = False) -> None:
        super().__init__()
        self.model, self.output_name, self.pooled = model, name, pooled

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.pooled:
            features = self.model.forward_features(pixel_values)  # type: ignore[operator]
            return {self.output_name: self.model.forward_head(features, pre_logits=True)}  # type: ignore[operator]
        return {self.output_name: self.model(pixel_values)}


def _timm_task(task_name: str) -> Task:
    task = get_task("image-classification" if task_name == "auto" else task_name)
    if task.name not in TIMM_OUTPUTS:
        raise InvalidArgumentError(
            f"task={task.name!r} is not one a timm model does; pass task='image-classification' (the logits) or "
            f"'image-feature-extraction' (the pooled embedding)."
        )
    return task


def _import_timm(what: str) -> Any:
    try:
        import timm
        import timm.data
    except Exception as error:  # a torchvision built for another torch fails with RuntimeError, not ImportError
        raise DependencyError(
            f"{what} needs timm, which cannot be imported here ({type(error).__name__}: "
            f"{_first_line(error)}); install timm and a torchvision built for this torch ({torch.__version__})."
        ) from error
    return timm


def is_timm_model(model: torch.nn.Module) -> bool:
    """A timm model: no transformers config, and timm's own record of its data and classifier."""
    return getattr(model, "config", None) is None and isinstance(getattr(model, "pretrained_cfg", None), dict)


def load_timm_module(model: torch.nn.Module, task_name: str) -> Loaded:
    """A timm model in memory (fine-tuned, say) for image-classification (``'auto'``) or
    image-feature-extraction (its classifier's input); the model is not changed."""
    task = _timm_task(task_name)
    timm = _import_timm(f"source {type(model).__name__} (a timm model)")
    pooled = task.name == "image-feature-extraction"
    return _timm_loaded(timm, model, NamedOutputs(model, TIMM_OUTPUTS[task.name], pooled=pooled), task,
                        f"timm {type(model).__name__} given in memory")


def load_timm(spec: str, weights: str | os.PathLike | None, task_name: str = "auto") -> Loaded:
    """``timm:NAME`` (random weights, or ``weights`` a local state dict or safetensors file) for
    image-classification (``'auto'``) or image-feature-extraction (the pooled embedding)."""
    name = spec[len(TIMM_PREFIX):]
    if not name:
        raise InvalidArgumentError("source 'timm:' names no model; give timm:NAME, e.g. timm:resnet18.")
    if ":" in name:
        raise InvalidArgumentError(
            f"source '{spec}' names a timm model by a hub or folder source; nothing is downloaded or read from "
            f"elsewhere: give timm:ARCHITECTURE and weights= a local state dict or .safetensors file."
        )
    task = _timm_task(task_name)
    if weights is not None and not Path(weights).is_file():
        raise InvalidArgumentError(f"weights '{weights}' is not a file: give a state dict (.pt/.pth) or .safetensors.")
    timm = _import_timm(f"source '{spec}'")
    known = set(timm.list_models())
    if name not in known and name.split(".")[0] not in known:  # an architecture, or one with a pretrained tag
        raise InvalidArgumentError(f"timm {timm.__version__} has no model '{name}'; timm.list_models() lists them.")
    state = _timm_state(timm, Path(weights)) if weights is not None else None
    options: dict[str, Any] = {}
    if task.name == "image-feature-extraction":
        options["num_classes"] = 0
    elif state is not None:
        options.update(_timm_head(timm, name, state))
    try:
        model = timm.create_model(name, pretrained=False, **options)
    except Exception as error:  # timm raises RuntimeError, KeyError, AssertionError by model
        raise InvalidArgumentError(f"timm cannot build '{name}' ({type(error).__name__}: {_first_line(error)}).") \
            from error
    if state is not None:
        _load_timm_state(model, state, Path(weights or ""), task)
    return _timm_loaded(timm, model.eval(), NamedOutputs(model, TIMM_OUTPUTS[task.name]).eval(), task, f"timm {name}")


def _timm_loaded(timm: Any, model: torch.nn.Module, named: NamedOutputs, task: Task, description: str) -> Loaded:
    """What a timm model exports with: its input size, eval transform and preprocessing record, from
    timm's data config of the model."""
    data = timm.data.resolve_model_data_config(model)
    channels, height, width = (int(n) for n in data["input_size"])
    transform = timm.data.create_transform(**data, is_training=False)

    def preprocess(images: list[Any]) -> torch.Tensor:
        return torch.stack([transform(image) for image in images])

    record = {key: (list(value) if isinstance(value, tuple) else value) for key, value in data.items()}
    return Loaded(named, task, None, description, image_size=(channels, height, width), preprocess=preprocess,
                  preprocessing={"library": f"timm {timm.__version__}", **record})


def _timm_state(timm: Any, path: Path) -> dict[str, torch.Tensor]:
    """timm's own reader: a state dict, a training checkpoint (its EMA weights first, without
    DataParallel's prefixes) or safetensors, unpickled with ``weights_only``."""
    try:
        return timm.models.load_state_dict(str(path))
    except Exception as error:  # torch and safetensors raise many types
        raise InvalidArgumentError(f"weights '{path}' cannot be read ({_first_line(error)}).") from error


def _timm_head(timm: Any, name: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``num_classes`` from the checkpoint's classifier, so a model fine-tuned on its own classes
    loads (timm names the classifier module in the model's pretrained config)."""
    classifier = timm.models.get_pretrained_cfg_value(name, "classifier")
    for module in classifier if isinstance(classifier, (list, tuple)) else [classifier]:
        weight = state.get(f"{module}.weight") if isinstance(module, str) else None
        if isinstance(weight, torch.Tensor) and weight.dim() >= 1:
            return {"num_classes": int(weight.shape[0])}
    return {}


def _load_timm_state(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path, task: Task) -> None:
    if task.name == "image-feature-extraction":
        # the embedding is the classifier's input: a checkpoint's head is not part of it
        own = model.state_dict()
        state = {k: v for k, v in state.items() if k in own}
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise InvalidArgumentError(
            f"weights '{path}' do not fit this model ({_first_line(error)}); give the state dict of the same timm "
            f"architecture."
        ) from error


def load_module(model: torch.nn.Module, task_name: str) -> Loaded:
    """A transformers model in memory, for ``task_name`` (``'auto'``: its config's architectures)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise InvalidArgumentError(
            f"source is a {type(model).__name__}, not a transformers or timm model: export_pretrained builds inputs "
            f"from a transformers config or timm's data config. Use export_onnx(model, sample, path) for your own module."
        )
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    task = infer_task(architectures, vision=_takes_pixels(config, architectures),
                      where=f"this {type(model).__name__}") \
        if task_name == "auto" else get_task(task_name)
    return Loaded(model, task, None, type(model).__name__)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
