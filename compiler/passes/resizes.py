"""Antialiased resizes (`interpolate(..., antialias=True)`, bilinear or bicubic) as two matrix
products with the weights torch's own kernel uses.

`aten._upsample_bilinear2d_aa` and `aten._upsample_bicubic2d_aa` are not Core ATen: no backend
has them, the portable runtime has no kernel, and Core ML converted the bilinear one as a plain
bilinear resize (a program 0.2 off eager on a camera frame, with no error). With static sizes the
resize is linear and separable: `rows @ x @ columns`, `rows` (out_h x in_h) and `columns`
(in_w x out_w) being torch's kernel applied to identity matrices, so every backend computes it
with plain matrix products, as exactly as float arithmetic allows. Each rewrite is checked
against the kernel on a random input before it is kept: weights that do not reproduce it are a
named error, not a program.
"""

from __future__ import annotations

import logging

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram

from compiler.ir.errors import UserInputError
from compiler.ir.graph import lift_constant, rename_output

logger = logging.getLogger(__name__)

aten = torch.ops.aten
ANTIALIASED = {
    aten._upsample_bilinear2d_aa.default: "bilinear",
    aten._upsample_bilinear2d_aa.vec: "bilinear",
    aten._upsample_bicubic2d_aa.default: "bicubic",
    aten._upsample_bicubic2d_aa.vec: "bicubic",
}


def _arguments(node: torch.fx.Node) -> tuple[bool, float | None, float | None]:
    """(align_corners, scale_h, scale_w) of either overload."""
    args = list(node.args) + [None] * 5
    if node.target in (aten._upsample_bilinear2d_aa.vec, aten._upsample_bicubic2d_aa.vec):
        align = node.kwargs.get("align_corners", args[2])
        factors = node.kwargs.get("scale_factors", args[3]) or (None, None)
        return bool(align), factors[0], factors[1]
    align = node.kwargs.get("align_corners", args[2])
    return bool(align), node.kwargs.get("scales_h", args[3]), node.kwargs.get("scales_w", args[4])


def _kernel(mode: str):
    return aten._upsample_bilinear2d_aa.default if mode == "bilinear" else aten._upsample_bicubic2d_aa.default


def _resize(identity: torch.Tensor, size: list[int], mode: str, align: bool, scales: tuple) -> torch.Tensor:
    """torch's antialiased kernel itself, on a float64 matrix (its 2-D form: a 1-wide input takes
    another path in torch 2.13 and gives other weights)."""
    return _kernel(mode)(identity[None, None], size, align, *scales)[0, 0]


def resize_weights(mode: str, in_size: tuple[int, int], out_size: tuple[int, int], align: bool,
                   scale_h: float | None, scale_w: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns): `rows @ x @ columns` is the resize of `x`, in float64."""
    (in_h, in_w), (out_h, out_w) = in_size, out_size
    rows = _resize(torch.eye(in_h, dtype=torch.float64), [out_h, in_h], mode, align, (scale_h, None))
    columns = _resize(torch.eye(in_w, dtype=torch.float64), [in_w, out_w], mode, align, (None, scale_w))
    return rows, columns


def _reproduces(node: torch.fx.Node, mode: str, rows: torch.Tensor, columns: torch.Tensor, shape) -> float:
    """The largest error of the matrix products against the kernel on a random float64 input."""
    x = torch.randn(*shape[-2:], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    align, scale_h, scale_w = _arguments(node)
    want = _kernel(mode)(x[None, None], [rows.shape[0], columns.shape[1]], align, scale_h, scale_w)[0, 0]
    return (rows @ x @ columns - want).abs().max().item()


def antialiased_resizes_as_matmuls(ep: ExportedProgram) -> int:
    """Rewrites every antialiased resize of `ep` in place; returns how many. A resize of dynamic
    size or of an integer tensor is a named error (torch resizes uint8 in fixed point, rounding
    between its two passes: no float product gives its numbers)."""
    graph = ep.graph
    mode_of_fakes = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    rewritten = 0
    for node in list(graph.nodes):
        mode = ANTIALIASED.get(node.target)
        if mode is None:
            continue
        source = node.args[0]
        value, out = source.meta["val"], node.meta["val"]
        sizes = (*value.shape[-2:], *out.shape[-2:])
        if not all(isinstance(s, int) for s in sizes):
            raise UserInputError(
                f"the antialiased {mode} resize {node.name} has a dynamic size {tuple(out.shape)}", stage="capture",
                nodes=[node.name], hint="give the resized dimensions static sizes (no backend resizes with antialias)",
            )
        if not value.is_floating_point():
            raise UserInputError(
                f"the antialiased {mode} resize {node.name} resizes a {value.dtype} tensor: torch computes it in "
                "fixed point, rounding between its two passes, which no backend's ops reproduce", stage="capture",
                nodes=[node.name], hint="resize the frame as a float tensor (frame.float() before interpolate)",
            )
        rows, columns = resize_weights(mode, sizes[:2], sizes[2:], *_arguments(node))
        error = _reproduces(node, mode, rows, columns, value.shape)
        if error > 1e-9:
            raise UserInputError(
                f"the antialiased {mode} resize {node.name}: its weights do not reproduce torch's kernel "
                f"(error {error:.3g} in float64)", stage="capture", nodes=[node.name],
                hint="report it with the model; resize with antialias=False meanwhile",
            )
        dtype = value.dtype
        rows_node = lift_constant(ep, _fresh(ep, f"{node.name}_rows"), rows.to(dtype), mode_of_fakes)
        columns_node = lift_constant(ep, _fresh(ep, f"{node.name}_columns"), columns.to(dtype), mode_of_fakes)
        with graph.inserting_before(node), mode_of_fakes:
            tall = graph.call_function(aten.matmul.default, (rows_node, source))
            tall.meta["val"] = aten.matmul.default(rows_node.meta["val"], value)
            wide = graph.call_function(aten.matmul.default, (tall, columns_node))
            wide.meta["val"] = aten.matmul.default(tall.meta["val"], columns_node.meta["val"])
        for new in (tall, wide):
            new.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
        node.replace_all_uses_with(wide)
        rename_output(ep, node.name, wide.name)
        graph.erase_node(node)
        rewritten += 1
        logger.info("capture: %s (%s, antialiased) as two matrix products", node.name, mode)
    if rewritten:
        ep.graph_module.recompile()
    return rewritten


def _fresh(ep: ExportedProgram, name: str) -> str:
    taken = set(ep.constants) | set(ep.state_dict) | {n.name for n in ep.graph.nodes}
    index, fresh = 0, name
    while fresh in taken:
        index += 1
        fresh = f"{name}_{index}"
    return fresh

