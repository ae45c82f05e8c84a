"""Writing models: the one place that knows how to leave nothing half-written behind.

Every writer stages its output in a private folder beside the target (same file system, so the
final ``os.replace`` is atomic), checks it there, and only then moves it into place. On any
failure the staging folder is removed with everything in it, and the target is left as it was.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.external_data_helper

from ..errors import InvalidArgumentError, UnsafeExternalDataError, WriteError

#: Protobuf cannot serialise a message of 2 GiB or more; bigger models keep their weights outside.
PROTOBUF_LIMIT = 2**31 - 1
EXTERNAL_SIZE_THRESHOLD = 1024  # tensors smaller than this stay inside the .onnx file
#: weights above this many bytes go to external data: room for the graph itself under the limit
EXTERNAL_DATA_BYTES = PROTOBUF_LIMIT - 64 * 1024 * 1024


def read_onnx(path: str | os.PathLike, argument: str = "model", *, load_external_data: bool = False) -> onnx.ModelProto:
    """Load an ONNX file a user named, or raise a named error: missing, a directory, unreadable,
    empty, truncated or corrupt, not a model, no graph, no opset."""
    from google.protobuf.message import DecodeError

    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"{argument} must be a path to an .onnx file, not {type(path).__name__}.")
    file = Path(path)
    if file.is_dir():
        raise InvalidArgumentError(f"{argument} '{file}' is a directory; give the .onnx file inside it.")
    if not file.is_file():
        raise InvalidArgumentError(f"{argument} '{file}' does not exist.")
    if not os.access(file, os.R_OK):
        raise InvalidArgumentError(f"{argument} '{file}' cannot be read (permission denied).")
    if file.stat().st_size == 0:
        raise InvalidArgumentError(f"{argument} '{file}' is empty: it holds no ONNX model.")
    try:
        model = onnx.load_model(str(file), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as error:
        raise InvalidArgumentError(
            f"{argument} '{file}' is not a readable ONNX model (truncated or not ONNX?): {str(error).splitlines()[0]}"
        ) from None
    except OSError as error:
        raise InvalidArgumentError(f"{argument} '{file}' could not be read: {error.strerror or error}.") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise InvalidArgumentError(f"{argument} '{file}' parses, but holds no graph: it is not an ONNX model.")
    if not any(e.domain in ("", "ai.onnx") for e in model.opset_import):
        raise InvalidArgumentError(f"{argument} '{file}' declares no default-domain opset, so no runtime can read it.")
    check_external_locations(model, file.parent)  # before any byte of external data is read
    if load_external_data:
        check_external_data(model, file.parent)
        onnx.external_data_helper.load_external_data_for_model(model, str(file.parent))
    return model


def check_output_path(output_path: str | os.PathLike, argument: str = "output_path") -> Path:
    """Validate an output path before any work: a ``.onnx`` file in a writable directory."""
    if not isinstance(output_path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"{argument} must be a str or os.PathLike naming an .onnx file, "
            f"not {type(output_path).__name__}."
        )
    path = Path(output_path)
    if path.exists() and path.is_dir():
        raise InvalidArgumentError(
            f"{argument} '{path}' is a directory; give a file name such as '{path / 'model.onnx'}'."
        )
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise InvalidArgumentError(
            f"The directory of {argument} '{path}' does not exist; create '{directory}' first."
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InvalidArgumentError(
            f"The directory of {argument} '{path}' is not writable; choose a directory you can write to."
        )
    return path


def _tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes held by the initializers and constants of the main graph (what decides > 2 GB)."""
    total = sum(len(t.raw_data) for t in model.graph.initializer)
    total += sum(
        sum(len(v) for v in (t.float_data, t.int32_data, t.int64_data, t.double_data)) * 4
        for t in model.graph.initializer
        if not t.raw_data
    )
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                total += len(attr.t.raw_data)
    return total


def needs_external_data(model: onnx.ModelProto) -> bool:
    """True when the model cannot be serialised as one protobuf (its tensors reach 2 GB)."""
    return _tensor_bytes(model) >= EXTERNAL_DATA_BYTES


def walk_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every subgraph (If/Loop/Scan bodies) inside it, depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from walk_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from walk_graphs(g)


#: metadata key under which a model whose weights were never loaded remembers their folder
#: (set by ``encodings_to_onnx_qdq`` on a model read from a path; ``save_model`` reads it).
EXTERNAL_BASE_KEY = "onnxport.external_data_dir"


def _all_initializers(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for graph in walk_graphs(model.graph):
        yield from graph.initializer


def has_unloaded_external_data(model: onnx.ModelProto) -> bool:
    """True when some tensor still refers to an external file that was never loaded."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in _all_initializers(model))


#: external_data key naming the folder of one tensor's data, overriding the model's folder.
BASEPATH_KEY = "basepath"
_scratch_root: Path | None = None


def _scratch_folder() -> Path:
    """One private folder under the temp directory for this process, removed when it exits."""
    global _scratch_root
    if _scratch_root is None or not _scratch_root.is_dir():
        _scratch_root = Path(tempfile.mkdtemp(prefix="onnxport-scratch-"))
        atexit.register(shutil.rmtree, _scratch_root, True)
    return _scratch_root


class ScratchTensors:
    """Tensors a conversion makes that must not stay in memory (a 7B model's prequantized weights).

    Each is appended to one scratch file under the temp directory (``TMPDIR``) and given back as
    an ``ir.ExternalTensor`` in that folder, so ``ir.save`` copies it into the final file like any
    other weight left on disk. The scratch folder is removed when the process exits.
    """

    def __init__(self) -> None:
        handle, name = tempfile.mkstemp(dir=_scratch_folder(), suffix=".data")
        self.path = Path(name)
        self._file = os.fdopen(handle, "wb")
        self._offset = 0
        self.names: set[str] = set()

    def put(self, name: str, values: np.ndarray) -> Any:
        import onnx_ir as ir

        raw = ir.tensor(values, name=name).tobytes()  # packs 4- and 2-bit types as ONNX stores them
        self._file.write(raw)
        tensor = ir.ExternalTensor(self.path.name, self._offset, len(raw), ir.DataType.from_numpy(values.dtype),
                                   shape=ir.Shape(values.shape), name=name, base_dir=str(self.path.parent))
        self._offset += len(raw)
        self.names.add(name)
        return tensor

    def close(self) -> None:
        self._file.close()

    def mark(self, model: onnx.ModelProto) -> None:
        """Name the scratch folder (``basepath``) in the external data of this scratch's tensors in
        ``model``: a proto carries no folder of its own for them."""
        for tensor in onnx.external_data_helper._get_all_tensors(model):
            if tensor.name in self.names and tensor.data_location == onnx.TensorProto.EXTERNAL:
                tensor.external_data.add(key=BASEPATH_KEY, value=str(self.path.parent))


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def inside_folder(folder: Path, location: str, tensor: str) -> Path:
    """``folder / location`` when that file lies inside ``folder`` (links resolved); else a named
    error. ``onnx.load`` and ONNX Runtime refuse the same locations: a model file from anywhere
    must not make onnxport read (and carry into its output) any file the user can read."""
    if not location:
        raise UnsafeExternalDataError(f"Tensor '{tensor}' refers to external data but names no file ('location').")
    if os.path.isabs(location) or Path(location).drive or location.startswith(("/", "\\")):
        raise UnsafeExternalDataError(
            f"Tensor '{tensor}' names its external data by the absolute path '{location}'; a model's external "
            f"data must be a file inside the model's folder, named relative to it. Refused before reading it."
        )
    root = Path(os.path.realpath(folder))
    file = Path(os.path.realpath(root / location))
    if file != root and root not in file.parents:
        raise UnsafeExternalDataError(
            f"Tensor '{tensor}' names its external data '{location}', which resolves to '{file}', outside the "
            f"model's folder '{root}'. A model's external data must stay inside its folder; refused before "
            f"reading it."
        )
    return file


def external_folder(tensor: onnx.TensorProto, base: str | os.PathLike | None) -> Path:
    """The folder an external tensor's ``location`` is relative to: ``base`` (the model's folder),
    or the ``basepath`` entry of a tensor onnxport spilled to its own scratch folder. A
    ``basepath`` that names any other folder came from a file, not from us, and is refused."""
    own = _external_info(tensor).get(BASEPATH_KEY)
    if own is not None:
        scratch = None if _scratch_root is None else Path(os.path.realpath(_scratch_root))
        if scratch is None or Path(os.path.realpath(own)) != scratch:
            raise UnsafeExternalDataError(
                f"Tensor '{tensor.name}' names its own external-data folder '{own}' ('{BASEPATH_KEY}'), which only "
                f"onnxport's scratch tensors may do; a model's external data must stay inside its folder."
            )
        return scratch
    if base is None:
        raise InvalidArgumentError(
            f"Tensor '{tensor.name}' refers to external data whose folder is unknown; load the model from its "
            f"path (or with onnx.load(path), weights included)."
        )
    return Path(base)


def external_source(tensor: onnx.TensorProto, base: str | os.PathLike | None) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes; length -1 when the file says none.

    The file is confined to the model's folder (see :func:`external_folder`); anything else is an
    :class:`~onnxport.errors.UnsafeExternalDataError` before a byte is read.
    """
    info = _external_info(tensor)
    file = inside_folder(external_folder(tensor, base), info.get("location", ""), tensor.name)
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
    except ValueError:
        raise InvalidArgumentError(
            f"Tensor '{tensor.name}' gives its external data's offset/length as "
            f"{info.get('offset')!r}/{info.get('length')!r}, which are not integers."
        ) from None
    if offset < 0 or length < -1:
        raise InvalidArgumentError(f"Tensor '{tensor.name}' gives a negative external-data offset or length.")
    return file, offset, length


def check_external_locations(model: onnx.ModelProto, base: str | os.PathLike | None) -> None:
    """Every external tensor (subgraphs included) names a file inside ``base``; a named error otherwise."""
    for tensor in onnx.external_data_helper._get_all_tensors(model):  # initializers and attributes, bodies too
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            external_source(tensor, base)


def check_external_data(model: onnx.ModelProto, base: str | os.PathLike | None) -> None:
    """Every external tensor's bytes exist where the model says, inside its folder: a named error
    before any work."""
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        file, offset, length = external_source(tensor, base)
        if not file.is_file():
            raise InvalidArgumentError(
                f"Tensor '{tensor.name}' lives in external data file '{file}', which does not exist; keep the "
                f"model's .data file beside it."
            )
        size = file.stat().st_size
        need = offset + max(length, 0)
        if need > size or (length < 0 and offset >= size > 0):
            raise InvalidArgumentError(
                f"Tensor '{tensor.name}' lives at bytes {offset}..{need} of '{file}', which holds only {size} bytes: "
                f"the external data is truncated or belongs to another model."
            )


@contextlib.contextmanager
def staged_output(output_path: str | os.PathLike) -> Iterator[Path]:
    """Stage a file for ``output_path`` and move it into place only if the block succeeds.

    Yields the path to write to, inside a private folder beside ``output_path``. The block may
    write scratch files in that folder too. When it returns, the model and the external-data
    files it refers to are moved beside ``output_path`` and everything else is dropped; on an
    exception the folder and all it holds are removed and ``output_path`` is left untouched.

    A model and its data cannot be replaced in one step. Data files already at the target are
    moved into the stage first, the new ones take their places, and the model is replaced last;
    if any move fails, the old files are moved back, so the previous model never points at new
    data.
    """
    target = Path(output_path)
    directory = target.parent if str(target.parent) else Path(".")
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=directory))
    moved_aside: list[tuple[Path, Path]] = []  # (old file now in the stage, where it was)
    placed: list[Path] = []  # new data files moved to the target folder where none was before
    try:
        staged = stage / target.name
        yield staged
        if not staged.is_file():
            raise AssertionError(f"The staged model '{staged}' was never written.")  # a writer's bug
        # Only the model and the external data it names leave the stage; scratch files the block
        # wrote beside them are dropped with it.
        data = external_data_files(staged)
        for item in data:
            if item.parent != stage or not item.is_file():
                raise AssertionError(f"The staged model refers to external data '{item}' outside its stage.")
        for number, item in enumerate(data):
            final = directory / item.name
            if final.exists():
                aside = stage / f".previous-{number}"
                os.replace(final, aside)
                moved_aside.append((aside, final))
            else:
                placed.append(final)
            os.replace(item, final)
        os.replace(staged, target)  # the commit: from here on the new model and its data stand
        moved_aside.clear()
        placed.clear()
    except OSError as error:
        restored = _restore(moved_aside, placed)
        if isinstance(error, WriteError):
            raise
        if not restored:
            state = "; the previous model's external data could not all be moved back, so check it before use"
        elif target.exists():
            state = " and the previous file is untouched"
        else:
            state = ""
        raise WriteError(
            f"Writing '{target}' failed part-way ({error.strerror or error}); nothing was left behind{state}. "
            f"Free space or raise the limit, then write again."
        ) from error
    except BaseException:
        _restore(moved_aside, placed)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _restore(moved_aside: list[tuple[Path, Path]], placed: list[Path]) -> bool:
    """Undo a part-way commit: new data files out, the previous ones back. True when all went back."""
    whole = True
    for path in placed:
        with contextlib.suppress(OSError):
            path.unlink()
    for aside, final in reversed(moved_aside):
        try:
            os.replace(aside, final)
        except OSError:
            whole = False
    return whole


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write a text file (a JSON report) through a temporary file beside it, then replace."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write a small file (a report, saved run results) through a temporary file beside it, then replace."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise InvalidArgumentError(f"The directory of '{target}' does not exist; create '{directory}' first.")
    handle, scratch = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=directory)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(scratch, target)
    except OSError as error:
        raise WriteError(f"Writing '{target}' failed ({error.strerror or error}); nothing was left behind.") from error
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


def external_data_files(path: str | os.PathLike) -> list[Path]:
    """The external-data files an ONNX file refers to (read without loading weights)."""
    path = Path(path)
    model = onnx.load_model(str(path), load_external_data=False)
    names: set[str] = set()
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    names.add(entry.value)
    return [path.parent / n for n in sorted(names)]


def check_output_folder(output_dir: str | os.PathLike, argument: str = "output_dir") -> Path:
    """``output_dir`` as a Path: a folder that may exist (its files with the same names are replaced
    as a whole, others left), or a new one whose parent exists."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise InvalidArgumentError(f"{argument} '{folder}' is a file; give a folder (it is created if needed).")
    parent = folder.parent if str(folder.parent) else Path(".")
    if not parent.is_dir():
        raise InvalidArgumentError(f"{argument} '{folder}': its parent '{parent}' does not exist; create it first.")
    return folder


@contextlib.contextmanager
def staged_folder(output_dir: str | os.PathLike) -> Iterator[Path]:
    """A private folder beside ``output_dir`` to assemble its files in; when the block succeeds
    they are moved into ``output_dir`` (created when new, by one rename), the model files last, so
    a reader never sees a new model beside old companions; on an exception nothing is moved and the
    stage is removed. ``output_dir``'s other files are left as they are."""
    folder = Path(output_dir)
    parent = folder.parent if str(folder.parent) else Path(".")
    stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=parent))
    try:
        yield stage
        if not folder.exists():
            os.replace(stage, folder)
            return
        names = sorted(p.name for p in stage.iterdir())
        models = [n for n in names if n.endswith(".onnx")]
        for name in [*(n for n in names if n not in models), *models]:
            os.replace(stage / name, folder / name)
    except OSError as error:
        raise WriteError(f"Writing into '{folder}' failed ({error.strerror or error}); the files not yet moved "
                         f"were dropped.") from error
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def release_freed_memory() -> None:
    """Hand freed heap memory (a serialised or parsed graph) back to the OS before ONNX Runtime loads a file.

    glibc keeps freed blocks for reuse; at LLM scale those are gigabytes that the sessions would
    otherwise stack on top of. A no-op where there is no glibc.
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: madvise's "reclaim these pages now" (Linux 5.4): clean file pages are dropped (read again if
#: touched), a page that was written is kept or swapped out, never lost
_MADV_PAGEOUT = 21


class MappedFilePages:
    """Hands the pages of file-mapped memory back to the OS once their bytes have been copied out.

    A model loaded from safetensors views the mapped weights file; copying its tensors out would
    otherwise hold the copy and every page read of the mapping at once (twice the weights). The
    process's file mappings are read once, from ``/proc/self/maps``; memory outside them (heap
    tensors) is never touched. A no-op where the kernel or the C library cannot do it.
    """

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []
        self._page = 4096
        self._madvise: Any = None
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise
            self._page = os.sysconf("SC_PAGE_SIZE")
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split()
                    # a mapping of a file has an inode; the heap, stacks and anonymous memory have 0
                    if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        self._spans.append((start, end))
        except (OSError, AttributeError, ValueError):
            self._spans = []

    def release(self, address: int, size: int) -> bool:
        """Reclaim the whole pages of ``[address, address + size)`` if they lie in a file mapping
        (a page shared with bytes outside the range is left as it is); whether the kernel took it."""
        if self._madvise is None or size <= 0:
            return False
        first = -(-address // self._page) * self._page
        last = (address + size) // self._page * self._page
        if last > first and any(start <= first and last <= end for start, end in self._spans):
            return bool(self._madvise(first, last - first, _MADV_PAGEOUT) == 0)
        return False
