"""Core ML partitions cut into pieces of at most `PIECE_WEIGHT_BYTES` of weights each.

coremltools converts a partition whole, and its MIL program holds the partition's weights
several times over: a 1B Llama compiled 4w is one partition, whose lowering took 8.8 GB of the
process's own memory for 1.2 GB of codes. Cut in program order into pieces whose weights stay
under the limit, each piece is converted on its own, and its payload written, before the next:
the lowering holds one piece's weights, so a model of any size converts in the same memory.
Consecutive runs (in topological order) of a convex partition are convex, so each piece is one
delegate call. A cut never separates the ops using one mutable buffer (Core ML state lives in
one model) nor a node from the getitems reading its outputs.
"""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.passes.infra.partitioner import Partition

# A partition holding more weights than this is cut into pieces holding at most about this many.
PIECE_WEIGHT_BYTES = 256 << 20

_CONSTANTS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _constant_bytes(program: ExportedProgram) -> dict[str, int]:
    """Placeholder name -> the bytes of the weight (or constant buffer) it stands for."""
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    sizes = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind not in _CONSTANTS or spec.target in mutated:
            continue
        value = program.state_dict.get(spec.target, program.constants.get(spec.target))
        if isinstance(value, torch.Tensor):
            sizes[spec.arg.name] = value.numel() * value.element_size()
    return sizes


def _state_nodes(program: ExportedProgram) -> list[list[torch.fx.Node]]:
    """For each mutable float buffer (what Core ML may take over as state; an integer one, a
    cache's position counter, stays the CPU's and is passed to whichever piece reads it), the
    nodes using it: its readers, its writer and what reads the written value."""
    signature = program.graph_signature
    nodes = {n.name: n for n in program.graph.nodes}
    writers = {target: name for name, target in signature.buffers_to_mutate.items()}
    groups = []
    for spec in signature.input_specs:
        if spec.kind is not InputKind.BUFFER or spec.target not in writers:
            continue
        value = program.state_dict.get(spec.target, program.constants.get(spec.target))
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            continue
        using = [u for u in nodes[spec.arg.name].users if u.op == "call_function"]
        writer = nodes.get(writers[spec.target])
        if writer is not None and writer.op == "call_function":
            using += [writer, *(u for u in writer.users if u.op == "call_function")]
        groups.append(using)
    return groups


def _reads_a_value(piece: list[torch.fx.Node], constants: dict[str, int]) -> bool:
    """Whether the piece reads something other than its own nodes and weights (an input, a
    buffer or another delegate's output)."""
    inside = set(piece)
    return any(a not in inside and a.name not in constants for node in piece for a in node.all_input_nodes)


def cut(program: ExportedProgram, partitions: tuple[Partition, ...], limit: int = PIECE_WEIGHT_BYTES
        ) -> tuple[tuple[Partition, ...], list[str]]:
    """The partitions with each one holding more than `limit` bytes of weights cut into pieces,
    and a line for the report per partition cut."""
    order = {node: index for index, node in enumerate(program.graph.nodes)}
    sizes = _constant_bytes(program)
    states = _state_nodes(program)
    result: list[Partition] = []
    notes = []
    next_id = max((p.id or 0 for p in partitions), default=0) + 1
    for partition in partitions:
        nodes = sorted(partition.nodes, key=order.__getitem__)
        position = {node: index for index, node in enumerate(nodes)}
        weights, seen = [], set()
        for node in nodes:
            new = [a.name for a in node.all_input_nodes if a.name in sizes and a.name not in seen]
            seen.update(new)
            weights.append(sum(sizes[name] for name in new))
        if sum(weights) <= limit:
            result.append(partition)
            continue
        # Positions a cut may not fall inside: (first, last) of each state's and each tuple's users.
        spans = []
        for using in states:
            inside = [position[n] for n in using if n in position]
            if len(inside) > 1:
                spans.append((min(inside), max(inside)))
        for node in nodes:
            items = [position[u] for u in node.users if u.target is operator.getitem and u in position]
            if items:
                spans.append((position[node], max(items)))
        blocked = [0] * (len(nodes) + 1)
        for first, last in spans:
            blocked[first] += 1
            blocked[last] -= 1
        open_spans, held, start, pieces = 0, 0, 0, []
        for index, node in enumerate(nodes):
            open_spans += blocked[index]
            held += weights[index]
            if held >= limit and not open_spans and index + 1 < len(nodes):
                pieces.append(nodes[start : index + 1])
                start, held = index + 1, 0
        pieces.append(nodes[start:])
        if len(pieces) == 1 or not all(_reads_a_value(piece, sizes) for piece in pieces):
            result.append(partition)  # (a piece of constants alone: a model without inputs needs iOS 18)
            continue
        result.append(Partition(partition.id, pieces[0]))
        for piece in pieces[1:]:
            result.append(Partition(next_id, piece))
            next_id += 1
        notes.append(
            f"a partition holding {sum(weights) / 2**20:.0f} MiB of weights is {len(pieces)} delegates of at most "
            f"about {limit / 2**20:.0f} MiB each (coremltools converts one at a time)"
        )
    return tuple(result), notes
