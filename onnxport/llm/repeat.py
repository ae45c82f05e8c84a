"""Capture a decoder's stack of identical layers once and repeat it in the graph.

torch.export's symbolic trace, and the decompositions that trace it a second time, cost seconds per
layer (a 16-layer, 270M-parameter Llama: 85 of its 119 export seconds, growing with the layers
while everything else barely does). Where every layer is the same module with its own weights, the
exporter captures the model with its first two layers only, checks in the graph that the second
layer is the first one again (same operators, same attributes, reading the same shared values,
its own weights and cache), writes that layer once more for every further layer with that
layer's own weights, and only then runs torch.onnx's optimizer on the whole graph, as torch.onnx
would have on a full capture. The decoding proof on the written file is unchanged: it holds the
file to the whole model, every layer included.

Where anything differs between layers — a module's class or settings (a sliding window, a layer
without rotary), a parameter's shape, a per-layer list in the config, or the graph of the first two
layers — the model is captured whole, as before.
"""

from __future__ import annotations

import ast
import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

#: the layers a template capture keeps: two, so that the graph shows the second layer reading the
#: first one's output exactly as every later layer reads its predecessor's
TEMPLATE_LAYERS = 2
_SCOPES = "pkg.torch.onnx.name_scopes"
_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class LayerStack:
    """A model's list of decoder layers: where it sits (``prefix``, the weights' name prefix) and
    the config attribute that counts them."""

    prefix: str
    count: int
    config: Any
    count_attribute: str


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _signature(layer: torch.nn.Module) -> list[tuple[Any, ...]]:
    """What must be equal between two layers for one's graph to be the other's with other weights:
    every submodule's class and plain settings, every tensor's name, shape, dtype and kind."""
    found: list[tuple[Any, ...]] = []
    for name, module in layer.named_modules():
        settings = tuple(
            sorted((key, value) for key, value in vars(module).items() if not key.startswith("_") and _plain(value))
        )
        found.append(("module", name, type(module).__qualname__, settings))
    for name, tensor in [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]:
        found.append(("tensor", name, tuple(tensor.shape), str(tensor.dtype), type(tensor).__name__))
    return found


def _alike(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]], index: int) -> bool:
    """Layer 1's signature ``a`` and layer ``index``'s ``b``: equal, but for settings that hold each
    layer's own index (``layer_idx``)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x[0] != "module" or x == y:
            if x != y:
                return False
            continue
        if x[:3] != y[:3] or [k for k, _ in x[3]] != [k for k, _ in y[3]]:
            return False
        for (_, u), (_, v) in zip(x[3], y[3]):
            if u != v and not (type(u) is int and type(v) is int and (u, v) == (1, index)):
                return False
    return True


def layer_stack(model: torch.nn.Module, layers: int) -> LayerStack | str:
    """The model's stack of ``layers`` identical decoder layers, or why it has none to repeat."""
    if layers <= TEMPLATE_LAYERS:
        return f"{layers} layers: nothing to repeat"
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers
    ]
    # the outermost: a layer's own list (of experts) may be as long as the stack
    lists = [
        (name, module)
        for name, module in lists
        if not any(name.startswith(other + ".") for other, _ in lists if other != name)
    ]
    if len(lists) != 1:
        return f"{len(lists)} lists of {layers} modules (one list of decoder layers is repeated)"
    prefix, stack = lists[0]
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    attribute = next((a for a in ("num_hidden_layers", "n_layer") if getattr(text, a, None) == layers), None)
    if text is None or attribute is None:
        return "the config does not count the layers as num_hidden_layers"
    for key, value in vars(text).items():
        # a per-layer list (layer types, layers without rotary or without experts, ...)
        if isinstance(value, (list, tuple)) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return f"the config's {key} differs between layers"
    first = _signature(stack[1])
    for index, layer in enumerate(stack):
        if index != 1 and not _alike(first, _signature(layer), index):
            return f"layer {index} differs from layer 1 (its modules, settings or tensors)"
    return LayerStack(prefix, layers, text, attribute)


@contextlib.contextmanager
def first_layers(model: torch.nn.Module, stack: LayerStack) -> Iterator[None]:
    """``model`` with its first :data:`TEMPLATE_LAYERS` layers only, for as long as the block runs
    (the layers are the model's own: their weights keep their names); left as it was."""
    parent_name, _, leaf = stack.prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    full = getattr(parent, leaf)
    setattr(parent, leaf, torch.nn.ModuleList(list(full)[:TEMPLATE_LAYERS]))
    setattr(stack.config, stack.count_attribute, TEMPLATE_LAYERS)
    try:
        yield
    finally:
        setattr(parent, leaf, full)
        setattr(stack.config, stack.count_attribute, stack.count)


def _layer_of(node: ir.Node, prefix: str) -> int | None:
    scopes = node.metadata_props.get(_SCOPES)
    if not scopes:
        return None
    try:
        names = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return None
    for name in names:
        head, _, rest = str(name).partition(prefix + ".")
        if head == "" and rest and rest.split(".")[0].isdigit():
            return int(rest.split(".")[0])
    return None


def _attributes_equal(a: ir.Node, b: ir.Node) -> bool:
    if set(a.attributes) != set(b.attributes):
        return False
    for key, attr in a.attributes.items():
        other = b.attributes[key]
        if attr.type != other.type:
            return False
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return False  # a layer holding a subgraph is captured whole
        if attr.type == ir.AttributeType.TENSOR:
            if not np.array_equal(attr.value.numpy(), other.value.numpy()):
                return False
        elif attr.value != other.value:
            return False
    return True


class _Template:
    """The graph of a two-layer capture, split into each layer's nodes (the nodes of its scope and
    the ones outside it that read only its own cache or weights) and checked to repeat."""

    def __init__(self, graph: ir.Graph, prefix: str, inputs: list[list[str]], outputs: list[list[str]]) -> None:
        self.graph, self.prefix = graph, prefix
        self.layer_inputs = [[_graph_input(graph, n) for n in names] for names in inputs]
        self.layer_outputs = outputs
        nodes = list(graph)
        # torch.onnx writes a constant once and reads it wherever the same value is needed again
        # (a norm's epsilon), and torch.export computes a size once (batch times sequence) where
        # the first layer needs it and lets later layers read it: constants and sizes belong to no
        # layer (a layer's copy reads the same one, as equal in every layer)
        sizes = _sizes(nodes, prefix)
        scope = {node: None if node in sizes else _layer_of(node, prefix) for node in nodes}
        own: dict[ir.Value, int] = {}
        for layer, values in enumerate(self.layer_inputs):
            own.update({v: layer for v in values if v is not None})
        for name, value in graph.initializers.items():
            layer = _initializer_layer(name, prefix)
            if layer is not None:
                own[value] = layer
        # outside the layers' scopes: a node is a layer's when it reads that layer's cache or
        # weights and nothing of another layer nor any layer's output, and only that layer reads it
        tags: dict[ir.Value, frozenset[int] | None] = {}
        candidates: dict[int, set[ir.Node]] = {0: set(), 1: set()}
        for node in nodes:
            if scope[node] is not None:
                for out in node.outputs:
                    tags[out] = None  # after a layer
                continue
            if node in sizes:
                continue  # shared by every layer
            found: set[int] = set()
            after = False
            for value in node.inputs:
                if value is None:
                    continue
                if value in own:
                    found.add(own[value])
                tag = tags.get(value, frozenset())
                if tag is None:
                    after = True
                else:
                    found |= tag
            for out in node.outputs:
                tags[out] = None if after else frozenset(found)
            if not after and len(found) == 1:
                (layer,) = found
                if layer in candidates:
                    candidates[layer].add(node)
        graph_outputs = set(graph.outputs)
        for layer, chosen in candidates.items():
            changed = True
            while changed:
                changed = False
                members = chosen | {n for n in nodes if scope[n] == layer}
                for node in list(chosen):
                    if any(
                        v in graph_outputs or any(use.node not in members for use in v.uses()) for v in node.outputs
                    ):
                        chosen.discard(node)
                        changed = True
        self.layers = [[n for n in nodes if scope[n] == layer or n in candidates[layer]] for layer in (0, 1)]
        self.others = [n for n in nodes if scope[n] is None and n not in candidates[0] and n not in candidates[1]]
        #: each layer node's layer and place in its layer
        self.place = {
            node: (layer, index) for layer, members in enumerate(self.layers) for index, node in enumerate(members)
        }

    def layer_of_value(self, value: ir.Value) -> int | None:
        producer = value.producer()
        return self.place[producer][0] if producer in self.place else None

    def mismatch(self) -> str | None:
        """Why layer 1's graph is not layer 0's with its own weights and cache (``None``: it is)."""
        first, second = self.layers
        if not second or len(first) != len(second):
            return f"the first two layers captured {len(first)} and {len(second)} nodes"
        for index, (a, b) in enumerate(zip(first, second)):
            if (
                (a.domain, a.op_type, a.overload) != (b.domain, b.op_type, b.overload)
                or len(a.inputs) != len(b.inputs)
                or len(a.outputs) != len(b.outputs)
                or not _attributes_equal(a, b)
            ):
                return f"node {index} of the first two layers differs ({a.op_type} and {b.op_type})"
            for x, y in zip(a.inputs, b.inputs):
                reason = self._pair(x, y)
                if reason:
                    return f"{a.op_type} node {index} of the first two layers: {reason}"
        for layer, members in enumerate(self.layers):
            produced = {out for node in members for out in node.outputs}
            for value in self.graph.outputs:
                if (value in produced) != (value.name in self.layer_outputs[layer]):
                    return f"the graph output '{value.name}' is not layer {layer}'s own"
            for node in self.others:
                if layer == 0 and any(v in produced for v in node.inputs):
                    return f"'{node.name}' outside the layers reads layer {layer}'s values"
        return None

    def _pair(self, x: ir.Value | None, y: ir.Value | None) -> str | None:
        if x is None or y is None:
            return None if x is y else "an input is missing in one layer"
        lx, ly = self.layer_of_value(x), self.layer_of_value(y)
        if lx == 0:
            if ly != 1 or self.place[x.producer()][1] != self.place[y.producer()][1] or x.index() != y.index():
                return "its inputs are produced in different places"
            return None
        if ly == 0:
            return None  # the stream from the layer before: layer 0 reads it from outside the layers
        if ly == 1:
            return "layer 1 reads its own value where layer 0 reads another"
        for role, (p, q) in enumerate(zip(*self.layer_inputs)):
            if (x is p) != (y is q):
                return f"the cache input {role} is read in one layer only"
            if x is p:
                return None
        a, b = _initializer_layer(x.name or "", self.prefix), _initializer_layer(y.name or "", self.prefix)
        if x.is_initializer() and y.is_initializer() and (a is not None or b is not None):
            if (a, b) != (0, 1) or _rest(x.name or "", self.prefix) != _rest(y.name or "", self.prefix):
                return f"it reads the weights '{x.name}' and '{y.name}'"
            return None
        return None if self._equivalent(x, y, 0) else f"it reads '{x.name}' and '{y.name}'"

    def _equivalent(self, x: ir.Value, y: ir.Value, depth: int) -> bool:
        """Whether shared values ``x`` (read by layer 0) and ``y`` (by layer 1) are equal in every
        run: the same value, equal constants, or the same operator on equivalent values (a size
        read from each layer's own cache)."""
        if x is y:
            return True
        for p, q in zip(*self.layer_inputs):
            if x is p or y is q:
                return x is p and y is q
        wx, wy = _initializer_layer(x.name or "", self.prefix), _initializer_layer(y.name or "", self.prefix)
        if x.is_initializer() and y.is_initializer() and (wx is not None or wy is not None):  # each layer's weight
            return (wx, wy) == (0, 1) and _rest(x.name or "", self.prefix) == _rest(y.name or "", self.prefix)
        lx, ly = self.layer_of_value(x), self.layer_of_value(y)
        if lx is not None or ly is not None:  # a layer's own value: the same place in each layer
            return (
                (lx, ly) == (0, 1)
                and self.place[x.producer()][1] == self.place[y.producer()][1]
                and x.index() == y.index()
            )
        first, second = _constant_value(x), _constant_value(y)
        if first is not None or second is not None:
            return (
                first is not None
                and second is not None
                and first.dtype == second.dtype
                and first.shape == second.shape
                and np.array_equal(first, second)
            )
        a, b = x.producer(), y.producer()
        if a is None or b is None or depth > 32 or x.index() != y.index():
            return False
        if (a.domain, a.op_type, a.overload, len(a.inputs)) != (
            b.domain,
            b.op_type,
            b.overload,
            len(b.inputs),
        ) or not _attributes_equal(a, b):
            return False
        return all(
            (u is None and v is None) or (u is not None and v is not None and self._equivalent(u, v, depth + 1))
            for u, v in zip(a.inputs, b.inputs)
        )


def _tensor_like(template: Any, tensor: torch.Tensor, name: str) -> ir.TensorProtocol:
    """``tensor`` as the graph holds the template's weight: torch.onnx's own lazy tensor type where
    it is one (the weight stays in torch until the file is written, bfloat16 included)."""
    if isinstance(template, ir.Tensor) and type(template) is not ir.Tensor:
        return type(template)(tensor, name=name)  # torch.onnx's TorchTensor(tensor, name)
    return ir.Tensor(tensor, dtype=template.dtype, name=name)


def _sizes(nodes: list[ir.Node], prefix: str) -> set[ir.Node]:
    """The nodes that compute constants and sizes: no tensor's contents reach them but through
    ``Shape``/``Size`` of a tensor no layer computes (an input's, a layer's cache included), or a
    shared initializer (not a layer's weight)."""
    found: set[ir.Node] = set()
    sized: set[ir.Value] = set()
    for node in nodes:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            continue
        if node.domain == "" and node.op_type in ("Shape", "Size"):
            producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
            shared = producer is None or producer in found or _layer_of(producer, prefix) is None
        else:
            shared = all(
                v is None or v in sized or (v.is_initializer() and _initializer_layer(v.name or "", prefix) is None)
                for v in node.inputs
            )
        if shared:
            found.add(node)
            sized.update(node.outputs)
    return found


_SYMBOL = re.compile(r"[A-Za-z_]\w*")
#: the functions torch writes in a symbolic size
_SIZE_FUNCTIONS = {"Max", "Min", "floor", "ceiling", "FloorDiv", "CeilToInt", "Mod", "PythonMod", "sympy"}


def _own_sizes(shape: ir.Shape | None, shared: set[str], layer: int) -> ir.Shape | None:
    """``shape`` for a copy in ``layer``: a size named by a symbol the inputs do not name is
    renamed for the layer (ONNX Runtime plans memory by these names: two layers' expert sizes
    must not be taken for one)."""
    if shape is None:
        return None
    dims: list[Any] = []
    for dim in shape.dims:
        symbols = (
            set(_SYMBOL.findall(dim.value)) - _SIZE_FUNCTIONS
            if isinstance(dim, ir.SymbolicDim) and dim.value
            else set()
        )
        dims.append(f"{dim.value}_layer{layer}" if symbols - shared else dim)
    return ir.Shape(dims)


def _constant_value(value: ir.Value) -> np.ndarray | None:
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _graph_input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def _initializer_layer(name: str, prefix: str) -> int | None:
    head, _, rest = name.partition(prefix + ".")
    if head or not rest:
        return None
    first = rest.split(".")[0]
    return int(first) if first.isdigit() else None


def _rest(name: str, prefix: str) -> str:
    return name.partition(prefix + ".")[2].partition(".")[2]


def repeat_layers(
    model: ir.Model,
    stack: LayerStack,
    inputs_of: Callable[[int, int], list[str]],
    outputs_of: Callable[[int, int], list[str]],
    input_names: list[str],
    output_names: list[str],
    tensors: Mapping[str, torch.Tensor],
) -> str | None:
    """Grow the two-layer capture ``model`` to ``stack.count`` layers in place; or leave it as it is
    and say why its second layer cannot be repeated.

    ``inputs_of(layer, layers)`` / ``outputs_of`` name a layer's own graph inputs and outputs in a file
    of ``layers`` layers (its past and present keys and values); ``input_names`` / ``output_names`` are
    the whole file's, in order; ``tensors`` are the model's weights by name, every layer's.
    """
    graph = model.graph
    template = _Template(
        graph,
        stack.prefix,
        [inputs_of(i, TEMPLATE_LAYERS) for i in range(TEMPLATE_LAYERS)],
        [outputs_of(i, TEMPLATE_LAYERS) for i in range(TEMPLATE_LAYERS)],
    )
    reason = template.mismatch()
    if reason:
        return reason
    first, second = template.layers
    weights: dict[ir.Value, list[str]] = {}
    for node in second:
        for value in node.inputs:
            if value is None or not value.is_initializer() or _initializer_layer(value.name or "", stack.prefix) != 1:
                continue
            const = value.const_value
            raw = getattr(const, "raw", None)
            own = tensors.get(value.name or "")
            if not isinstance(raw, torch.Tensor) or own is None or raw.data_ptr() != own.data_ptr():
                return f"the weight '{value.name}' is not the model's tensor of that name"
            names = [
                f"{stack.prefix}.{i}.{_rest(value.name or '', stack.prefix)}"
                for i in range(TEMPLATE_LAYERS, stack.count)
            ]
            for name in names:
                tensor = tensors.get(name)
                if tensor is None or tensor.shape != raw.shape or tensor.dtype != raw.dtype:
                    return f"the model has no weight '{name}' shaped as layer 1's"
            weights[value] = names
    template_inputs = {v: role for role, v in enumerate(template.layer_inputs[1]) if v is not None}
    produced_by_second = {out for node in second for out in node.outputs}
    produced_by_first = {out: (index, i) for index, node in enumerate(first) for i, out in enumerate(node.outputs)}

    previous: dict[ir.Value, ir.Value] = {}  # layer 1 itself: its values are its own
    new_inputs: dict[str, ir.Value] = {}
    new_outputs: dict[str, ir.Value] = {}
    # the sizes the inputs name (batch, sequence, ...) are every layer's; any other symbol is a
    # size the layer's data decides (the tokens an expert takes), another in every layer
    shared_sizes = {
        name
        for v in graph.inputs
        if v.shape is not None
        for d in v.shape.dims
        if isinstance(d, ir.SymbolicDim) and d.value
        for name in _SYMBOL.findall(d.value)
    }
    anchor = second[-1]
    for layer in range(TEMPLATE_LAYERS, stack.count):
        copies: dict[ir.Value, ir.Value] = {}
        made: list[ir.Node] = []
        for node in second:
            values: list[ir.Value | None] = []
            for value in node.inputs:
                if value is None:
                    values.append(None)
                elif value in produced_by_second:
                    values.append(copies[value])
                elif value in produced_by_first:
                    index, out = produced_by_first[value]
                    source = second[index].outputs[out]
                    values.append(previous.get(source, source))
                elif value in template_inputs:
                    name = inputs_of(layer, stack.count)[template_inputs[value]]
                    if name not in new_inputs:
                        new_inputs[name] = ir.Value(name=name, type=value.type, shape=value.shape)
                    values.append(new_inputs[name])
                elif value in weights:
                    name = weights[value][layer - TEMPLATE_LAYERS]
                    if name not in graph.initializers:
                        graph.register_initializer(
                            ir.Value(
                                name=name,
                                type=value.type,
                                shape=value.shape,
                                const_value=_tensor_like(value.const_value, tensors[name], name),
                            )
                        )
                    values.append(graph.initializers[name])
                else:
                    values.append(value)
            scopes = node.metadata_props.get(_SCOPES, "")
            metadata = {
                **node.metadata_props,
                _SCOPES: scopes.replace(f"'{stack.prefix}.1", f"'{stack.prefix}.{layer}"),
            }
            outs = [ir.Value(type=o.type, shape=_own_sizes(o.shape, shared_sizes, layer)) for o in node.outputs]
            attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
            copy = ir.Node(
                node.domain,
                node.op_type,
                values,
                attributes,
                overload=node.overload,
                outputs=outs,
                version=node.version,
                metadata_props=metadata,
            )
            made.append(copy)
            for old, new in zip(node.outputs, outs):
                copies[old] = new
                if old.name in template.layer_outputs[1]:
                    role = template.layer_outputs[1].index(old.name)
                    new.name = outputs_of(layer, stack.count)[role]
                    new_outputs[new.name] = new
        graph.insert_after(anchor, made)
        anchor = made[-1]
        previous = copies
    # what reads the last layer's output (the final norm) reads the new last layer's
    for node in template.others:
        for index, value in enumerate(node.inputs):
            if value is not None and value in produced_by_second:
                node.replace_input_with(index, previous[value])
    kept_inputs = {v.name: v for v in graph.inputs}
    kept_outputs = {v.name: v for v in graph.outputs}
    graph.inputs.clear()
    graph.inputs.extend(kept_inputs.get(n) or new_inputs[n] for n in input_names)
    graph.outputs.clear()
    graph.outputs.extend(kept_outputs.get(n) or new_outputs[n] for n in output_names)
    graph.sort()
    return None
