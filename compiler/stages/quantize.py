"""Quantize: the eager model -> the eager quantized model, by a named scheme for the backend.

It runs before capture, as ExecuTorch's recipes do (a TorchAO source transform, or PT2E's
export, prepare, calibrate and convert), so capture traces the quantized model and every
later stage, the stage cache and the check see it. The quantized model is a module that
runs eagerly (PT2E's converted graph, or the model with TorchAO's quantized weights): the
reference `--check` compares the program with. The user's module is never changed: TorchAO
replaces weights on a copy of the module tree that shares the other tensors.

Which schemes a backend takes, with which granularities, is its entry in `compiler.ir.targets`
(the schemes themselves: `compiler/stages/schemes.py`); what code a backend brings (its PT2E
quantizer, its own TorchAO config, the layers its kernels cannot take) its `Backend` class says.
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any, Callable

import attrs
import torch

from compiler import backends
from compiler.ir import targets
from compiler.ir.artifacts import EagerModel
from compiler.ir.errors import UserInputError
from compiler.ir.mapped import pages_released_as_it_runs
from compiler.passes.mapped_quantization import quantize_layers
from compiler.stages import schemes
from compiler.stages.base import Stage, StageContext
from compiler.stages.options import QuantizeOptions
from compiler.stages.schemes import PER_CHANNEL, PER_GROUP, PT2E, Scheme, chosen_scheme
from compiler.reporting.report import Metric, counted

logger = logging.getLogger(__name__)
STAGE = "quantize"
# A layer the example inputs never call: the model reads its weight itself, if at all, and a
# quantized weight cannot be read so (TorchAO's tensors refuse `unsqueeze`, `t`, ...).
NOT_CALLED = "the example inputs never call it (the model reads its weight itself, if at all): a quantized weight cannot be read so"


def check_calibration(options: QuantizeOptions, backend: str, calibration: Any) -> None:
    """A static scheme without calibration inputs is an error before any stage runs."""
    chosen = chosen_scheme(options, backend)
    if chosen and chosen[0].needs_calibration and not calibration:
        raise UserInputError(
            f"the quantize scheme {chosen[0].name!r} is static: its activation scales come from calibration "
            "inputs, and none were given",
            stage=STAGE,
            hint="pass calibration=[inputs, ...] to compiler.compile (an iterable of input tuples); on the CLI "
            "--calibration FILE (a torch.save'd list of input tuples) or --calibration-draws N",
        )


def coded_weights(module: torch.nn.Module, options: QuantizeOptions, backend: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The weights `options` turn into 4- or 8-bit codes on `backend` (each Linear's, for a scheme
    that quantizes weights; a layer the stage leaves in float is counted as coded), and those of
    them another layer also reads in float (a tied embedding the scheme cannot follow: it stays in
    float beside its codes). The memory check's estimate counts them as codes."""
    chosen = chosen_scheme(options, backend)
    if chosen is None or not chosen[0].weight_bits:
        return [], []
    coded = [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)]
    if _embedding_scheme(options, backend, tied=True) is not None:
        return coded, []
    others = {id(p) for m in module.modules() if not isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)}
    return coded, [w for w in coded if id(w) in others]


def _embedding_scheme(options: QuantizeOptions, backend: str, tied: bool) -> str | None:
    """The weight-only scheme Embedding tables get: the one the user asked for, else, for a table
    tied to a Linear the scheme codes (GPT-2's and Llama's `lm_head`), the scheme's own weight
    bits; left in float, the table would be held twice, in float and in codes (GPT-2 small: 154 MB
    of a 235 MB `8da4w` program). None: tables stay in float."""
    if options.embedding is not None:
        return options.embedding
    chosen = chosen_scheme(options, backend)
    if not tied or chosen is None or targets.BY_NAME[backend].no_table_quantization or chosen[0].weight_bits not in (4, 8):
        return None
    return f"{chosen[0].weight_bits}w"


def _tied_embeddings(module: torch.nn.Module) -> bool:
    """Whether an Embedding's table is also a Linear's weight."""
    linear = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)}
    return any(id(m.weight) in linear for m in module.modules() if isinstance(m, torch.nn.Embedding))


def torchao_config(scheme: Scheme, granularity: str, group_size: int, backend: str, bits: int = 4) -> Any:
    """The TorchAO config of a scheme on a backend: the stage's and the fuzzer's oracle's one source."""
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig

    grain = PerAxis(0) if granularity == PER_CHANNEL else PerGroup(group_size)
    dtype = {4: torch.int4, 8: torch.int8}.get(scheme.weight_bits)
    if scheme.name == "codebook":
        from torchao.prototype.quantization.codebook_coreml import CodebookWeightOnlyConfig

        return CodebookWeightOnlyConfig(dtype=getattr(torch, f"uint{bits}"), block_size=[-1, group_size])
    if scheme.activations == schemes.DYNAMIC:
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=grain)
    own = backends.load(backend).weight_only_config(scheme.weight_bits, group_size if granularity == PER_GROUP else None)
    return own if own is not None else IntxWeightOnlyConfig(weight_dtype=dtype, granularity=grain)


def _module_tree_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module objects that shares every parameter and buffer: TorchAO sets new
    weights on the copy, and the user's model keeps its own."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def _is_conv1d(layer: torch.nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2's layers): a Linear whose weight is stored (in, out), applied
    with addmm. A model holding one has imported transformers already."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(layer, pytorch_utils.Conv1D)


def _conv1d_as_linear(module: torch.nn.Module) -> int:
    """Each Conv1D of `module` (a tree copy) replaced by the Linear it is, its weight the same
    storage transposed, its bias the same: the schemes that take Linears take them (a scheme
    left GPT-2 in float but its lm_head). Returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not _is_conv1d(child):
                continue
            linear = torch.nn.Linear(child.weight.shape[0], child.nf, bias=child.bias is not None, device="meta")
            linear.weight = torch.nn.Parameter(child.weight.detach().t(), requires_grad=False)
            if child.bias is not None:
                linear.bias = child.bias
            setattr(parent, name, linear)
            swapped += 1
    return swapped


@attrs.frozen
class _Calls:
    """What one eager run on the example inputs shows of the layers a scheme may take."""

    called: frozenset[str]  # the modules whose forward ran
    one_dimensional: frozenset[str]  # the Linears reached with a 1-D input


def _observe_calls(model: EagerModel) -> _Calls:
    called: set[str] = set()
    one_dimensional: set[str] = set()

    def noting(name: str) -> Callable:
        def note(module: torch.nn.Module, args: tuple) -> None:
            called.add(name)
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 1:
                one_dimensional.add(name)

        return note

    hooks = [
        m.register_forward_pre_hook(noting(name))
        for name, m in model.module.named_modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
    ]
    try:
        with torch.no_grad(), pages_released_as_it_runs(model.module):
            model.module(*model.example_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return _Calls(frozenset(called), frozenset(one_dimensional))


def _why_left_in_float(module: torch.nn.Module, fqn: str, scheme: Scheme, granularity: str, group_size: int | None,
                       backend: str | None, one_dimensional: frozenset[str]) -> str | None:
    """Why a layer of the kind a scheme quantizes stays in float (None: it is quantized).
    ExecuTorch's LLM export skips layers whose rows do not split into groups the same way."""
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "nn.MultiheadAttention's output projection: attention reads its weight itself, as a plain tensor"
    columns = module.weight.shape[-1]
    if group_size and columns % group_size:
        return f"{columns} input features are not a multiple of the group size {group_size}"
    if granularity == PER_CHANNEL and columns == 1:
        return "one input feature: TorchAO's per-channel quantization cannot pack a single column"
    if backend is None:
        return None
    return backends.load(backend).why_layer_stays_float(scheme, columns, fqn in one_dimensional)


def _quantize_layers(
    module: torch.nn.Module, config: Any, kind: Callable[[torch.nn.Module], bool], left: dict[str, str],
    why_not: Callable[[torch.nn.Module, str], str | None],
) -> None:
    """TorchAO's config on the modules `kind` picks but those `why_not` names a reason for,
    which are left in float, each with why in `left`."""
    taken: list[str] = []
    for fqn, layer in module.named_modules():
        if not kind(layer):
            continue
        why = why_not(layer, fqn)
        if why:
            left[fqn or type(layer).__name__] = why
        else:
            taken.append(fqn)
    quantize_layers(module, config, taken)


def quantize_model(model: EagerModel, options: QuantizeOptions, backend: str) -> tuple[torch.nn.Module, dict]:
    """The eager quantized module, and what the report says of it. Embedding tables first:
    PT2E's converted graph has no Embedding modules left for TorchAO to find."""
    chosen = chosen_scheme(options, backend)
    metrics: dict[str, Any] = {}
    left: dict[str, str] = {}  # layer -> why the scheme left it in float
    module = model.module
    embedding_scheme = _embedding_scheme(options, backend, tied=_tied_embeddings(module))
    if embedding_scheme is not None:
        module = _module_tree_copy(module)
        embedding = schemes.BY_NAME[embedding_scheme]
        if options.embedding is None:  # following the scheme: its granularity and group
            group = options.group_size if chosen[1] == PER_GROUP else 0
        else:
            group = options.embedding_group_size
        granularity = PER_GROUP if group else PER_CHANNEL
        config = torchao_config(embedding, granularity, group, backend)
        linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)}

        def table(layer: torch.nn.Module) -> bool:  # every table asked for, or the tied ones followed
            return isinstance(layer, torch.nn.Embedding) and (options.embedding is not None or id(layer.weight) in linear_weights)

        calls = _observe_calls(model)

        def why_not_table(layer: torch.nn.Module, fqn: str) -> str | None:
            if fqn not in calls.called:  # ACT's `pos_embed.weight.unsqueeze(1)`
                return NOT_CALLED
            return _why_left_in_float(layer, fqn, embedding, granularity, group or None, None, frozenset())

        _quantize_layers(module, config, table, left, why_not_table)
        metrics["embedding"] = embedding_scheme + (" (tied to a quantized Linear)" if options.embedding is None else "")
    if chosen is not None and any(_is_conv1d(m) for m in module.modules()):
        if module is model.module:
            module = _module_tree_copy(module)
        metrics["conv1d_as_linear"] = _conv1d_as_linear(module)
        model = attrs.evolve(model, module=module)
    if chosen is not None:
        scheme, granularity = chosen
        metrics.update(scheme=scheme.name, granularity=granularity)
        if granularity == PER_GROUP:
            metrics["group_size"] = options.group_size
        if scheme.flow == PT2E:
            module = _pt2e(attrs.evolve(model, module=module), backends.load(backend).pt2e_quantizer(scheme, granularity))
        else:
            calls = _observe_calls(model)
            one_dimensional = calls.one_dimensional if scheme.activations == schemes.DYNAMIC else frozenset()
            if module is model.module:
                module = _module_tree_copy(module)
            config = torchao_config(scheme, granularity, options.group_size, backend, options.bits)
            group = options.group_size if granularity == PER_GROUP else None
            # Linear layers only (ExecuTorch's codebook recipe palettizes Embedding tables too, but
            # models read those weights themselves: ACT's `pos_embed.weight.unsqueeze(1)` fails on
            # TorchAO's CodebookQuantizedTensor); --quantize-embedding quantizes tables.
            _quantize_layers(
                module, config, lambda layer: isinstance(layer, torch.nn.Linear), left,
                lambda layer, fqn: _why_left_in_float(layer, fqn, scheme, granularity, group, backend, one_dimensional)
                or (NOT_CALLED if fqn not in calls.called else None),
            )
    if left:
        metrics["left_in_float"] = "; ".join(f"{fqn}: {why}" for fqn, why in left.items())
    return module, metrics


def _pt2e(model: EagerModel, quantizer: Any) -> torch.nn.Module:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    with torch.no_grad():
        graph = torch.export.export(model.module, model.example_inputs, dynamic_shapes=model.dynamic_shapes).module()
        prepared = prepare_pt2e(graph, quantizer)
        for inputs in model.calibration or (model.example_inputs,):
            prepared(*inputs)
        return convert_pt2e(prepared)


class Quantize(Stage, takes=EagerModel, returns=EagerModel):
    metrics = (
        Metric.plain("embedding", "text"),
        Metric("conv1d_as_linear", "count",
               lambda n: f"quantized {counted(n, 'Conv1D layer')} as the Linear it is (weight transposed)"),
        Metric.plain("scheme", "text"),
        Metric.plain("granularity", "text"),
        Metric.plain("group_size", "count"),
        Metric.plain("left_in_float", "text"),
    )

    def apply(self, model: EagerModel, ctx: StageContext) -> EagerModel:
        if ctx.options.scheme is None and ctx.options.embedding is None:
            return model
        module, metrics = quantize_model(model, ctx.options, ctx.backend.name)
        ctx.metrics.update(metrics)
        return EagerModel(module, model.example_inputs, model.dynamic_shapes, model.calibration, float_module=model.module)
