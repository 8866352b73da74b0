"""Dynamic dimensions: which input sizes a program declares symbolic, how to name them for a
user, and keeping a dependency from fixing one.

torch.export gives each dynamic dimension a symbol (`s70`) with a range in the program's
`range_constraints`; every later program shares the symbol's shape environment. Code that
takes a symbolic size as a number (`int(size)`) adds a guard there that fixes the symbol
at the example's value, silently, for every program sharing it: the lowered program then
runs at the example's length only. `guards_refused` makes such a guard an error instead.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

import sympy
import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

# What torch's `_ShapeEnvGuardError` says of a guard attempted under `guards_refused`.
_GUARD_MESSAGE = re.compile(r"Guard attempted while ShapeEnv guards are frozen: (.+?)(?:\.\s|\.?$)", re.M)
_SYMBOL = re.compile(r"\bs\d+\b")


def _placeholder_sizes(graph: torch.fx.Graph) -> Iterator[tuple[str, int, torch.SymInt]]:
    """(placeholder name, dimension, size) of each symbolic size of a graph's inputs."""
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    yield node.name, dim, size


def _input_sizes(program: ExportedProgram) -> Iterator[tuple[str, int, torch.SymInt]]:
    """(input name, dimension, size) of each symbolic size of the program's user inputs."""
    names = set(program.graph_signature.user_inputs)
    return (found for found in _placeholder_sizes(program.graph) if found[0] in names)


def _unbounded(bounds) -> bool:
    """torch's own infinity (`int_oo`) says it is finite to sympy."""
    return bounds.upper is int_oo or bounds.upper.is_infinite


def _range(bounds) -> str:
    if bounds is None:
        return "?"
    return f"{bounds.lower}..{'' if _unbounded(bounds) else bounds.upper}"


def where_is(graph: torch.fx.Graph, symbol: str) -> str | None:
    """`input_ids's dim 1`: the first input size that is `symbol` itself, or None."""
    return next(
        (f"{name}'s dim {dim}" for name, dim, size in _placeholder_sizes(graph) if str(size.node._expr) == symbol), None
    )


def describe(graph: torch.fx.Graph, symbol: str) -> str:
    """`s70` as a user reads it: `input_ids's dim 1 (s70, 2..32)`, or the symbol and its range
    when no input size is the symbol itself."""
    sizes = list(_placeholder_sizes(graph))
    where = where_is(graph, symbol)
    ranges = sizes[0][2].node.shape_env.var_to_range if sizes else {}
    bounds = _range(next((r for s, r in ranges.items() if str(s) == symbol), None))
    if where:
        return f"{where} ({symbol}, {bounds})"
    # Callers say "the dynamic size ..." themselves; an unbacked symbol is one no input holds.
    return f"{symbol} (data-dependent)" if bounds == "?" and symbol.startswith("u") else f"{symbol} ({bounds})"


def describe_sizes(graph: torch.fx.Graph, symbols) -> str:
    return ", ".join(describe(graph, symbol) for symbol in symbols)


def symbols_read(node: torch.fx.Node) -> list[str]:
    """The dynamic-size symbols in `node`'s arguments (a size read from `sym_size`, `2*s27`)."""
    found = set()
    for arg in pytree.tree_leaves((node.args, node.kwargs)):
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
        if isinstance(value, torch.SymInt):
            found |= {str(s) for s in value.node.expr.free_symbols}
    return sorted(found)


def symbols_held(node: torch.fx.Node) -> list[str]:
    """The size symbols in `node`'s own value (its shape, or the SymInt it is)."""
    found = set()
    for leaf in pytree.tree_leaves(node.meta.get("val")):
        sizes = leaf.shape if isinstance(leaf, torch.Tensor) else [leaf]
        found |= {str(s) for d in sizes if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
    return sorted(found)


def symbols_named(text: str) -> list[str]:
    """The dynamic-size symbols (`s27`) a message names."""
    return sorted(set(_SYMBOL.findall(text)))


def refused_guard_symbols(text: str) -> list[str]:
    """The dynamic-size symbols a guard refused under `guards_refused` named, from its message
    (stock backends report a handler's exception as text); [] when `text` is no such message."""
    found = _GUARD_MESSAGE.search(text)
    return sorted(set(_SYMBOL.findall(found.group(1)))) if found else []


def fixed_sizes(program: ExportedProgram) -> list[str]:
    """The user inputs' dynamic sizes something fixed at a number: a symbol the shared shape
    environment now replaces by one. (A one-number range alone says nothing: `torch._check`
    may fix a data-dependent size.)"""
    return [
        f"{name}'s dim {dim} ({size.node._expr}) is now {size.node.expr}"
        for name, dim, size in _input_sizes(program)
        if size.node.expr.is_number and not size.node._expr.is_number
    ]


def unbounded_sizes(program: ExportedProgram) -> list[str]:
    """The user inputs' dynamic sizes without an upper bound, described. ExecuTorch plans each
    tensor's memory at its size's upper bound, and at the example's size where there is none
    (`eval_upper_bound`), so such a program refuses any longer input."""
    bounds = {str(key): value for key, value in program.range_constraints.items()}
    return [
        describe(program.graph, symbol)
        for symbol in dict.fromkeys(str(size.node._expr) for _, _, size in _input_sizes(program))
        if symbol in bounds and _unbounded(bounds[symbol])
    ]


def input_ranges(program: ExportedProgram) -> dict[str, tuple[str, int, int]]:
    """Symbol -> (the input size it is, lower, upper bound) of each bounded dynamic size of the user
    inputs that is an input's size itself (not an expression of others)."""
    bounds = {str(key): value for key, value in program.range_constraints.items()}
    found = {}
    for _, _, size in _input_sizes(program):
        symbol = str(size.node._expr)
        if symbol in bounds and symbol not in found and size.node._expr.is_Symbol and not _unbounded(bounds[symbol]):
            found[symbol] = (where_is(program.graph, symbol), int(bounds[symbol].lower), int(bounds[symbol].upper))
    return found


def input_shapes_at(program: ExportedProgram, values: dict[str, int]) -> list[tuple[int, ...] | None]:
    """Each user input's shape with its dynamic sizes at `values` (symbol -> size); None for an
    input that is not a tensor."""
    names = set(program.graph_signature.user_inputs)
    shapes = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in names:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            shapes.append(None)
            continue
        shapes.append(tuple(_size_at(size, values) if isinstance(size, torch.SymInt) else size for size in value.shape))
    return shapes


def _size_at(size: torch.SymInt, values: dict[str, int]) -> int:
    """`size` with its symbols at `values`; the example's size if one of them has none."""
    expr = size.node._expr
    expr = expr.xreplace({s: sympy.Integer(values[str(s)]) for s in expr.free_symbols if str(s) in values})
    return int(expr) if expr.is_number else size.node.hint


def _shape_env(program: ExportedProgram):
    return next((size.node.shape_env for _, _, size in _input_sizes(program)), None)


def program_shape_env(program: ExportedProgram):
    """The ShapeEnv of the program's fake values (a static program has one too), or None."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"])
    return getattr(fake_mode, "shape_env", None)


def pending_unbacked_symbols(program: ExportedProgram) -> list[sympy.Symbol]:
    """Data-dependent sizes made on the program's fake values that no node has bound yet: the
    next shape propagation raises `PendingUnbackedSymbolNotFound` at whatever node it reaches."""
    env = program_shape_env(program)
    return list(env.pending_fresh_unbacked_symbols) if env is not None else []


@contextlib.contextmanager
def fresh_symbols_dropped(program: ExportedProgram) -> Iterator[None]:
    """A check that re-runs the graph on the program's own fake values (ExecuTorch's verifier
    does) makes a fresh symbol at each data-dependent op and binds none: they are forgotten after."""
    env = program_shape_env(program)
    before = list(env.pending_fresh_unbacked_symbols) if env is not None else []
    try:
        yield
    finally:
        if env is not None:
            env.pending_fresh_unbacked_symbols[:] = before


@contextlib.contextmanager
def guards_refused(program: ExportedProgram) -> Iterator[None]:
    """While inside, code that would guard on one of the program's symbolic sizes (take it as
    a number, compare it with one) raises torch's `_ShapeEnvGuardError` instead of fixing or
    narrowing it.
    Nothing happens for a program without dynamic inputs."""
    env = _shape_env(program)
    if env is None:
        yield
        return
    # torch logs each refused guard as a failure ("failed during evaluate_expr"): here it is the answer.
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        with env.error_on_new_guards():
            yield
    finally:
        shapes_log.setLevel(level)
