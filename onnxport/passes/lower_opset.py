"""Lower a model to an older default-domain opset, where that is an exact relabelling.

``torch.onnx.export(dynamo=True)`` writes opset 18 at the least. Between 17 and 18 the Reduce
family moved ``axes`` from an attribute to an input, and a few operators gained options. This
pass moves constant ``axes`` back to the attribute, writes a Split's ``num_outputs`` as explicit
sizes when the split dimension is known, accepts the other operators when they use none of the
newer options, writes a Col2Im that places non-overlapping blocks (``torch.nn.functional.fold``
with ``stride == kernel_size``, as MobileViT's patch folding) as the Reshape, Transpose, Reshape
it is (and a Pad for a margin no block reaches), and refuses anything else with a message naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.defs
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from .._core.ir import const_array, drop_unread_constants, is_default, taken_names, unique_name
from ..errors import ExportRefusedError

_REDUCE_OPS = {
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
    "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
}


def _attr(node: ir.Node, name: str):
    attr = node.attributes.get(name)
    return None if attr is None else attr.value


def _describe(node: ir.Node) -> str:
    return f"{node.op_type} node '{node.name or node.outputs[0].name}'"


def _older_schema(op: str, target: int):
    try:
        return onnx.defs.get_schema(op, target, "")
    except onnx.defs.SchemaError:
        return None


class LowerOpsetPass(ir.passes.InPlacePass):
    """Relabel the model (every body and function included) as default-domain opset ``target``.

    A model already at ``target`` or older is left alone (``modified`` False). Raises
    :class:`ExportRefusedError`, naming the node, when some operator cannot be expressed at
    ``target`` exactly. The result still needs its proof (``onnx.checker`` and an identical
    run): this pass only rewrites.
    """

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target

    def ensures(self, model: ir.Model) -> None:
        declared = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        if declared is not None and declared > self.target:
            raise ir.passes.PostconditionError(f"the model still declares opset {declared}, above {self.target}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.current = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        if self.current is None or self.target >= self.current:
            return ir.passes.PassResult(model, False)
        self.model = model
        self.taken = taken_names(model)
        self.inferred = False
        self.unread: list[ir.Value] = []
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            self.lower_node(node, in_function=False)
        for function in model.functions.values():
            for node in list(ir.traversal.RecursiveGraphIterator(function)):
                self.lower_node(node, in_function=True)
            if "" in function.opset_imports:
                function.opset_imports[""] = self.target
        drop_unread_constants(self.unread)
        model.opset_imports.pop("ai.onnx", None)
        model.opset_imports[""] = self.target
        return ir.passes.PassResult(model, True)

    def refuse(self, node: ir.Node, why: str) -> ExportRefusedError:
        return ExportRefusedError(
            f"Cannot lower the graph from opset {self.current} to opset {self.target}: the "
            f"{_describe(node)} {why}. Ask for opset {self.current} or later instead."
        )

    def reduce(self, node: ir.Node) -> None:
        noop = _attr(node, "noop_with_empty_axes") or 0
        if len(node.inputs) >= 2 and node.inputs[1] is not None:
            axes_value = node.inputs[1]
            values = const_array(axes_value)
            if values is None:
                raise self.refuse(node, f"takes its axes from '{axes_value.name}', which is computed while the graph runs")
            axes = [int(a) for a in values.reshape(-1)]
            if not axes and noop:
                raise self.refuse(node, "reduces over an empty axes list with noop_with_empty_axes=1")
            node.resize_inputs(1)
            self.unread.append(axes_value)
            if axes:
                node.attributes["axes"] = ir.AttrInt64s("axes", axes)
        elif len(node.inputs) >= 2:
            node.resize_inputs(1)
        if noop and "axes" not in node.attributes:
            raise self.refuse(node, "reduces nothing (noop_with_empty_axes=1), which the older opset cannot say")
        node.attributes.pop("noop_with_empty_axes", None)

    def split_length(self, node: ir.Node, axis: int) -> int | None:
        """The size of the split dimension, from the graph's shapes (inferred once if missing)."""
        for attempt in range(2):
            shape = node.inputs[0].shape
            if shape is not None and -len(shape) <= axis < len(shape) and isinstance(shape[axis], int):
                return int(shape[axis])
            if attempt or self.inferred:
                return None
            self.inferred = True
            ShapeInferencePass()(self.model)
        return None

    def split(self, node: ir.Node, in_function: bool) -> None:
        """``num_outputs`` (opset 18) back to explicit sizes, when the split dimension is known."""
        parts = _attr(node, "num_outputs")
        if parts is None:
            return
        length = self.split_length(node, _attr(node, "axis") or 0)
        if length is None:
            raise self.refuse(node, "splits into num_outputs chunks along a dimension whose size is only known "
                                    "while the graph runs, which the older opset cannot say")
        chunk = -(-length // parts)  # opset 18: equal chunks, the last one smaller
        sizes = [chunk] * (parts - 1) + [length - chunk * (parts - 1)]
        if sizes[-1] <= 0:
            raise self.refuse(node, f"splits {length} elements into {parts} chunks, leaving an empty one")
        value = self.int64s(node, "split_sizes", sizes, in_function)
        node.resize_inputs(1)
        node.resize_inputs(2)
        node.replace_input_with(1, value)
        node.attributes.pop("num_outputs")

    def int64s(self, node: ir.Node, stem: str, values: list[int], in_function: bool) -> ir.Value:
        """A new constant int64 vector for ``node`` to read, named after it."""
        name = unique_name(f"{node.name or node.outputs[0].name}_{stem}", self.taken)
        tensor = ir.tensor(np.array(values, np.int64), name=name)
        if in_function:  # a function has no initializers
            constant = ir.node("Constant", [], {"value": tensor}, outputs=[ir.Value(name=name)])
            node.graph.insert_before(node, constant)
            return constant.outputs[0]
        value = ir.Value(name=name, const_value=tensor, shape=ir.Shape([len(values)]),
                         type=ir.TensorType(ir.DataType.INT64))
        node.graph.register_initializer(value)
        return value

    def col2im(self, node: ir.Node, in_function: bool) -> None:
        """Non-overlapping blocks back in place: Col2Im as Reshape, Transpose, Reshape.

        With ``strides == block_shape``, no padding and no dilation, every output pixel comes from
        at most one column entry, so the op only moves data: column ``c·∏k + offset`` at block
        position ``b`` is pixel ``(c, b·k + offset)``. When the blocks do not reach the image's
        end (MobileViTV2 folds 2×2 blocks into a 7×7 map: 3 blocks cover 6 pixels) the margin is
        Col2Im's empty sum, zeros, written as a Pad. Overlapping blocks are sums, which this
        lowering does not write.
        """
        inputs = [*node.inputs, None, None]
        image_array, block_array = const_array(inputs[1]), const_array(inputs[2])
        if image_array is None or block_array is None:
            raise self.refuse(node, "takes its image or block shape from a tensor computed while the graph runs, "
                                    "which the older opset cannot say")
        image, block = [int(v) for v in image_array.reshape(-1)], [int(v) for v in block_array.reshape(-1)]
        rank = len(block)
        strides = list(_attr(node, "strides") or [1] * rank)
        pads = list(_attr(node, "pads") or [0] * 2 * rank)
        dilations = list(_attr(node, "dilations") or [1] * rank)
        if strides != block or any(pads) or any(d != 1 for d in dilations) or any(i < b for i, b in zip(image, block)):
            raise self.refuse(node, f"folds blocks {block} with strides {strides}, pads {pads} and dilations "
                                    f"{dilations} into {image}; the lowering writes only non-overlapping, unpadded "
                                    "blocks (strides equal to the block shape)")
        counts = [i // b for i, b in zip(image, block)]
        tiled = [n * b for n, b in zip(counts, block)]
        # [N, C·∏k, ∏n] → [N, C, k…, n…] → [N, C, n1, k1, n2, k2, …] → [N, C, image…]; 0 keeps N
        first = ir.node("Reshape", [node.inputs[0], self.int64s(node, "blocks", [0, -1, *block, *counts], in_function)])
        perm = [0, 1] + [axis for pair in zip(range(2 + rank, 2 + 2 * rank), range(2, 2 + rank)) for axis in pair]
        moved = ir.node("Transpose", [first.outputs[0]], {"perm": perm})
        last = ir.node("Reshape", [moved.outputs[0], self.int64s(node, "image", [0, -1, *tiled], in_function)])
        added = [first, moved, last]
        if tiled != image:  # the pixels no block reaches: zeros after the last block, per axis
            margin = [0] * (2 + rank) + [0, 0] + [i - t for i, t in zip(image, tiled)]
            added.append(ir.node("Pad", [last.outputs[0], self.int64s(node, "margin", margin, in_function)],
                                 {"mode": "constant"}))
        for new in added:
            new.name = unique_name(f"{node.name or node.outputs[0].name}_{new.op_type.lower()}", self.taken)
        self.unread.extend(v for v in node.inputs[1:] if v is not None)
        ir.convenience.replace_nodes_and_values(node.graph, node, [node], added,
                                                [node.outputs[0]], [added[-1].outputs[0]])

    def lower_node(self, node: ir.Node, in_function: bool) -> None:
        if not is_default(node):
            return
        schema = onnx.defs.get_schema(node.op_type, self.current, "")
        if schema.since_version <= self.target:
            return
        op = node.op_type
        if op == "Col2Im":
            self.col2im(node, in_function)
            return
        older = _older_schema(op, self.target)
        if older is None:
            raise self.refuse(node, f"has no definition before opset {schema.since_version}")
        if op in _REDUCE_OPS and older.since_version >= 11:
            self.reduce(node)
        elif op == "Pad" and older.since_version >= 11 and len(node.inputs) <= 3:
            pass  # opset 18 only added the optional `axes` input
        elif op == "Resize" and older.since_version >= 13 and not any(
            _attr(node, a) for a in ("antialias", "axes")
        ) and _attr(node, "keep_aspect_ratio_policy") in (None, "stretch"):
            node.attributes.pop("keep_aspect_ratio_policy", None)
            node.attributes.pop("antialias", None)
        elif op == "Split" and older.since_version >= 13:
            self.split(node, in_function)
        elif op in ("ScatterElements", "ScatterND") and older.since_version >= 16 and _attr(
            node, "reduction"
        ) not in ("max", "min"):
            pass
        elif op == "LpPool" and older.since_version >= 11 and not _attr(node, "ceil_mode"):
            node.attributes.pop("ceil_mode", None)
        else:
            raise self.refuse(
                node, f"uses a form introduced in opset {schema.since_version} that the lowering does not rewrite"
            )
