"""How much a quantized model's outputs move when its activations round one step otherwise.

A program that quantizes activations rounds them by its own arithmetic: XNNPACK computes a
dynamic scale per row where PT2E's reference takes one per tensor, and its own rounding of
static requantization. Each quantized value may so differ by up to one step from the eager
quantized model's, and the difference goes on through every later op. The eager quantized
model run with each activation quantizer's result moved one step (random signs) measures
that on the check's own inputs, through the model's own ops; a check adds it to its tolerance.

The quantizers are found as they run: PT2E's `quantized_decomposed.quantize_per_tensor` /
`quantize_per_token` ops (static scales are their constants; dynamic ones come from
`choose_qparams` at run time), TorchAO's weights that quantize their GEMM's input per
token (`activation_quantization`), whose scale is `choose_qparams_affine`'s for that input, and
TorchAO's `quantize_affine` ops in an exported graph (the reference of a quantized bfloat16 model
computing in float32 is its precision stage's program, where TorchAO's weights are ops). TorchAO's
op is seen as a call (a torch function mode): it runs as aten ops below.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

DRAWS = 4

# PT2E's activation quantize ops: (input, scale, zero_point, quant_min, quant_max, dtype).
_PT2E_QUANTIZE_NAMES = ("quantize_per_tensor.default", "quantize_per_tensor.tensor", "quantize_per_tensor.tensor2",
                        "quantize_per_token.default")


def _pt2e_quantize_ops() -> frozenset:
    """Those registered (a model that runs them has registered them)."""
    namespace = torch.ops.quantized_decomposed
    ops = set()
    for name in _PT2E_QUANTIZE_NAMES:
        packet, overload = name.split(".")
        if hasattr(namespace, packet) and overload in getattr(namespace, packet).overloads():
            ops.add(getattr(getattr(namespace, packet), overload))
    return frozenset(ops)


def _torchao_quantize_op() -> Any:
    """TorchAO's `quantize_affine` op, None when TorchAO has not registered it."""
    packet = getattr(torch.ops.torchao, "quantize_affine", None) if hasattr(torch.ops, "torchao") else None
    return packet.default if packet is not None and "default" in packet.overloads() else None


@attrs.frozen
class ActivationSteps:
    """The model's activation quantizers as one run met them, and what a step of each does."""

    quantizers: int
    smallest: float  # the smallest and largest step (scale) among them
    largest: float
    deviation: float  # the largest change of any output over the draws
    draws: int = DRAWS


class _Moves:
    """Moves each quantized activation by one step (random signs), noting the steps."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.steps: list[torch.Tensor] = []

    def signs(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randint(0, 2, like.shape, generator=self.generator, dtype=torch.int32) * 2 - 1

    def note(self, scale: Any) -> None:
        self.steps.append(torch.as_tensor(scale, dtype=torch.float64).detach().flatten())


class _PT2EMoves(TorchDispatchMode):
    """The integer result of each activation quantize op, one step up or down (within its range)."""

    def __init__(self, moves: _Moves, ops: frozenset) -> None:
        super().__init__()
        self.moves, self.ops = moves, ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in self.ops:
            return out
        _, scale, _, quant_min, quant_max, *_ = args
        self.moves.note(scale)
        return (out.to(torch.int32) + self.moves.signs(out)).clamp(quant_min, quant_max).to(out.dtype)


class _TorchAOMoves(TorchFunctionMode):
    """A GEMM whose weight quantizes its input per token: its result plus the GEMM of one step
    of each input value (the GEMM is linear in its dequantized input)."""

    def __init__(self, moves: _Moves) -> None:
        super().__init__()
        self.moves = moves

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _torchao_quantize_op():
            return self._moved_quantize(out, *args, **kwargs)
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if func not in (torch.nn.functional.linear, torch.nn.functional.conv2d):
            return out
        if getattr(weight, "activation_quantization", None) is None:
            return out
        step = _per_token_step(args[0], weight.activation_quantization)
        self.moves.note(step)
        moved = self.moves.signs(args[0]).to(args[0].dtype) * step
        return out + func(moved, weight.dequantize(), None, *args[3:])

    def _moved_quantize(self, out, input, block_size, scale, zero_point, output_dtype, quant_min=None, quant_max=None):
        """`quantize_affine`'s integer result, one step up or down (within its range)."""
        limits = torch.iinfo(out.dtype)
        self.moves.note(scale)
        low, high = (limits.min if quant_min is None else quant_min), (limits.max if quant_max is None else quant_max)
        return (out.to(torch.int32) + self.moves.signs(out)).clamp(low, high).to(out.dtype)


def _per_token_step(activation: torch.Tensor, kind: Any) -> torch.Tensor:
    """The scale TorchAO's per-token asymmetric int8 quantization gives each row of `activation`."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8TensorActivationQuantization as Kind,
    )

    if kind != Kind.INT8_ASYM_PER_TOKEN:
        raise NotImplementedError(f"activation quantization {kind}: only int8 per token is known here")
    block = (1,) * (activation.dim() - 1) + (activation.shape[-1],)
    scale, _ = choose_qparams_affine(
        activation, MappingType.ASYMMETRIC, block, torch.int8, quant_min=-128, quant_max=127,
        zero_point_dtype=torch.int8,
    )
    return scale.reshape(*activation.shape[:-1], 1)


def _floating(outputs: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def quantizes_activations(module: Any) -> bool:
    """Whether `module` holds an activation quantizer: a PT2E quantize op in its graph, or a
    TorchAO weight that quantizes its GEMM's input."""
    ops = _pt2e_quantize_ops()
    for sub in module.modules() if isinstance(module, torch.nn.Module) else ():
        if isinstance(sub, torch.fx.GraphModule) and any(
            node.target in ops or node.target is _torchao_quantize_op() for node in sub.graph.nodes
        ):
            return True
        if getattr(getattr(sub, "weight", None), "activation_quantization", None) is not None:
            return True
    return False


def activation_steps(
    module: Callable, inputs: Sequence[Any], expected: Sequence[torch.Tensor], rewind: Callable[[], None]
) -> ActivationSteps:
    """What moving every quantized activation of `module` one step does to its outputs
    (`expected`: its outputs on `inputs`; `rewind` puts its state back as it was for them)."""
    ops = _pt2e_quantize_ops()
    expected = [t for t in expected if t.is_floating_point()]
    deviation, steps = 0.0, []
    for seed in range(DRAWS):
        moves = _Moves(seed)
        rewind()
        with torch.no_grad(), _TorchAOMoves(moves), _PT2EMoves(moves, ops):
            moved = _floating(module(*inputs))
        steps = moves.steps
        for got, want in zip(moved, expected, strict=True):
            if want.numel():
                deviation = max(deviation, (got.double() - want.double()).abs().max().item())
    every = torch.cat(steps)
    return ActivationSteps(len(steps), every.min().item(), every.max().item(), deviation)
