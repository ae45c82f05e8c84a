"""The tasks the front door exports, by transformers' pipeline names, and how a folder's task is told.

A task names the transformers Auto class that loads the model and the kind of inputs it takes; a
folder's task is read from ``architectures`` in its config.json, by the Auto mapping that lists
that class (transformers' own tables: a new architecture needs no entry here).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidArgumentError

Modality = Literal["text", "choices", "vision", "audio", "text-vision"]


@dataclass(frozen=True)
class Task:
    """One exportable task.

    Attributes:
        name: transformers' pipeline name (``'text-classification'``).
        auto_class: the transformers class that loads it (``'AutoModelForSequenceClassification'``).
        mapping: the ``modeling_auto`` table that lists its architectures, for ``task='auto'``.
        modality: the inputs it takes: token ids (``'text'``), token ids per choice
            (``'choices'``), pixels (``'vision'``), a waveform (``'audio'``) or text and pixels
            with independent batches (``'text-vision'``); ``None`` to take the model's own.
        outputs: the output fields the file gives, in order (the transformers output's names);
            ``()`` for every tensor field the model returns.
    """

    name: str
    auto_class: str
    mapping: str
    modality: Modality | None = None
    outputs: tuple[str, ...] = ()


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("audio-classification", "AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
         "audio", ("logits",)),
    Task("automatic-speech-recognition", "AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES", "audio", ("logits",)),
    Task("fill-mask", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "text", ("logits",)),
    Task("text-classification", "AutoModelForSequenceClassification",
         "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "text", ("logits",)),
    Task("token-classification", "AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
         "text", ("logits",)),
    Task("question-answering", "AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "text",
         ("start_logits", "end_logits")),
    Task("multiple-choice", "AutoModelForMultipleChoice", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "choices",
         ("logits",)),
    Task("image-classification", "AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
         "vision", ("logits",)),
    Task("object-detection", "AutoModelForObjectDetection", "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES", "vision",
         ("logits", "pred_boxes")),
    Task("semantic-segmentation", "AutoModelForSemanticSegmentation",
         "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "vision", ("logits",)),
    Task("zero-shot-image-classification", "AutoModelForZeroShotImageClassification",
         "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES", "text-vision",
         ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds")),
    # the base models last: every architecture's bare model is listed here
    Task("feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES", "text"),
    Task("image-feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES", "vision"),
)}

#: Tasks another exporter takes, and what to use instead.
ROUTED = {
    "text-generation": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                        "a causal LM generates with a key/value cache: use export_decoder (onnxport llm FOLDER -o OUT)"),
    "text2text-generation": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                             ("an encoder-decoder generates with an encoder and a decoder file: use export_seq2seq "
                             "(onnxport export FOLDER -o OUT routes there)")),
    "automatic-speech-recognition (encoder-decoder)": (
        "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
        ("a speech encoder-decoder (Whisper, Speech2Text, Moonshine) generates with an encoder and a decoder file: use export_seq2seq "
        "(onnxport export FOLDER -o OUT routes there)")),
}

#: The tasks :func:`generates_seq2seq` sends to ``export_seq2seq`` (with ``'auto'``).
SEQ2SEQ_TASKS = ("text2text-generation", "automatic-speech-recognition", "translation", "summarization")


def task_names() -> list[str]:
    return sorted(TASKS)


def get_task(name: str) -> Task:
    """The :class:`Task` of a pipeline name, or an error listing them."""
    if name in TASKS:
        return TASKS[name]
    if name in ROUTED:
        raise InvalidArgumentError(f"task={name!r}: {ROUTED[name][1]}.")
    raise InvalidArgumentError(f"task={name!r} is not one onnxport exports; give one of: {', '.join(task_names())}, "
                               f"or 'auto' to read it from config.json.")


def _listed(mapping: str, architecture: str) -> bool:
    from transformers.models.auto import modeling_auto

    table = getattr(modeling_auto, mapping, {})
    for value in table.values():
        names = (value,) if isinstance(value, str) else tuple(value)
        if architecture in names:
            return True
    return False


#: transformers' table of text encoders: the encoder of an encoder-decoder (``T5EncoderModel``) and
#: the text tower of a multimodal model (``MllamaTextModel``), keyed by model_type.
TEXT_ENCODERS = "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES"

#: A text or vision tower saved alone (``SiglipTextModel``, ``CLIPTextModelWithProjection``): a bare
#: model that no Auto table lists.
_TOWER = re.compile(r"(Text|Vision|Image|Encoder)Model(WithProjection)?$")


def _tower(architecture: str) -> bool:
    """A transformers bare model of one modality that no Auto table lists (its own class loads it)."""
    import transformers

    return bool(_TOWER.search(architecture)) and hasattr(transformers, architecture) and not any(
        _listed(mapping, architecture) for mapping in ("MODEL_MAPPING_NAMES", TEXT_ENCODERS))


def model_class(task: Task, architectures: Sequence[str] | None, model_type: str) -> str:
    """The transformers class that loads a folder for ``task``: the task's Auto class, except for the
    base-model tasks, which load the encoder alone of an encoder-decoder (``T5EncoderModel`` from a
    T5 checkpoint, by transformers' text-encoding table, or ``LongT5EncoderModel`` by its naming: the
    embeddings come from the encoder, whose inputs the front door builds) and a tower saved alone
    by its own class (``AutoModel`` knows neither)."""
    if task.auto_class != "AutoModel":
        return task.auto_class
    from transformers.models.auto import modeling_auto

    architecture = (architectures or [""])[0]
    if _tower(architecture):  # its own class: CLIPTextModelWithProjection, not the table's CLIPTextModel
        return architecture
    if task.modality == "text" and model_type in getattr(modeling_auto, TEXT_ENCODERS, {}):
        return "AutoModelForTextEncoding"
    # an encoder-decoder the table does not list (LongT5): its encoder class by transformers' naming
    base = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    if task.modality == "text" and isinstance(base, str) and base.endswith("Model"):
        import transformers

        encoder = f"{base[:-len('Model')]}EncoderModel"
        if hasattr(transformers, encoder):
            return encoder
    return task.auto_class


def infer_task(architectures: Sequence[str] | None, *, vision: bool, where: str) -> Task:
    """The task of a config's ``architectures`` (its first entry), by the Auto table that lists it.

    ``vision``: the bare model takes pixels (its base model is then image-feature-extraction).
    """
    if not architectures:
        raise InvalidArgumentError(
            f"{where} names no 'architectures', so its task cannot be told; pass task= one of: "
            f"{', '.join(task_names())}."
        )
    architecture = architectures[0]
    for routed, (mapping, advice) in ROUTED.items():
        if _listed(mapping, architecture):
            raise InvalidArgumentError(f"{where} holds a {architecture} ({routed}): {advice}.")
    for task in TASKS.values():
        if task.name == "feature-extraction" and vision:
            continue
        if task.name == "image-feature-extraction" and not vision:
            continue
        if _listed(task.mapping, architecture):
            return task
    if _listed(TEXT_ENCODERS, architecture) or _tower(architecture):
        return TASKS["image-feature-extraction" if vision else "feature-extraction"]
    raise InvalidArgumentError(
        f"{where} holds a {architecture}, which no task onnxport exports lists; pass task= one of: "
        f"{', '.join(task_names())}, if the model does one of them."
    )


def generates_seq2seq(architectures: Sequence[str] | None, task: str) -> bool:
    """Whether a folder of these ``architectures`` asked for ``task`` is an encoder-decoder that
    generates (``export_seq2seq``'s), not one the front door's one-file tasks take."""
    if task not in (*SEQ2SEQ_TASKS, "auto"):
        return False
    if task in ("text2text-generation", "translation", "summarization"):
        return True
    architecture = (architectures or [""])[0]
    mappings = [ROUTED["automatic-speech-recognition (encoder-decoder)"][0]]
    if task == "auto":
        mappings.append(ROUTED["text2text-generation"][0])
    return any(_listed(mapping, architecture) for mapping in mappings)
