"""The ``onnxport`` command line.

Each exit code has one meaning, listed once in :data:`EXIT_CODES` (and in ``onnxport --help``).
Messages go to stderr, without a traceback unless ``--debug`` is given.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from .errors import DependencyError, InvalidArgumentError, OnnxportError, WriteError

#: The command's exit codes, each with its one meaning.
EXIT_CODES = {
    0: "success",
    1: "a broken promise: a file onnxport refused to write, or one 'verify'/'debug' found computing something else",
    2: "bad usage: an argument or input file the command cannot act on (each named)",
    3: "an error onnxport did not expect (a bug: please report it with --debug's traceback)",
    4: "an output could not be written (disk full, a size limit, permissions); the target is left as it was",
    5: "a library onnxport drives (torchao, torch.export, ONNX Runtime) failed on this model or machine",
    130: "interrupted; no output was kept",
}
EXIT_OK, EXIT_BROKEN_PROMISE, EXIT_USAGE, EXIT_UNEXPECTED, EXIT_WRITE, EXIT_DEPENDENCY, EXIT_INTERRUPTED = EXIT_CODES


class UsageError(Exception):
    """An argument the command cannot act on (exit code 2)."""


# -- argument helpers -------------------------------------------------------------------------------
def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape such as 1,3,224,224") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape of positive sizes such as 1,3,224,224")
    return dims


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def _input_file(path: str, what: str) -> Path:
    """A file the user named, or a usage error saying what is wrong with it."""
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"{what} '{path}' is a directory; give the file inside it.")
    if not file.is_file():
        raise UsageError(f"{what} '{path}' does not exist.")
    if file.stat().st_size == 0:
        raise UsageError(f"{what} '{path}' is empty.")
    return file


def load_model(spec: str) -> Any:
    """``package.module:callable`` returning an nn.Module, or a saved ``torch.export`` program (``.pt2``)."""
    import torch

    if spec.endswith(".pt2"):
        _input_file(spec, "MODEL")
        import torch.ao.quantization.fx._decomposed  # registers the ops a saved pt2e program calls

        logger = logging.getLogger("torch.export")  # it logs a traceback for an unreadable archive
        level = logger.level
        logger.setLevel(logging.CRITICAL)  # setLevel, not the attribute: it clears logging's cache
        try:
            return torch.export.load(spec).module()
        except Exception as error:  # torch raises zip, pickle and runtime errors alike
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"MODEL '{spec}' could not be loaded as a torch.export program "
                             f"(truncated, or not saved with torch.export.save?): {first}") from error
        finally:
            logger.setLevel(level)
    if ":" not in spec:
        raise UsageError(f"MODEL '{spec}' must be 'package.module:callable' or a .pt2 file saved with torch.export.save.")
    module_name, _, attr = spec.partition(":")
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"MODEL '{spec}': cannot import '{module_name}': {error}.") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"MODEL '{spec}': '{module_name}' has no '{attr}'.")
    if callable(factory) and not isinstance(factory, torch.nn.Module):
        try:
            model = factory()
        except Exception as error:  # the user's own code failed; say so, without a traceback
            raise UsageError(f"MODEL '{spec}': calling '{attr}()' raised {type(error).__name__}: {error}") from error
    else:
        model = factory
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"MODEL '{spec}' gave a {type(model).__name__}, not a torch.nn.Module.")
    return model.eval()


def _sample(shapes: list[tuple[int, ...]] | None, model: Any, token_ids: int | None = None) -> tuple:
    import torch

    if not shapes:
        raise UsageError("give the input shape(s) with --input-shape 1,3,224,224 (once per input).")
    generator = torch.Generator().manual_seed(0)
    if token_ids is not None:  # a language model reads int64 token ids, not floats
        return tuple(torch.randint(0, token_ids, s, generator=generator) for s in shapes)
    return tuple(torch.randn(*s, generator=generator) for s in shapes)


def _calibration(source: str | None, sample: tuple, batch_size: int) -> list[tuple]:
    import numpy as np
    import torch

    if source is None:
        raise UsageError("give --calibration FILE.npy/.npz (or 'random' for a smoke test).")
    if source == "random":
        warnings.warn(
            "RANDOM CALIBRATION: scales come from random inputs, not your data. The file is only good for "
            "smoke tests; pass --calibration with real inputs for a model you deploy.",
            UserWarning,
            stacklevel=2,
        )
        generator = torch.Generator().manual_seed(1)
        return [tuple(torch.randn(batch_size, *t.shape[1:], generator=generator) for t in sample) for _ in range(4)]
    path = _input_file(source, "--calibration")
    if path.suffix not in (".npy", ".npz"):
        raise UsageError(f"--calibration '{source}' must be a .npy or .npz file (one array per input).")
    try:
        if path.suffix == ".npy":
            arrays = [np.load(path)]
        else:
            with np.load(path) as data:
                arrays = [data[k] for k in data.files]
    except Exception as error:  # numpy raises value, OS, pickle and zip errors alike
        raise UsageError(f"--calibration '{source}' is not a readable {path.suffix} file: {error}") from error
    if len(arrays) != len(sample):
        raise UsageError(f"--calibration holds {len(arrays)} array(s) but the model takes {len(sample)} input(s).")
    n = arrays[0].shape[0]
    return [tuple(torch.from_numpy(a[i : i + batch_size]).float() for a in arrays) for i in range(0, n, batch_size)]


# -- commands ----------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo, summary_table

    report = run_demo(args.out, quick=args.quick, progress=not args.no_progress, seed=args.seed)
    print(summary_table(report))
    print(f"\nfiles and report.json written to {Path(args.out).resolve()}")
    return 0


FOLDER_QUANTIZE = ("int8", "dynamic", "int4", "int8-weight-only")
MODULE_QUANTIZE = ("dynamic", "static")


def _pretrained_source(spec: str) -> bool:
    """A save_pretrained folder or ``timm:NAME`` (the front door), not ``package.module:callable`` or a
    ``.pt2`` program (a folder named so is a broken MODEL, and named as one)."""
    return spec.startswith("timm:") or (Path(spec).is_dir() and not spec.endswith(".pt2"))


def cmd_export(args: argparse.Namespace) -> int:
    if _pretrained_source(args.model):
        return _export_pretrained(args)
    if args.quantize is not None and args.quantize not in MODULE_QUANTIZE:
        raise UsageError(f"--quantize {args.quantize} is for a save_pretrained folder or timm:NAME; for MODEL "
                         f"'{args.model}' give {' or '.join(MODULE_QUANTIZE)} (ONNX Runtime's quantizer).")
    for option, value in (("--task", args.task), ("--target", args.target), ("--weights", args.weights),
                          ("--calibration-length", args.calibration_length)):
        if value is not None:
            raise UsageError(f"{option} is for a save_pretrained folder or timm:NAME, not MODEL '{args.model}'.")
    from . import export_onnx

    model = load_model(args.model)
    sample = _sample(args.input_shape, model)
    kwargs: dict[str, Any] = {}
    if args.quantize:
        kwargs.update(quantize=True, quantize_mode=args.quantize)
        if args.quantize == "static":
            kwargs["calibration_data"] = _calibration(args.calibration, sample, args.batch_size)
            kwargs["calibration_method"] = args.calibration_method
    path = export_onnx(model, sample, args.output, opset_version=17 if args.opset is None else args.opset,
                       optimize=not args.no_optimize,
                       dynamic_batch=not args.static_batch, input_names=_names(args.input_names),
                       output_names=_names(args.output_names), **kwargs)
    print(f"wrote {path}")
    return 0


def _seq2seq_folder(source: str, task: str | None) -> bool:
    """An encoder-decoder folder that generates (by its config's architectures and the task asked)."""
    from .pretrained.tasks import generates_seq2seq

    config = Path(source) / "config.json"
    if source.startswith("timm:") or not config.is_file():
        return False
    try:
        architectures = json.loads(config.read_text()).get("architectures")
    except (OSError, ValueError):
        return False  # export_pretrained names the broken config
    return generates_seq2seq(architectures, task or "auto")


def _export_seq2seq(args: argparse.Namespace) -> int:
    from .llm import export_seq2seq

    precisions = {None: "fp32", "int4": "int4", "int8-weight-only": "int8"}
    if args.quantize not in precisions:
        raise UsageError(f"--quantize {args.quantize}: an encoder-decoder folder (export_seq2seq) takes int4 or "
                         f"int8-weight-only (weight-only), or none (fp32).")
    for option, value in (("--calibration", args.calibration), ("--calibration-length", args.calibration_length),
                          ("--target", args.target), ("--weights", args.weights)):
        if value is not None:
            raise UsageError(f"{option}: an encoder-decoder folder (export_seq2seq) takes no {option}; leave it out.")
    result = export_seq2seq(args.model, args.output, precision=precisions[args.quantize], opset_version=args.opset)
    print(result.summary())
    return 0


def _export_pretrained(args: argparse.Namespace) -> int:
    from .pretrained import export_pretrained

    if _seq2seq_folder(args.model, args.task):
        return _export_seq2seq(args)

    if args.quantize is not None and args.quantize not in FOLDER_QUANTIZE:
        raise UsageError(f"--quantize {args.quantize}: a folder or timm model takes {', '.join(FOLDER_QUANTIZE)}.")
    for option, value in (("--input-shape", args.input_shape), ("--input-names", args.input_names),
                          ("--output-names", args.output_names)):
        if value:
            raise UsageError(f"{option} is for package.module:callable models; a folder's inputs and outputs come "
                             f"from its config and task.")
    result = export_pretrained(
        args.model, args.output, task=args.task or "auto", quantize=args.quantize, calibration=args.calibration,
        calibration_samples=args.calibration_samples, calibration_length=args.calibration_length, target=args.target,
        opset_version=args.opset, trust_remote_code=args.trust_remote_code,
        weights=args.weights,
    )
    print(f"wrote {result.path} ({result.task}; inputs {', '.join(result.inputs)}; outputs "
          f"{', '.join(result.outputs)})")
    for line in result.proof_lines():
        print(f"  {line}")
    print(f"wrote {result.folder / 'onnxport.json'}")
    return 0


def cmd_llm(args: argparse.Namespace) -> int:
    from .llm import export_decoder, export_seq2seq

    folder = Path(args.folder)
    if not folder.is_dir():
        raise UsageError(f"FOLDER '{args.folder}' is not a folder; give the folder save_pretrained wrote.")
    # an encoder-decoder (T5, BART, Whisper…) gets its two files with the same precisions and flavours
    seq2seq = _seq2seq_folder(str(folder), None)
    export = export_seq2seq if seq2seq else export_decoder
    result = export(folder, args.output, precision=args.precision, flavour=args.flavour, group_size=args.group_size)
    print(result.summary())
    if result.genai_config is not None:
        print(f"wrote {result.genai_config}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import generate

    target = Path(args.file)
    if not target.exists():
        raise UsageError(f"'{args.file}' does not exist; give the .onnx file export_decoder wrote or an output folder.")
    folder = target if target.is_dir() else target.parent
    given = [name for name, value in (("--ids", args.ids), ("--text", args.text), ("--audio", args.audio)) if value]
    if len(given) != 1:
        raise UsageError("Give the prompts one way: --ids (token ids), --text (tokenized with the folder's tokenizer) "
                         "or --audio (a sound file for a speech folder).")
    seq2seq = (folder / "encoder_model.onnx").is_file()
    options: dict[str, Any] = {}
    if seq2seq:
        options = {k: v for k, v in (("num_beams", args.num_beams), ("language", args.language),
                                       ("task", args.task)) if v is not None}
        if args.timestamps:
            options["return_timestamps"] = True
    else:
        for option, value in (("--num-beams", args.num_beams), ("--language", args.language), ("--task", args.task),
                              ("--timestamps", args.timestamps or None)):
            if value is not None:
                raise UsageError(f"{option} is for an encoder-decoder folder (export_seq2seq), not a decoder file.")
    sampling = {"do_sample": args.sample or None, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "seed": args.seed}
    if args.audio:
        if not seq2seq:
            raise UsageError("--audio is for a speech folder export_seq2seq wrote (Whisper, Speech2Text, Moonshine).")
        source = _audio_source(folder, args.audio)
        tokens = generate(folder, **source, max_new_tokens=args.max_new_tokens, **sampling, **options)
        print("\n".join(_tokenizer(folder).batch_decode(tokens, skip_special_tokens=True)))
        return 0
    if args.text:
        tokenizer = _tokenizer(folder)
        if not seq2seq:
            tokenizer.padding_side = "left"  # a decoder continues from each row's last column
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(list(args.text), return_tensors="np", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        tokens = generate(folder if seq2seq else target, ids, mask, args.max_new_tokens, **sampling, **options)
        if not seq2seq:
            tokens = tokens[:, ids.shape[1]:]
        print("\n".join(tokenizer.batch_decode(tokens, skip_special_tokens=True)))
        return 0
    rows = [[int(t) for t in row.split(",") if t.strip()] for row in args.ids]
    if any(not row for row in rows):
        raise UsageError("--ids needs comma-separated token ids, e.g. --ids 1,15,27 (once per prompt).")
    width = max(map(len, rows))
    if seq2seq:
        # an encoder reads padding anywhere the mask says; the usual side is the right
        ids = [row + [0] * (width - len(row)) for row in rows]
        mask = [[1] * len(row) + [0] * (width - len(row)) for row in rows]
        tokens = generate(folder, ids, mask, args.max_new_tokens, **sampling, **options)
        for row in tokens.tolist():
            print(",".join(map(str, row)))
        return 0
    # prompts of different lengths are padded on the left, as the decoder expects
    ids = [[0] * (width - len(row)) + row for row in rows]
    mask = [[0] * (width - len(row)) + [1] * len(row) for row in rows]
    tokens = generate(target, ids, mask, args.max_new_tokens, **sampling)
    for row, length in zip(tokens.tolist(), map(len, rows)):
        print(",".join(map(str, row[width - length:])))
    return 0


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError alike
        raise UsageError(f"'{folder}' holds no tokenizer transformers can load ({type(error).__name__}); give --ids "
                         f"instead, or export from a folder with its tokenizer files.") from error


def _audio_source(folder: Path, audio: str) -> dict[str, Any]:
    """A sound file as the folder's own feature extractor gives it to the model: log-mel
    ``input_features`` (Whisper, Speech2Text) or the waveform's ``input_values`` (Moonshine), with
    its ``attention_mask`` where the encoder takes one."""
    import json

    path = _input_file(audio, "--audio")
    try:
        import soundfile
    except ImportError as error:
        raise UsageError("--audio needs soundfile (pip install soundfile).") from error
    from transformers import AutoFeatureExtractor

    try:
        extractor = AutoFeatureExtractor.from_pretrained(folder, local_files_only=True)
    except Exception as error:
        raise UsageError(f"'{folder}' holds no feature extractor (preprocessor_config.json) transformers can load "
                         f"({type(error).__name__}); export from the folder with its processor files.") from error
    wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    if rate != extractor.sampling_rate:
        raise UsageError(f"'{audio}' is sampled at {rate} Hz and the model takes {extractor.sampling_rate} Hz; "
                         f"resample it first (e.g. ffmpeg -i IN -ar {extractor.sampling_rate} OUT.wav).")
    import onnx

    from .llm.names import ENCODER_FILE, SEQ2SEQ_METADATA_KEY

    # the encoder's inputs and record, not its weights (they stay in the data file)
    encoder = onnx.load(str(folder / ENCODER_FILE), load_external_data=False)
    takes = [i.name for i in encoder.graph.input]
    info = json.loads({p.key: p.value for p in encoder.metadata_props}.get(SEQ2SEQ_METADATA_KEY, "{}"))
    if not info.get("audio"):
        raise UsageError(f"'{folder}' holds a text model; give --text or --ids, not --audio.")
    masked = "attention_mask" in takes
    wave = wave.mean(axis=1)
    # Whisper's extractor cuts the audio to its window unless told not to; generate decodes the
    # audio past it a window at a time
    window = getattr(extractor, "n_samples", None)
    whole = {"truncation": False, "padding": "longest"} if window and len(wave) > window else {}
    given = extractor(wave, sampling_rate=rate, return_tensors="np",
                      **({"return_attention_mask": True} if masked else {}), **whole)
    return {name: given[name] for name in takes if name in given}


def cmd_qdq(args: argparse.Namespace) -> int:
    from . import Quantizer, export_qdq, qdq_stats

    model = load_model(args.model)
    sample = _sample(args.input_shape, model, token_ids=args.token_ids)
    if args.weight_only:
        if args.target or args.calibration:
            raise UsageError("--weight-only quantizes weights alone: drop --target and --calibration.")
        quantizer = Quantizer(
            backend="torchao", method=f"{args.weight_only}_weight_only", qscheme=args.qscheme,
            group_size=args.group_size, symmetric=not args.asymmetric, quantize_embeddings=args.quantize_embeddings,
        )
        quantized = quantizer.quantize(model)
    else:
        if args.asymmetric or args.quantize_embeddings:
            raise UsageError("--asymmetric and --quantize-embeddings go with --weight-only.")
        calibration = _calibration(args.calibration, sample, args.batch_size)
        quantizer = Quantizer(target=args.target, observer=args.observer, qdq_placement=args.placement,
                              qscheme=args.qscheme)
        quantized = quantizer.quantize(model, calibration, dynamic_batch=True)
    path = export_qdq(quantized, sample, args.output, opset_version=args.opset, activation_dtype=args.activation_dtype,
                      dynamic_batch=not args.static_batch, input_names=_names(args.input_names),
                      output_names=_names(args.output_names))
    print(f"wrote {path}: {json.dumps(qdq_stats(path).as_dict())}")
    return 0


def cmd_encodings(args: argparse.Namespace) -> int:
    from . import encodings_to_onnx_qdq, save_model

    force = None if args.force_activation_as == "none" else args.force_activation_as
    model = encodings_to_onnx_qdq(args.model, args.encodings, prequantize_constants=args.prequantize_constants,
                                  force_activation_as=force, derive_data_movement=not args.no_derive_data_movement)
    path = save_model(model, args.output)
    print(f"wrote {path}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from . import qdq_report

    report = qdq_report(args.file, ort=not args.no_ort)
    print(json.dumps(report.as_dict(), indent=2, default=str) if args.json else str(report))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from . import compare_onnx

    model = load_model(args.model)
    sample = _sample(args.input_shape, model)
    # the model's own float floor unless a fixed tolerance is asked for
    floor = args.rtol is None and args.atol is None
    report = compare_onnx(model, args.file, sample, rtol=args.rtol, atol=args.atol, rounding_floor=floor)
    print(report)
    if not report.passed:
        bound = "its own float floor" if floor else "tolerance"
        print(f"the file does not match the model within {bound}", file=sys.stderr)
        return EXIT_BROKEN_PROMISE
    return EXIT_OK


def cmd_debug(args: argparse.Namespace) -> int:
    from .debug.layers import compare_layers

    for option, path in (("--json", args.json), ("--png", args.png)):
        if path is not None and not (Path(path).parent if str(Path(path).parent) else Path(".")).is_dir():
            raise UsageError(f"{option} '{path}': its directory does not exist.")
    model = None if args.optimized else load_model(args.model)
    sample = _sample(args.input_shape, model)
    report = compare_layers(model, args.file, sample, optimized=args.optimized, n_batches=args.n_batches)
    print(report)
    if args.json:
        from ._core.io import write_text_atomic

        write_text_atomic(args.json, json.dumps(report.as_dict(), indent=2, default=str))
        print(f"wrote {args.json}")
    if args.png:
        try:
            report.plot(args.png)
            print(f"wrote {args.png}")
        except OnnxportError as error:
            print(f"onnxport debug: no picture: {error}", file=sys.stderr)
    return EXIT_BROKEN_PROMISE if report.first_divergence is not None and report.first_divergence.cause != "rounding" else EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        bench = importlib.import_module("bench.__main__")
    except ImportError:
        raise UsageError("the benchmarks live in the source checkout: run 'onnxport bench' from its root.") from None
    return bench.main(args.only)


# -- the parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .targets import TARGETS

    parser = argparse.ArgumentParser(
        prog="onnxport", description="PyTorch to deployable ONNX, every claim checked on the file.",
        epilog="exit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log each export step and each proof on the written file to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run every path on a built-in model and data (no downloads)")
    demo.add_argument("--out", default="onnxport-demo", help="output folder (default ./onnxport-demo)")
    demo.add_argument("--quick", action="store_true", help="fewer training steps (CI)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=cmd_demo)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", metavar="MODEL", help="package.module:callable returning an nn.Module, or a .pt2 file")
        p.add_argument("--input-shape", type=_shape, action="append", metavar="SHAPE", help="e.g. 1,3,224,224; once per input")
        p.add_argument("--input-names", help="comma-separated graph input names")
        p.add_argument("--output-names", help="comma-separated graph output names")

    export = sub.add_parser(
        "export", help="a save_pretrained folder, timm:NAME or MODEL to a proven ONNX file",
        description="SOURCE is a save_pretrained folder or timm:NAME (the task, inputs and outputs come from it; -o "
                    "is a folder), or MODEL: package.module:callable or a .pt2 file (with --input-shape; -o is a file).")
    model_args(export)
    export.add_argument("-o", "--output", required=True, help="the output folder (SOURCE) or .onnx file (MODEL)")
    export.add_argument("--opset", type=int, default=None)
    export.add_argument("--quantize", choices=sorted({*FOLDER_QUANTIZE, *MODULE_QUANTIZE}),
                        help="SOURCE: int8 (pt2e static, needs --calibration), dynamic (activations quantized at "
                             "run time, no calibration), int4 or int8-weight-only (torchao weight-only); "
                             "MODEL: dynamic or static (ONNX Runtime's quantizer)")
    export.add_argument("--task", help="SOURCE: a transformers pipeline task (default: read from config.json; "
                                       "timm:NAME: image-classification, or image-feature-extraction for the "
                                       "pooled embedding)")
    export.add_argument("--target", help="SOURCE with --quantize int8: the deployment target (default onnxruntime)")
    export.add_argument("--calibration-samples", type=int, default=64, help="SOURCE: calibration samples to use")
    export.add_argument("--trust-remote-code", action="store_true",
                        help="SOURCE: let a config with auto_map run the folder's own code")
    export.add_argument("--weights", help="timm:NAME: a local state dict, training checkpoint or .safetensors file")
    export.add_argument("--calibration", help="SOURCE: a text file (one sample a line), a folder of images or audio, "
                                              "or a .npz; MODEL: .npy/.npz inputs, or 'random' (smoke tests only)")
    export.add_argument("--calibration-length", type=int, default=None,
                        help="SOURCE with a text file: tokens per calibration line, padded or cut (default: the "
                             "export sample's length)")
    export.add_argument("--calibration-method", default="minmax", choices=("minmax", "entropy", "percentile"))
    export.add_argument("--batch-size", type=int, default=8, help="calibration batch size")
    export.add_argument("--no-optimize", action="store_true")
    export.add_argument("--static-batch", action="store_true", help="keep the sample's batch size fixed")
    export.set_defaults(func=cmd_export)

    llm = sub.add_parser("llm", help="a causal LM's save_pretrained folder -> an ONNX decoder with a key/value cache; "
                                     "an encoder-decoder's (T5, BART, Whisper…) -> its encoder and decoder files")
    llm.add_argument("folder", metavar="FOLDER", help="the folder save_pretrained wrote (config.json, weights)")
    llm.add_argument("-o", "--output", required=True, metavar="OUTDIR",
                     help="folder for model.onnx (+ .data; an encoder-decoder: encoder_model.onnx and "
                          "decoder_model.onnx), genai_config.json and the tokenizer files")
    llm.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "int4", "int8"))
    llm.add_argument("--flavour", default="portable", choices=("portable", "ort-cpu"),
                     help="standard ONNX operators, or ONNX Runtime's CPU fusions")
    llm.add_argument("--group-size", type=int, default=32, help="int4/int8: input features per scale")
    llm.set_defaults(func=cmd_llm)

    gen = sub.add_parser("generate", help="generate with a decoder file or an encoder-decoder folder (greedy, "
                                          "beam search, or seeded sampling)")
    gen.add_argument("file", metavar="FILE.onnx|OUTDIR", help="export_decoder's file, or an export_seq2seq folder")
    gen.add_argument("--ids", action="append", metavar="IDS",
                     help="a prompt's comma-separated token ids; once per prompt (prints token ids)")
    gen.add_argument("--text", action="append", metavar="TEXT",
                     help="a prompt, tokenized with the folder's tokenizer; once per prompt (prints text)")
    gen.add_argument("--audio", metavar="FILE.wav",
                     help="a speech folder (Whisper, Speech2Text, Moonshine): a sound file at the model's sampling rate "
                          "(Whisper: past its 30 s window, decoded window by window)")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help="default: 32 (decoder), the generation config's max_length (encoder-decoder)")
    gen.add_argument("--num-beams", type=int, help="encoder-decoder: beam search with this many beams")
    gen.add_argument("--language", help="Whisper: the language (default: detected from the audio)")
    gen.add_argument("--task", choices=("transcribe", "translate"), help="Whisper: transcribe or translate")
    gen.add_argument("--timestamps", action="store_true", help="Whisper: with timestamp tokens")
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, help="the sampling seed")
    gen.set_defaults(func=cmd_generate)

    qdq = sub.add_parser("qdq", help="pt2e-quantize and export faithful Q/DQ")
    model_args(qdq)
    qdq.add_argument("-o", "--output", required=True)
    qdq.add_argument("--calibration", help=".npy/.npz inputs, or 'random' (smoke tests only)")
    qdq.add_argument("--batch-size", type=int, default=8)
    qdq.add_argument("--target", choices=TARGETS)
    qdq.add_argument("--observer", default="histogram", choices=("histogram", "minmax", "percentile"))
    qdq.add_argument("--placement", default="per_op", choices=("per_op", "skip_conv_add"))
    qdq.add_argument("--qscheme", choices=("per_channel", "per_tensor", "per_group"),
                     help="pt2e: per_channel (default) or per_tensor; --weight-only: per_group (int4's default) "
                          "or per_channel (int8's default)")
    qdq.add_argument("--weight-only", choices=("int4", "int8"),
                     help="torchao weight-only quantization (no calibration), exported at opset 21")
    qdq.add_argument("--group-size", type=int, default=128, help="--weight-only per_group: input features per scale")
    qdq.add_argument("--asymmetric", action="store_true", help="--weight-only: a zero-point per block")
    qdq.add_argument("--quantize-embeddings", action="store_true", help="--weight-only: quantize nn.Embedding too")
    qdq.add_argument("--token-ids", type=int, metavar="VOCAB",
                     help="the sample is random int64 token ids below VOCAB (language models)")
    qdq.add_argument("--activation-dtype", choices=("int8", "uint8"))
    qdq.add_argument("--opset", type=int)
    qdq.add_argument("--static-batch", action="store_true")
    qdq.set_defaults(func=cmd_qdq)

    enc = sub.add_parser("encodings", help="ONNX model + AIMET encodings -> ONNX Q/DQ")
    enc.add_argument("model", metavar="MODEL.onnx")
    enc.add_argument("encodings", metavar="FILE.encodings")
    enc.add_argument("-o", "--output", required=True)
    enc.add_argument("--prequantize-constants", action="store_true")
    enc.add_argument("--force-activation-as", default="unsigned", choices=("unsigned", "signed", "none"))
    enc.add_argument("--no-derive-data-movement", action="store_true")
    enc.set_defaults(func=cmd_encodings)

    stats = sub.add_parser("stats", help="what a Q/DQ file contains (qdq_stats + qdq_report)")
    stats.add_argument("file", metavar="FILE.onnx")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.add_argument("--no-ort", action="store_true", help="skip reading ONNX Runtime's optimised graph")
    stats.set_defaults(func=cmd_stats)

    verify = sub.add_parser("verify", help="compare a float ONNX file with the PyTorch model on random inputs")
    model_args(verify)
    verify.add_argument("file", metavar="FILE.onnx")
    verify.add_argument("--rtol", type=float, default=None,
                        help="judge by a fixed tolerance instead of the model's own float floor (with --atol; "
                             "default 1e-3 when only --atol is given)")
    verify.add_argument("--atol", type=float, default=None,
                        help="judge by a fixed tolerance instead of the model's own float floor (with --rtol; "
                             "default 1e-5 when only --rtol is given)")
    verify.set_defaults(func=cmd_verify)

    debug = sub.add_parser("debug", help="layer by layer: where a Q/DQ file and its pt2e model part ways")
    model_args(debug)
    debug.add_argument("file", metavar="FILE.onnx")
    debug.add_argument("--optimized", action="store_true",
                       help="compare ONNX Runtime's optimised run with the unoptimised one (MODEL is not loaded)")
    debug.add_argument("--n-batches", type=int, default=1, help="split the inputs into this many batches (fixed-batch files)")
    debug.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    debug.add_argument("--png", metavar="PATH", help="also write a picture of the error per layer (needs matplotlib)")
    debug.set_defaults(func=cmd_debug)

    bench = sub.add_parser("bench", help="run the benchmarks under bench/ (source checkout)")
    bench.add_argument("--only", nargs="*", help="benchmark names to run")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        _log_to_stderr()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"onnxport {args.command}: interrupted; no output was kept.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # the promise is: no traceback without --debug
        if args.debug:
            raise
        code = exit_code(error)
        if code == EXIT_UNEXPECTED:
            message = (f"failed on an error onnxport did not expect: {type(error).__name__}: {error}. Run again with "
                       f"--debug for the traceback, and please report it.")
        else:
            prefix = {EXIT_BROKEN_PROMISE: "refused: ", EXIT_WRITE: "could not write: ",
                      EXIT_DEPENDENCY: "a library failed: "}.get(code, "")
            message = f"{prefix}{error}"
        print(f"onnxport {args.command}: {message}", file=sys.stderr)
        return code


def _log_to_stderr() -> None:
    """Show onnxport's log (the engine's steps and proofs) on stderr, once per process."""
    logger = logging.getLogger("onnxport")
    if not any(getattr(h, "_onnxport_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("onnxport: %(message)s"))
        handler._onnxport_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def exit_code(error: BaseException) -> int:
    """The exit code an exception ends the command with (see :data:`EXIT_CODES`)."""
    if isinstance(error, (UsageError, InvalidArgumentError)):
        return EXIT_USAGE
    if isinstance(error, WriteError):
        return EXIT_WRITE
    if isinstance(error, DependencyError):
        return EXIT_DEPENDENCY
    if isinstance(error, OnnxportError):
        return EXIT_BROKEN_PROMISE
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_UNEXPECTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
