"""Edits on an annotated graph: the Q/DQ placement policies and ``skip_activations``."""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import (
    DerivedQuantizationSpec,
    QuantizationSpec,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.utils import get_module_name_filter

from ..errors import InvalidArgumentError
from .annotate import ADD_OPS, BATCH_NORM_OPS, CONV_OPS, RELU_OPS, annotation_of

PLACEMENTS = ("per_op", "skip_conv_add")
_EPILOGUE_OPS = BATCH_NORM_OPS + RELU_OPS


def _conv_root(node: Node) -> Node | None:
    """The conv whose result ``node`` is, through at most two epilogue nodes (BN, ReLU)."""
    current = node
    for _ in range(3):
        if current.op != "call_function":
            return None
        if current.target in CONV_OPS:
            return current
        if current.target not in _EPILOGUE_OPS:
            return None
        parent = current.args[0]
        if not isinstance(parent, Node) or len(parent.users) != 1:
            return None
        current = parent
    return None


def _shared_references(model: GraphModule) -> dict[object, set[object]]:
    """For every node or edge some Shared/Derived spec points at, the holders of those specs.

    A holder is the node (its output spec) or the ``(arg, node)`` edge (an input spec).
    """
    referenced: dict[object, set[object]] = {}
    for node in model.graph.nodes:
        annotation = annotation_of(node)
        if annotation is None:
            continue
        holders = [((arg, node), spec) for arg, spec in annotation.input_qspec_map.items()]
        holders.append((node, annotation.output_qspec))
        for holder, spec in holders:
            if isinstance(spec, SharedQuantizationSpec):
                referenced.setdefault(spec.edge_or_node, set()).add(holder)
            elif isinstance(spec, DerivedQuantizationSpec):
                for target in spec.derived_from:
                    referenced.setdefault(target, set()).add(holder)
    return referenced


def skip_conv_add(model: GraphModule) -> tuple[int, int]:
    """Leave one conv→add edge per residual add unquantized; return (edges skipped, adds seen).

    The residual branch's convolution (the first addend that is a single-user convolution
    partition) then reaches the add at full precision. The other addend stays quantized.
    """
    referenced = _shared_references(model)
    skipped = adds = 0
    for add in model.graph.nodes:
        if add.op != "call_function" or add.target not in ADD_OPS:
            continue
        add_annotation = annotation_of(add)
        if add_annotation is None:
            continue
        adds += 1
        for addend in add.args[:2]:
            if not isinstance(addend, Node) or addend not in add_annotation.input_qspec_map:
                continue
            own = annotation_of(addend)
            if (
                len(addend.users) != 1
                or own is None
                or not isinstance(own.output_qspec, QuantizationSpec)
                # only the add's own edge may share the conv's parameters
                or referenced.get(addend, set()) - {(addend, add)}
                or (addend, add) in referenced
                or _conv_root(addend) is None
            ):
                continue
            del add_annotation.input_qspec_map[addend]
            own.output_qspec = None
            skipped += 1
            break
    return skipped, adds


def module_nodes(model: GraphModule, name: str) -> list[Node]:
    """The call_function nodes traced from module ``name`` or anything inside it."""
    belongs = get_module_name_filter(name)
    return [n for n in model.graph.nodes if n.op == "call_function" and belongs(n)]


def observed(node: Node) -> bool:
    """True when pt2e will observe ``node``'s output (its own spec or a reader's input spec)."""
    own = annotation_of(node)
    if own is not None and own.output_qspec is not None:
        return True
    return any(
        (a := annotation_of(user)) is not None and node in a.input_qspec_map for user in node.users
    )


def _downstream_observed_module(nodes: list[Node]) -> str | None:
    """The module owning the first observed node after ``nodes`` (a fused epilogue's ReLU)."""
    frontier = [u for n in nodes for u in n.users]
    for _ in range(4):
        nxt: list[Any] = []
        for node in frontier:
            if observed(node):
                stack = node.meta.get("nn_module_stack", {})
                if stack:
                    path = list(stack.values())[-1][0]
                    return path.removeprefix("L['self'].")
            nxt.extend(node.users)
        frontier = nxt
    return None


def check_skip_names(model: torch.nn.Module, names: list[str], argument: str = "skip_activations") -> None:
    """Every name must be a module of ``model``; raise listing close matches otherwise."""
    known = {n for n, _ in model.named_modules() if n}
    for name in names:
        if not isinstance(name, str) or name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise InvalidArgumentError(
                f"{argument} names {name!r}, which is not a module of this model.{hint}"
            )


def quantized_layers(model: GraphModule) -> list[str]:
    """The modules (innermost, in graph order) whose weights an annotated graph quantizes."""
    layers: list[str] = []
    for node in model.graph.nodes:
        annotation = annotation_of(node)
        if annotation is None or not any(getattr(arg, "op", None) == "get_attr" for arg in annotation.input_qspec_map):
            continue
        stack = node.meta.get("nn_module_stack", {})
        if stack:
            path = list(stack.values())[-1][0].removeprefix("L['self'].")
            if path and path not in layers:
                layers.append(path)
    return layers


def _unobserve_output(node: Node, dead: set[object]) -> int:
    """Drop the readers' input specs on ``node`` and mark it and its edges dead; specs dropped."""
    dropped = 0
    dead.add(node)
    for user in node.users:
        annotation = annotation_of(user)
        if annotation is not None and annotation.input_qspec_map.pop(node, None) is not None:
            dropped += 1
        dead.add((node, user))
    return dropped


def skip_layers(model: GraphModule, names: list[str]) -> dict[str, int]:
    """Leave the named modules entirely in float: their weights, what they read of their own and
    what they hand on (no observer on their outputs, nor on the edges reading them)."""
    edits: dict[str, int] = {}
    dead: set[object] = set()
    for name in names:
        count = 0
        for node in module_nodes(model, name):
            annotation = annotation_of(node)
            if annotation is not None:
                count += len(annotation.input_qspec_map) + (annotation.output_qspec is not None)
                for arg in annotation.input_qspec_map:
                    dead.add((arg, node))
                annotation.input_qspec_map.clear()
                annotation.output_qspec = None
            count += _unobserve_output(node, dead)
        edits[name] = count
    _sweep_shared(model, dead)
    return edits


def skip_activations(model: GraphModule, names: list[str]) -> dict[str, int]:
    """Leave the named modules' output activations (and every edge reading them) in float.

    Their weights and inputs stay quantized. Raises when a name's activation is not observed by
    our annotation, naming the module whose observer carries it instead.
    """
    edits: dict[str, int] = {}
    dead: set[object] = set()
    for name in names:
        nodes = module_nodes(model, name)
        sites = [n for n in nodes if observed(n)]
        if not sites:
            instead = _downstream_observed_module(nodes)
            hint = (
                f"name {instead!r} instead (its output is the observed activation)"
                if instead
                else "name the module whose output is quantized"
            )
            raise InvalidArgumentError(
                f"skip_activations names {name!r}, whose output pt2e does not observe (a conv or "
                f"linear fused with its ReLU is observed after the ReLU; a folded batch norm never): {hint}."
            )
        count = 0
        for node in sites:
            own = annotation_of(node)
            if own is not None and own.output_qspec is not None:
                own.output_qspec = None
                count += 1
            count += _unobserve_output(node, dead)
        edits[name] = count
    _sweep_shared(model, dead)
    return edits


def _sweep_shared(model: GraphModule, dead: set[object]) -> None:
    """Clear every spec that shares with, or derives from, something no longer observed."""

    def is_dead(spec: object) -> bool:
        if isinstance(spec, SharedQuantizationSpec):
            return spec.edge_or_node in dead
        if isinstance(spec, DerivedQuantizationSpec):
            return any(d in dead for d in spec.derived_from)
        return False

    changed = True
    while changed:
        changed = False
        for node in model.graph.nodes:
            annotation = annotation_of(node)
            if annotation is None:
                continue
            if is_dead(annotation.output_qspec):
                annotation.output_qspec = None
                dead.add(node)
                changed = True
            for arg, spec in list(annotation.input_qspec_map.items()):
                if is_dead(spec):
                    del annotation.input_qspec_map[arg]
                    dead.add((arg, node))
                    changed = True
