"""Values inside a delegate whose runtime shows none (XNNPACK): cut it at the suspect node.

The program before lowering (the split_constants stage's) is copied with the suspect node's
value made an extra output, and lowered again through the same backend: the partition then
returns that value, and running the lowered program gives it as the payload computes it. A
binary search over the partition's nodes (topological order, the diverging output's ancestors
only) finds the first whose value leaves the tolerance in about log2(n) lowerings; one more
lowering with the whole path to it as outputs gives the chain of errors.

The same cut opens the emitted program (`EMIT`): the lowered program with a CPU node's value as
an extra output is emitted again and run whole under the runtime, so the value is the one the
runtime's kernel computed (`emitted.py`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument

from compiler.ir.errors import CompileError
from compiler.ir.graph import DELEGATION_TAG
from compiler.tools.locate import compare
from compiler.tools.locate.programs import run_exported, run_pte
from compiler.tools.locate.nodes import delegate_outputs

logger = logging.getLogger(__name__)


def with_outputs(split: Any, names: Sequence[str]) -> Any:
    """A copy of the artifact (split_constants' or lower's) whose program also returns the nodes
    `names`, after its own outputs."""
    program = copy.deepcopy(split.program)
    nodes = {n.name: n for n in program.graph.nodes}
    output = program.graph.output_node()
    wanted = [nodes[name] for name in names]
    output.args = (tuple(output.args[0]) + tuple(wanted),)
    program.graph_signature.output_specs.extend(
        OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name), None) for name in names
    )
    program.graph_module.recompile()
    return attrs.evolve(split, program=program)


@attrs.frozen
class Span:
    """The stages a cut runs again: after `after`, up to and including `until`."""

    after: str
    until: str


LOWER = Span("split_constants", "lower")  # a delegate cut: the partition lowered again
EMIT = Span("lower", "emit")  # an emitted program cut: the lowered program emitted again


def lower(split: Any, backend: Any, config: Any) -> Any:
    """The lower stage alone on `split`, without verification (the cut's program is ours)."""
    return restage(split, backend, config, LOWER)


def restage(artifact: Any, backend: Any, config: Any, span: Span) -> Any:
    """The stages of `span` alone on `artifact`, without verification (the cut's program is ours)."""
    from compiler.driver.config import DriverOptions
    from compiler.driver.instruments import instruments_for
    from compiler.driver.pipeline import Pipeline
    from compiler.process.dependency_output import DependencyOutput
    from compiler.stages import default_stages

    with DependencyOutput():
        result = Pipeline(default_stages()).execute(
            artifact, backend, config, instruments_for(DriverOptions(verify=False, reproducer=False)),
            start_after=span.after, stop_after=span.until,
        )
    return result.artifact


@attrs.frozen
class Cut:
    """Values of nodes inside a delegate, as its payload computes them, by re-lowering `split`
    (span LOWER); or of CPU nodes, as the runtime's kernels compute them, by emitting the lowered
    program `split` again and running the `.pte` (span EMIT)."""

    split: Any
    backend: Any
    config: Any
    inputs: tuple
    lowerings: list = attrs.field(factory=list)  # (names probed, seconds), for the report
    failed: list = attrs.field(factory=list)  # the names whose lowering (or emission) failed last
    fused: list = attrs.field(factory=list)  # nodes the backend gives no value of their own (`diverges`)
    span: Span = LOWER

    def values(self, names: Sequence[str]) -> dict[str, Any]:
        import time

        start = time.perf_counter()
        try:
            made = restage(with_outputs(self.split, names), self.backend, self.config, self.span)
        except Exception:
            self.failed[:] = list(names)
            raise
        if self.span == EMIT:
            outputs = run_pte(made, self.inputs).outputs  # the names' values come last
            found = dict(zip(names, outputs[len(outputs) - len(names):])) if len(outputs) >= len(names) else {}
        else:
            run = run_exported(made.program, self.inputs, keep=True)
            back = delegate_outputs(made.program)
            found = {back[n]: v for n, v in run.values.items() if n in back}
        self.lowerings.append((tuple(names), time.perf_counter() - start))
        logger.info("locate: cut at %s in %.1f s (%s)", ", ".join(names), time.perf_counter() - start, self.span.until)
        return {name: found[name] for name in names if name in found}


    def observable_values(self, names: Sequence[str]) -> dict[str, Any]:
        """`values` of those of `names` the backend gives a value of their own: all in one lowering,
        else one by one, noting in `fused` those it cannot."""
        names = [n for n in names if n not in self.fused]
        try:
            return self.values(names)
        except CompileError:
            if self.span == EMIT:
                raise
        found = {}
        for name in names:
            try:
                found.update(self.values([name]))
            except CompileError:
                self.fused.append(name)
        return found

    def diverges(self, name: str, reference: Mapping[str, Any], run: Any, dtype: torch.dtype) -> bool | None:
        """Whether `name`'s value, cut out, leaves the check's tolerance against `reference`. None
        when the backend cannot give it a value of its own: the partition cannot be lowered with it
        as an extra output (XNNPACK fuses a weight's dequantize into its linear and refuses a
        linear pattern of two outputs); such a node is noted in `fused`."""
        try:
            got = self.values([name]).get(name)
        except CompileError:
            if self.span == EMIT:
                raise
            self.fused.append(name)
            return None
        e = compare.error(got, reference[name])
        return e is None or e > compare.tolerance(run, dtype, [got], [reference[name]]).absolute


def candidates(split_program: Any, tag: str, diverging: str) -> list[torch.fx.Node]:
    """The partition's computed nodes that `diverging` depends on (itself included), in order."""
    return ancestors(split_program, diverging, lambda n: n.meta.get(DELEGATION_TAG) == tag)


def ancestors(program: Any, diverging: str, keep: Callable[[torch.fx.Node], bool]) -> list[torch.fx.Node]:
    """The computed nodes (a tensor each) that `diverging` depends on (itself included) and
    `keep` takes, in the program's order."""
    nodes = {n.name: n for n in program.graph.nodes}
    seen, frontier = set(), [nodes[diverging]]
    while frontier:
        node = frontier.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        frontier += node.all_input_nodes
    return [
        n for n in program.graph.nodes
        if n.name in seen and n.op == "call_function" and keep(n) and isinstance(n.meta.get("val"), torch.Tensor)
    ]


def first_over(order: Sequence[torch.fx.Node], over: Callable[[str], bool | None]) -> torch.fx.Node:
    """Binary search for the first node of `order` that is over (the last one is); a node `over`
    cannot measure (None) leaves the search."""
    order = list(order)
    low, high = 0, len(order) - 1
    while low < high:
        middle = (low + high) // 2
        verdict = over(order[middle].name)
        if verdict is None:
            del order[middle]
            high -= 1
        elif verdict:
            high = middle
        else:
            low = middle + 1
    return order[low]


def tag_of(split_program: Any, node_names: Mapping[str, Any] | Sequence[str]) -> str | None:
    tags = {n.name: n.meta.get(DELEGATION_TAG) for n in split_program.graph.nodes}
    return next((tags[n] for n in node_names if tags.get(n)), None)
