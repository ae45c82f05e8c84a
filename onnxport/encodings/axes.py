"""What only the graph can settle for legacy files: per-channel axes and per-block layouts.

0.6.1 and 1.0.0 do not store a channel axis. It is taken from the tensor's shape when exactly one
dimension matches the number of scales, else from the operator that consumes the tensor as a
weight (Conv 0, ConvTranspose 1, Gemm by ``transB``, MatMul the last axis). No AIMET needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ..errors import InvalidArgumentError
from .formats import Encoding, ScaleMeta, effective_scale_problem


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what is known of it."""

    name: str
    value: ir.Value
    graph: ir.Graph  # the graph that defines it (main or a body)
    is_constant: bool
    dims: tuple[int, ...] | None  # None when the shape is not known
    elem_type: int | None


def consumer_axes(name: str, readers: list[tuple[ir.Node, int]], rank: int | None) -> tuple[int, int] | None:
    """(channel axis, block axis) of a weight from the operator reading it, or None."""
    for node, index in readers:
        if node.op_type == "Conv" and index == 1:
            return 0, 1
        if node.op_type == "ConvTranspose" and index == 1:
            return 1, 0
        if node.op_type == "Gemm" and index == 1:
            trans_b = node.attributes.get_int("transB", 0)
            return (0, 1) if trans_b else (1, 0)
        if node.op_type == "MatMul" and index == 1 and rank:
            return rank - 1, rank - 2
        if node.op_type in ("Conv", "ConvTranspose", "Gemm") and index == 2:
            return 0, 0
    return None


def _fail(entry: Encoding, info: TensorInfo, why: str) -> InvalidArgumentError:
    shape = "unknown" if info.dims is None else f"{tuple(info.dims)}"
    return InvalidArgumentError(f"Encoding of '{entry.name}' (shape {shape}): {why}")


def resolve(
    entry: Encoding, info: TensorInfo, readers: list[tuple[ir.Node, int]], *, allow_subnormal: bool = False
) -> Encoding:
    """Settle ``entry``'s axis/block layout against the tensor, or raise naming tensor, shape and axis.

    ``allow_subnormal`` lets a legacy LPBQ scale (only known once its blocks are laid out) be
    subnormal in float32, as ``parse_encodings`` allows for the others."""
    dims = info.dims
    rank = len(dims) if dims is not None else None
    if entry.pending == "axis":
        n = entry.n_scales
        matches = [i for i, d in enumerate(dims or ()) if d == n]
        if len(matches) == 1:
            return entry.with_(axis=matches[0], pending=None)
        found = consumer_axes(entry.name, readers, rank)
        if found is not None and dims is not None and dims[found[0]] == n:
            return entry.with_(axis=found[0], pending=None)
        raise _fail(entry, info, f"holds {n} per-channel scales, and no single axis of the tensor (nor of the "
                                 f"operator reading it) has {n} channels. Export the encodings as version 2.0.0, "
                                 f"which states the axis.")
    if entry.pending == "blocks":
        return _resolve_blocks(entry, info, readers, allow_subnormal)
    if entry.axis is not None and rank is not None:
        axis = entry.axis % rank if -rank <= entry.axis < rank else None
        if axis is None:
            raise _fail(entry, info, f"axis {entry.axis} is outside the tensor's {rank} dimensions.")
        entry = entry.with_(axis=axis)
        per_channel = entry.scale if entry.scale is not None else entry.meta.x
        if entry.block_size is None and per_channel.ndim == 1 and dims[axis] != per_channel.size:
                raise _fail(entry, info, f"axis {axis} has {dims[axis]} channels but the encoding holds "
                                         f"{per_channel.size} scales (field 'axis').")
        if entry.block_size is not None:
            entry = _fit_block_grid(entry, info)
    return entry


def _grid_shape(dims: tuple[int, ...], axis: int, block: int) -> tuple[int, ...]:
    return tuple(-(-d // block) if i == axis else d for i, d in enumerate(dims))


def _fit_block_grid(entry: Encoding, info: TensorInfo) -> Encoding:
    """Blockwise scales must have the tensor's rank; singleton axes (kernel dims) are repeated."""
    dims = info.dims
    if dims[entry.axis] % entry.block_size:
        raise _fail(entry, info, f"block_size {entry.block_size} does not divide axis {entry.axis} ({dims[entry.axis]}).")
    want = _grid_shape(dims, entry.axis, entry.block_size)

    def fit(array: np.ndarray | None, what: str) -> np.ndarray | None:
        if array is None:
            return None
        if array.ndim != len(dims):
            raise _fail(entry, info, f"blockwise '{what}' has rank {array.ndim}, the tensor {len(dims)}.")
        for i, (got, need) in enumerate(zip(array.shape, want)):
            if got != need and got != 1:
                raise _fail(entry, info, f"blockwise '{what}' has shape {array.shape}; expected {want}.")
        return array if array.shape == want else np.broadcast_to(array, want).copy()

    if entry.meta is not None:
        meta = entry.meta
        return entry.with_(meta=ScaleMeta(fit(meta.x, "x"), meta.x_scale, meta.x_zero_point, meta.x_dtype,
                                          meta.axis if meta.axis is None else meta.axis % len(dims), meta.block_size),
                           zero_point=fit(entry.zero_point, "y_zero_point"))
    return entry.with_(scale=fit(entry.scale, "y_scale"), zero_point=fit(entry.zero_point, "y_zero_point"))


def _resolve_blocks(
    entry: Encoding, info: TensorInfo, readers: list[tuple[ir.Node, int]], allow_subnormal: bool
) -> Encoding:
    dims = info.dims
    found = consumer_axes(entry.name, readers, len(dims) if dims else None) if info.is_constant and dims else None
    if found is None or found[0] == found[1]:
        raise _fail(entry, info, "a legacy per-block encoding needs a weight read by a Conv, ConvTranspose, Gemm "
                                 "or MatMul to place its blocks; export as version 2.0.0, which states the block axis.")
    channel, block_axis = found
    if dims[block_axis] % entry.block_size:
        raise _fail(entry, info, f"block_size {entry.block_size} does not divide axis {block_axis} ({dims[block_axis]}).")
    n_blocks = dims[block_axis] // entry.block_size
    n_channels = dims[channel]

    def layout(flat: np.ndarray, what: str) -> np.ndarray:
        if flat.size != n_channels * n_blocks:
            raise _fail(entry, info, f"'{what}' holds {flat.size} values; {n_channels} channels x {n_blocks} blocks expected.")
        # The exporter writes (channel, block) order; for a weight whose channel axis comes after
        # its block axis (Gemm without transB, MatMul) that is the transpose of the tensor's order.
        # ConvTranspose is written in the tensor's own order.
        writer_transposed = channel > block_axis and not any(n.op_type == "ConvTranspose" for n, _ in readers)
        if writer_transposed or channel < block_axis:
            grid2 = flat.reshape(n_channels, n_blocks)
            if channel > block_axis:
                grid2 = grid2.T
        else:
            grid2 = flat.reshape(n_blocks, n_channels)
        view = [1] * len(dims)
        view[channel], view[block_axis] = n_channels, n_blocks
        grid = grid2.reshape(view)
        return np.broadcast_to(grid, _grid_shape(dims, block_axis, entry.block_size)).copy()

    zero_point = entry.zero_point
    if "int_scale" in entry.flat:
        ints = layout(entry.flat["int_scale"], "per_block_int_scale")
        meta = ScaleMeta(ints, entry.flat["channel_scale"], None, None, channel, None)
        problem = effective_scale_problem(meta, allow_subnormal)
        if problem:
            raise _fail(entry, info, f"field 'per_block_int_scale': {problem}.")
        if zero_point is not None:
            zero_point = layout(zero_point, "offset")
        return entry.with_(meta=meta, zero_point=zero_point, axis=block_axis, pending=None, flat={})
    scale = layout(entry.flat["scale"], "scale")
    zp = layout(entry.flat["zero_point"], "offset")
    return entry.with_(scale=scale, zero_point=zp if np.any(zp) else None, axis=block_axis, pending=None, flat={})
