"""Complex values as real pairs: each complex tensor of a captured program becomes a real tensor
with one more, last dimension of 2 (real part, imaginary part), as `view_as_real` lays it out, and
each complex op the ops of its formula on those pairs.

No ExecuTorch backend computes in complex numbers, the Edge verifier refuses complex tensors in
most ops, and `aten.polar` is not in Core ATen: a rotary embedding written with `view_as_complex`
or `torch.polar` failed on every backend, stock's path too. The formulas are the textbook ones
(a product is `(ac - bd, ad + bc)`), computed in the pair's real dtype, so a program agrees with
eager to that dtype's rounding. A complex op without a formula here, a complex input or a complex
output is a named error before any other stage runs, but for a real FFT of a real input returned as
it is (`torch.fft.rfft(x)` as an output): the runtime's `_fft_r2c` kernel computes it, and ExecuTorch
returns its complex result, as stock does.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from compiler.ir.errors import UserInputError

logger = logging.getLogger(__name__)

aten = torch.ops.aten
STAGE = "capture"
# Real FFTs of a real input, which the runtime computes (`_fft_r2c`) where they are returned as they are.
_REAL_FFTS = (aten.fft_rfft.default, aten.fft_rfft2.default, aten.fft_rfftn.default)


def _is_complex(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


def _dim(dim: int) -> int:
    """A dimension of a complex tensor, as the same dimension of its pairs (the pair dim is last)."""
    return dim - 1 if dim < 0 else dim


class _Rewriter:
    def __init__(self, ep: ExportedProgram) -> None:
        self.ep = ep
        self.graph = ep.graph
        self.mode = detect_fake_mode([n.meta.get("val") for n in self.graph.nodes])
        self.pairs: dict[torch.fx.Node, torch.fx.Node] = {}  # complex node -> its pairs
        self.before: torch.fx.Node | None = None

    # --- building -----------------------------------------------------------------------------

    def call(self, op: Callable, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.before):
            new = self.graph.call_function(op, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.mode:
            new.meta["val"] = op(*fake_args, **fake_kwargs)
        new.meta.update({k: self.before.meta[k] for k in ("stack_trace", "nn_module_stack") if k in self.before.meta})
        return new

    def parts(self, pair: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
        return self.call(aten.select.int, pair, -1, 0), self.call(aten.select.int, pair, -1, 1)

    def join(self, real: torch.fx.Node, imaginary: torch.fx.Node) -> torch.fx.Node:
        return self.call(aten.stack.default, [real, imaginary], -1)

    def pair_of(self, node: Any) -> Any:
        """The pairs of a complex argument (a real one as it is)."""
        return self.pairs.get(node, node) if isinstance(node, torch.fx.Node) else node

    # --- the rewrite --------------------------------------------------------------------------

    def _returned_as_computed(self, node: torch.fx.Node) -> bool:
        """A real FFT of a real input that only the output reads: left as it is (see the module)."""
        return (node.target in _REAL_FFTS and all(user.op == "output" for user in node.users)
                and not any(a in self.pairs for a in node.all_input_nodes))

    def run(self) -> int:
        self._constants()
        for node in list(self.graph.nodes):
            if node.op != "call_function" or self._returned_as_computed(node):
                continue
            takes = [a for a in node.all_input_nodes if a in self.pairs]
            makes = _is_complex(node.meta.get("val")) or (
                isinstance(node.meta.get("val"), (tuple, list)) and any(map(_is_complex, node.meta["val"]))
            )
            if not takes and not makes:
                continue
            self.before = node
            made = self._rewrite(node)
            if made is None:  # a node of no value (a metadata assertion on a complex tensor)
                self.graph.erase_node(node)
                continue
            if _is_complex(node.meta.get("val")):
                self.pairs[node] = made
            else:  # a real result of complex operands: it replaces the node
                node.replace_all_uses_with(made)
                self._rename_output(node, made)
                self.graph.erase_node(node)
        for node in self.graph.find_nodes(op="output"):
            for returned in node.all_input_nodes:
                if returned in self.pairs:
                    raise UserInputError(
                        f"the program returns the complex tensor {returned.name}", stage=STAGE, nodes=[returned.name],
                        hint="return torch.view_as_real(z) (a complex value computed as real pairs leaves the "
                             "program as those pairs)",
                    )
        for node in reversed(list(self.pairs)):
            if node.op != "placeholder" and not node.users:  # the complex nodes, replaced by their pairs
                self.graph.erase_node(node)
        self.ep.graph_module.recompile()
        return len(self.pairs)

    def _constants(self) -> None:
        """Complex buffers and constants are stored as their pairs (`view_as_real`)."""
        for spec in self.ep.graph_signature.input_specs:
            node = next(n for n in self.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
            if not _is_complex(node.meta.get("val")):
                continue
            if spec.kind == InputKind.USER_INPUT:
                raise UserInputError(
                    f"the input {node.name} is complex", stage=STAGE, nodes=[node.name],
                    hint="pass torch.view_as_real(z) and call torch.view_as_complex on it in the model",
                )
            store = self.ep.state_dict if spec.target in self.ep.state_dict else self.ep.constants
            if spec.kind == InputKind.BUFFER and spec.target in self.ep.graph_signature.buffers_to_mutate.values():
                raise UserInputError(f"the model writes the complex buffer {spec.target}", stage=STAGE,
                                     nodes=[node.name], hint="keep the buffer as real pairs (torch.view_as_real)")
            store[spec.target] = torch.view_as_real(store[spec.target]).clone()
            with self.mode:
                node.meta["val"] = torch.view_as_real(node.meta["val"]).clone()
            self.pairs[node] = node

    def _is_pairs(self, argument: Any) -> bool:
        return isinstance(argument, torch.fx.Node) and argument in self.pairs

    def _rewrite(self, node: torch.fx.Node) -> torch.fx.Node | None:
        op, args, kwargs = node.target, node.args, node.kwargs
        pair, complex_arg = self.pair_of, self._is_pairs
        if op is aten._assert_tensor_metadata.default:
            return None
        if op is aten.view_as_complex.default:
            return self.call(aten.clone.default, args[0])
        if op is aten.view_as_real.default:
            return self.call(aten.clone.default, pair(args[0]))
        if op is aten.polar.default:
            magnitude, angle = args
            return self.join(self.call(aten.mul.Tensor, magnitude, self.call(aten.cos.default, angle)),
                             self.call(aten.mul.Tensor, magnitude, self.call(aten.sin.default, angle)))
        if op is aten.complex.default:
            return self.join(args[0], args[1])
        if op in (aten.real.default, aten.imag.default):
            return self.call(aten.select.int, pair(args[0]), -1, 0 if op is aten.real.default else 1)
        if op in (aten.mul.Tensor, aten.mul.Scalar):
            left, right = args
            if complex_arg(left) and complex_arg(right):
                (a, b), (c, d) = self.parts(pair(left)), self.parts(pair(right))
                real = self.call(aten.sub.Tensor, self.call(aten.mul.Tensor, a, c), self.call(aten.mul.Tensor, b, d))
                imaginary = self.call(aten.add.Tensor, self.call(aten.mul.Tensor, a, d), self.call(aten.mul.Tensor, b, c))
                return self.join(real, imaginary)
            z, other = (left, right) if complex_arg(left) else (right, left)
            if isinstance(other, torch.fx.Node):  # a real tensor scales both parts
                other = self.call(aten.unsqueeze.default, other, -1)
            return self.call(aten.mul.Tensor, pair(z), other)
        if op in (aten.add.Tensor, aten.sub.Tensor) and all(complex_arg(a) for a in args[:2]):
            if kwargs.get("alpha", 1) != 1:
                raise self._unsupported(node, "with alpha")
            return self.call(op, pair(args[0]), pair(args[1]))
        if op in (aten.conj.default, aten._conj.default, aten.conj_physical.default):
            real, imaginary = self.parts(pair(args[0]))
            return self.join(real, self.call(aten.neg.default, imaginary))
        if op is aten.abs.default:
            real, imaginary = self.parts(pair(args[0]))
            # sqrt(a² + b²), not hypot: its decomposition (prims.hypot) has no runtime kernel
            squares = self.call(aten.add.Tensor, self.call(aten.mul.Tensor, real, real),
                                self.call(aten.mul.Tensor, imaginary, imaginary))
            return self.call(aten.sqrt.default, squares)
        if op is aten.angle.default:
            real, imaginary = self.parts(pair(args[0]))
            return self.call(aten.atan2.default, imaginary, real)
        if op in (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                  aten.lift_fresh_copy.default):
            return self.call(aten.clone.default, pair(args[0]))
        if op in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
            wanted = kwargs.get("dtype", args[1] if op is aten.to.dtype and len(args) > 1 else None)
            if wanted is not None and not wanted.is_complex:
                raise self._unsupported(node, f"to the real dtype {wanted}")
            real = (wanted or node.meta["val"].dtype).to_real()
            return self.call(aten._to_copy.default, pair(args[0]), dtype=real)
        return self._shape_op(node, pair)

    def _shape_op(self, node: torch.fx.Node, pair: Callable) -> torch.fx.Node:
        op, args = node.target, node.args
        source = args[0]
        if op in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
            return self.call(aten.reshape.default, pair(source), [*args[1], 2])
        if op is aten.expand.default:
            return self.call(aten.expand.default, pair(source), [*args[1], 2])
        if op is aten.unsqueeze.default:
            return self.call(op, pair(source), args[1] if args[1] >= 0 else args[1] - 1)
        if op in (aten.squeeze.dim, aten.select.int, aten.slice.Tensor):  # (self, dim, ...)
            dim = args[1] if len(args) > 1 else 0
            return self.call(op, pair(source), _dim(dim), *args[2:])
        if op is aten.transpose.int:
            return self.call(op, pair(source), _dim(args[1]), _dim(args[2]))
        if op is aten.squeeze.dims:
            return self.call(op, pair(source), [_dim(d) for d in args[1]])
        if op is aten.permute.default:
            rank = len(args[1])
            return self.call(op, pair(source), [d % rank for d in args[1]] + [rank])
        if op is aten.flatten.using_ints:
            start = args[1] if len(args) > 1 else 0
            end = args[2] if len(args) > 2 else -1
            return self.call(op, pair(source), _dim(start), _dim(end))
        if op in (aten.cat.default, aten.stack.default):  # a dim of the result, made non-negative
            dim = (args[1] if len(args) > 1 else 0) % len(node.meta["val"].shape)
            return self.call(op, [pair(t) for t in source], dim)
        if op is operator.getitem:
            return self.call(operator.getitem, pair(source), args[1])
        raise self._unsupported(node)

    def _unsupported(self, node: torch.fx.Node, how: str = "") -> UserInputError:
        return UserInputError(
            f"the complex op {node.target} of {node.name}{' ' + how if how else ''} has no real-pair form here",
            stage=STAGE, nodes=[node.name],
            hint="write it with torch.view_as_real pairs in the model, or report the op to add its formula",
        )

    def _rename_output(self, old: torch.fx.Node, new: torch.fx.Node) -> None:
        from compiler.ir.graph import rename_output

        rename_output(self.ep, old.name, new.name)


def complex_as_real_pairs(ep: ExportedProgram) -> int:
    """Rewrites every complex value of `ep` in place as real pairs; returns how many complex
    values there were (0: the program computes no complex number, and is left as it was)."""
    if not any(_is_complex(v) for n in ep.graph.nodes for v in torch.utils._pytree.tree_leaves(n.meta.get("val"))):
        return 0
    count = _Rewriter(ep).run()
    logger.info("capture: %d complex value(s) as real pairs", count)
    return count
