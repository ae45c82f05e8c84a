"""Write a decoder's cached ``Attention`` (opset 23) as ONNX Runtime's ``GroupQueryAttention``.

torch.onnx writes a decoder layer's attention as ``Concat(past, new)`` for the keys and the
values (the concatenations are the ``present`` outputs) and ONNX's ``Attention`` over them, its
query, keys and values in (batch, heads, sequence, head) layout, so each projection passes
through a Reshape and a Transpose and the output through the reverse. ONNX Runtime's contrib
``GroupQueryAttention`` takes the projections as they leave their MatMuls (batch, sequence,
hidden), appends the new keys and values to the past itself and returns the present: one kernel
in place of two Concats, four Transposes and the attention, the operator onnxruntime-genai's
builder writes for these models.

The rewrite keeps what a decoder computes. Its mask (causal and padding, as transformers built
it) becomes GroupQueryAttention's ``attention_bias`` (0 where attended, the dtype's lowest value
elsewhere); ``seqlens_k`` is the full length for every row and ``query_seqlens`` the chunk's
length (the padding is the bias's job, so a left-padded row is read as the model reads it, and a
batch may continue with several tokens over a past, which the kernel otherwise refuses). The
kernel's own causal triangle (which ``query_seqlens`` requires) then changes nothing, since a
decoder's mask already lets no query see a later key: the pass is for decoders, and the
exporter proves each file by decoding with it. A rotary
embedding on the way in is written on the three-dimensional projection (``RotaryEmbedding``
takes ``num_heads`` for that). Left as it is: an ``Attention`` whose keys and values are not a
cache concatenation, one without a mask or with ``is_causal`` (ONNX aligns that triangle to the
first key, the kernel to the last: they differ once there is a past), one that asks for what
GroupQueryAttention has not (its other outputs, a ``qk_matmul_output_mode``), and head sizes
that are not a multiple of 8, which ONNX Runtime's kernel refuses. The fused kernel adds in
another order, so the proof of the step is the decoder's outputs on the written file.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from .._core.ir import CONTRIB_DOMAIN, graphs, is_default, only_reader

_TO_HEADS = (0, 2, 1, 3)


def _static(dim) -> int | None:
    return dim if isinstance(dim, int) else None


def _cache_concat(value: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """``(past, new)`` when ``value`` is ``Concat(past, new)`` on the sequence axis of a rank-4
    cache whose past is a graph input."""
    concat = value.producer()
    if concat is None or concat.op_type != "Concat" or not is_default(concat) or len(concat.inputs) != 2:
        return None
    axis = concat.attributes.get_int("axis", 0)
    past, new = concat.inputs
    if past is None or new is None or axis not in (2, -2) or not past.is_graph_input():
        return None
    if past.shape is None or past.shape.rank() != 4:
        return None
    return past, new


def _transposed_from(value: ir.Value) -> ir.Value | None:
    """``x`` when ``value`` is ``Transpose(x, perm=(0, 2, 1, 3))`` (the Transpose stays for any
    other reader; once none is left, the pass's clean-up drops it)."""
    node = value.producer()
    if node is None or node.op_type != "Transpose" or not is_default(node):
        return None
    if tuple(node.attributes.get_ints("perm", ())) != _TO_HEADS:
        return None
    return node.inputs[0]


class GroupQueryAttentionPass(ir.passes.InPlacePass):
    """Rewrite every cached opset-23 ``Attention`` (see the module's text) as com.microsoft
    ``GroupQueryAttention``; ``rewritten`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.rewritten = 0

    def requires(self, model: ir.Model) -> None:
        if model.opset_imports.get("", 0) < 23:
            raise ir.passes.PreconditionError("ONNX's Attention is new in opset 23; the model imports an older opset.")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rewritten = 0
        for graph in graphs(model):
            shared: dict[int, tuple[ir.Value, ...]] = {}  # per mask: bias and lengths, made once
            for node in [n for n in graph if n.op_type == "Attention" and is_default(n)]:
                if self._rewrite(graph, node, shared):
                    self.rewritten += 1
        if self.rewritten:
            model.opset_imports.setdefault(CONTRIB_DOMAIN, 1)
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=self.rewritten > 0)

    def _rewrite(self, graph: ir.Graph, node: ir.Node, shared: dict) -> bool:
        inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
        query, key, value, mask = inputs[:4]
        if any(extra is not None for extra in inputs[4:]) or any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
            return False
        if node.attributes.get_int("qk_matmul_output_mode", 0) != 0 or query is None or query.shape is None:
            return False
        keys, values = _cache_concat(key), _cache_concat(value)
        if keys is None or values is None or query.shape.rank() != 4:
            return False
        heads, head_size = _static(query.shape[1]), _static(query.shape[3])
        kv_heads = _static(keys[0].shape[1])
        # ONNX Runtime's kernel takes head sizes in multiples of 8 only (it refuses others at run time)
        if heads is None or head_size is None or kv_heads is None or heads % kv_heads or head_size % 8:
            return False
        # ONNX's is_causal aligns the triangle to the first key, GroupQueryAttention's to the last:
        # they agree only without a past, so only an attention whose mask says it all is rewritten
        if node.attributes.get_int("is_causal", 0) or mask is None:
            return False
        if mask.shape is None or mask.shape.rank() != 4 or mask.dtype is None:
            return False
        dtype = query.dtype
        new: list[ir.Node] = []
        projections = [self._three_d(query, heads, new), self._three_d(keys[1], kv_heads, new),
                       self._three_d(values[1], kv_heads, new)]
        bias, seqlens, total, query_seqlens = self._lengths(mask, projections[0], dtype, new, shared)
        scale = node.attributes.get_float("scale", 1.0 / math.sqrt(head_size))
        gqa = ir.node(
            "GroupQueryAttention",
            inputs=[*projections, keys[0], values[0], seqlens, total, None, None, None, bias,
                    None, None, None, None, None, query_seqlens],
            attributes={"num_heads": heads, "kv_num_heads": kv_heads, "scale": scale,
                        "softcap": node.attributes.get_float("softcap", 0.0)},
            domain=CONTRIB_DOMAIN, num_outputs=3, name=f"{node.name}_gqa" if node.name else None,
        )
        new.append(gqa)
        output = gqa.outputs[0]
        output.dtype = dtype
        graph.insert_before(node, new)
        # the present outputs are GroupQueryAttention's now: readers, graph outputs and names move
        for old, present in ((key, gqa.outputs[1]), (value, gqa.outputs[2])):
            ir.convenience.replace_nodes_and_values(graph, gqa, [], [], [old], [present])
        merged = self._merged_heads(node.outputs[0])
        if merged is not None:
            ir.convenience.replace_nodes_and_values(graph, gqa, [], [], [merged], [output])
        else:
            shape = _constant(graph, gqa, [0, 0, heads, head_size])
            split = ir.node("Reshape", inputs=[output, shape])
            back = ir.node("Transpose", inputs=[split.outputs[0]], attributes={"perm": list(_TO_HEADS)})
            split.outputs[0].dtype = back.outputs[0].dtype = dtype
            graph.insert_after(gqa, [split, back])
            ir.convenience.replace_all_uses_with(node.outputs[0], back.outputs[0], replace_graph_outputs=True)
        return True

    @staticmethod
    def _merged_heads(attention_output: ir.Value) -> ir.Value | None:
        """The (batch, sequence, hidden) value the file makes of the attention's output by
        Transpose(0, 2, 1, 3) then Reshape, when that is all that reads it."""
        transpose = only_reader(attention_output, "Transpose", 0)
        if transpose is None or tuple(transpose.attributes.get_ints("perm", ())) != _TO_HEADS:
            return None
        reshape = only_reader(transpose.outputs[0], "Reshape", 0)
        if reshape is None:
            return None
        merged, target = reshape.outputs[0], reshape.inputs[1]
        rank = merged.shape.rank() if merged.shape is not None else None
        if rank is None and target is not None and target.shape is not None and target.shape.is_static():
            rank = target.shape[0] if target.shape.rank() == 1 else None  # type: ignore[assignment]  # is_static() holds
        return merged if rank == 3 else None

    @staticmethod
    def _three_d(value: ir.Value, heads: int, new: list[ir.Node]) -> ir.Value:
        """``value`` (batch, heads, sequence, head) as (batch, sequence, heads·head): a rotary
        embedding is moved onto the three-dimensional form, a Transpose dropped."""
        flat = _constant_value([0, 0, -1])
        rotary = value.producer()
        if rotary is not None and rotary.op_type == "RotaryEmbedding" and is_default(rotary):
            source = _transposed_from(rotary.inputs[0])
            if source is not None:
                reshape = ir.node("Reshape", inputs=[source, flat])
                attributes = {**{k: a.value for k, a in rotary.attributes.items()}, "num_heads": heads}
                moved = ir.node("RotaryEmbedding", inputs=[reshape.outputs[0], *rotary.inputs[1:]],
                                attributes=attributes)
                new.extend([_producer(flat), reshape, moved])
                return moved.outputs[0]
        source = _transposed_from(value)
        if source is None:
            transpose = ir.node("Transpose", inputs=[value], attributes={"perm": list(_TO_HEADS)})
            new.append(transpose)
            source = transpose.outputs[0]
        reshape = ir.node("Reshape", inputs=[source, flat])
        new.extend([_producer(flat), reshape])
        return reshape.outputs[0]

    @staticmethod
    def _lengths(mask: ir.Value, query: ir.Value, dtype: ir.DataType | None, new: list[ir.Node], shared: dict):
        """The bias, ``seqlens_k``, ``total_sequence_length`` and ``query_seqlens`` of one mask,
        made once for the layers that read it: the total from the mask's last axis, the batch and
        the chunk's length from the first layer's (batch, sequence, hidden) query, which every
        layer shares."""
        if id(mask) in shared:
            return shared[id(mask)]
        if mask.dtype == ir.DataType.BOOL:
            lowest = np.finfo(dtype.numpy()).min
            zero = _constant_value(np.array(0, dtype.numpy()))
            low = _constant_value(np.array(lowest, dtype.numpy()))
            where = ir.node("Where", inputs=[mask, zero, low])
            new.extend([_producer(zero), _producer(low), where])
            bias = where.outputs[0]
        else:
            bias = mask
        batch = ir.node("Shape", inputs=[query], attributes={"start": 0, "end": 1})
        chunk = ir.node("Shape", inputs=[query], attributes={"start": 1, "end": 2})
        length = ir.node("Shape", inputs=[mask], attributes={"start": 3, "end": 4})
        chunk32 = ir.node("Cast", inputs=[chunk.outputs[0]], attributes={"to": ir.DataType.INT32})
        chunks = ir.node("Expand", inputs=[chunk32.outputs[0], batch.outputs[0]])
        new.extend([batch, chunk, length, chunk32, chunks])
        seqlens, total = _lengths_from(length.outputs[0], batch.outputs[0], new)
        shared[id(mask)] = (bias, seqlens, total, chunks.outputs[0])
        return shared[id(mask)]


def _lengths_from(length: ir.Value, batch: ir.Value, new: list[ir.Node]) -> tuple[ir.Value, ir.Value]:
    """``seqlens_k`` (every row the full length, minus one) and the scalar total, as int32."""
    cast = ir.node("Cast", inputs=[length], attributes={"to": ir.DataType.INT32})
    axes = _constant_value(np.array([0], np.int64))
    total = ir.node("Squeeze", inputs=[cast.outputs[0], axes])
    one = _constant_value(np.array([1], np.int32))
    minus = ir.node("Sub", inputs=[cast.outputs[0], one])
    seqlens = ir.node("Expand", inputs=[minus.outputs[0], batch])
    new.extend([cast, _producer(axes), total, _producer(one), minus, seqlens])
    return seqlens.outputs[0], total.outputs[0]


def _constant_value(array) -> ir.Value:
    array = np.asarray(array, np.int64) if isinstance(array, list) else array
    return ir.node("Constant", inputs=[], attributes={"value": ir.tensor(array)}).outputs[0]


def _producer(value: ir.Value) -> ir.Node:
    return value.producer()


def _constant(graph: ir.Graph, after: ir.Node, values: list[int]) -> ir.Value:
    value = _constant_value(values)
    graph.insert_before(after, [_producer(value)])
    return value
