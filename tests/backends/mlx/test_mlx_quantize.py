"""Weight-only quantization for MLX: 4w and 8w, groups of 32, 64 and 128 elements and per
channel, Linear and Embedding weights. Each program is placed on MLX with a reason, its
payloads run in the MLX runner, and it matches the eager quantized model (not the float one)."""

import copy

import pytest
import torch
from torch import nn

import compiler
from compiler.backends.mlx import support
from compiler.backends.mlx.generated import ensure_generated
from compiler.backends.mlx.interpreter import MLXGraph
from compiler.ir.dialect import op_name
from compiler.models.examples import mlp, transformer
from compiler.running.reference import ReferenceExecutor
from compiler.running.runtime import compare_with_eager

# Eager TorchAO dequantizes as s * (q - z); MLX packs s * Q + B (Q = q + 2**(bits-1)), so
# the two round apart by a few float32 ulps of the weight.
TOLERANCE = 1e-5
DEQUANTIZE = "torchao.dequantize_affine.default"
GROUPS = (32, 64, 128, "per_channel")


class TinyLM(nn.Module):
    """Embedding, one Linear with a bias, and an lm_head without one (tied: the embedding's table)."""

    def __init__(self, vocab: int = 64, dim: int = 128, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.relu(self.proj(self.embed(ids))))


def _tiny_lm(tied: bool = False, dim: int = 128):
    torch.manual_seed(0)
    return TinyLM(dim=dim, tied=tied).eval(), (torch.randint(0, 64, (1, 8)),)


def _options(bits: str, group, embedding: bool = True) -> dict:
    """The compile options for `bits` with `group` (a group size or "per_channel"), for the
    Linear weights and, with `embedding`, the Embedding tables too."""
    linear = {"quantize_granularity": "per_channel"} if group == "per_channel" else {"quantize_group_size": group}
    tables = {"quantize_embedding": bits, "quantize_embedding_group_size": 0 if group == "per_channel" else group}
    return {"quantize": bits, **linear, **(tables if embedding else {})}


def _payload_nodes(result) -> list[str]:
    """The node types of every MLX payload in the program, in order."""
    ensure_generated()
    program = ReferenceExecutor(result.pte).program
    kinds = []
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            graph = MLXGraph(bytes(program.backend_delegate_data[delegate.processed.index].data))
            kinds += [node.kind for chain in graph.chains for node in chain]
    return kinds


def _quantized_nodes(result) -> dict[torch.fx.Node, str]:
    """Every node of the partitioned program that dequantizes a weight or reads one -> its
    placement reason, which the placement report shows."""
    partitioned = result.stages["partition"]
    quantized = support.quantized_weight_reasons(partitioned.program)
    placed = {p.node: p.reason for p in partitioned.plan.nodes}
    nodes = [n for n in partitioned.program.graph.nodes if n.name in quantized]
    assert all(placed[n.name] == quantized[n.name] for n in nodes), (placed, quantized)
    return {n: placed[n.name] for n in nodes}


def _compile_and_check(model, inputs, **options):
    """Compile for MLX, run it, and compare with the eager quantized and the float model."""
    result = compiler.compile(model, inputs, "mlx", **options)
    quantized = compare_with_eager(result, result.stages["quantize"].module, inputs, tolerance=TOLERANCE)
    assert quantized.passed, quantized.describe()
    float_model = compare_with_eager(result.pte, model, inputs)  # the bytes: a CompileResult is compared with its quantized model
    assert float_model.max_abs_error > 100 * max(quantized.max_abs_error, 1e-7), float_model.describe()
    assert result.program.delegates == ("MLXBackend",)
    assert result.program.operators == ()  # nothing on the CPU
    for node, reason in _quantized_nodes(result).items():
        assert node.meta.get("delegation_tag", "").startswith("mlx"), (node.name, reason)
        assert reason, node.name
    return result


@pytest.mark.parametrize("bits", ["4w", "8w"])
@pytest.mark.parametrize("group", GROUPS)
def test_linear_and_embedding_stay_quantized(bits, group):
    """Each Linear is one QuantizedMatmulNode on the packed weight; the embedding gathers its
    packed rows and dequantizes only those; no weight becomes float."""
    model, inputs = _tiny_lm()
    result = _compile_and_check(model, inputs, **_options(bits, group))
    nodes = _payload_nodes(result)
    assert nodes.count("QuantizedMatmulNode") == 2
    assert nodes.count("DequantizeNode") == 1 and "TakeNode" in nodes
    assert "AddmmNode" not in nodes and "MatmulNode" not in nodes
    reasons = _quantized_nodes(result)
    for node, reason in reasons.items():
        if op_name(node.target) == "aten.linear.default":
            assert "QuantizedMatmulNode" in reason and f"{bits[0]}-bit" in reason, reason
        if op_name(node.target) == "aten.embedding.default":
            assert "gathers" in reason, reason


def test_tied_embedding_packed_once_for_both_readers():
    """An embedding table quantized once and read also by the lm_head (ExecuTorch's LLM export
    re-ties them): the payload holds one packed table, which the embedding gathers from and
    the lm_head multiplies by, each without dequantizing the whole table."""
    from executorch.extension.llm.export.quantize import quantize_model_

    model, inputs = _tiny_lm(tied=True)
    quantized = copy.deepcopy(model)
    quantize_model_(quantized, qembedding_config="4w", qembedding_group_size=32)
    quantized.lm_head.weight = quantized.embed.weight
    result = compiler.compile(quantized, inputs, "mlx")
    check = compare_with_eager(result, quantized, inputs, tolerance=TOLERANCE)
    assert check.passed, check.describe()
    assert result.program.operators == ()
    packed = [key for key in ReferenceExecutor(result.pte).named_data if key.endswith("_to_packed")]
    assert len(packed) == 1, packed
    reasons = {op_name(node.target): reason for node, reason in _quantized_nodes(result).items()}
    assert "QuantizedMatmulNode" in reasons["aten.linear.default"], reasons
    assert "gathers" in reasons["aten.embedding.default"], reasons


def test_groups_of_16_dequantize_then_multiply_in_float():
    """MLX's quantized matmul takes groups of 32, 64 or 128: a weight quantized in groups of 16
    (ExecuTorch's LLM export makes one; our quantize stage refuses 16 for MLX) is dequantized
    by MLX (DequantizeNode) and multiplied in float, and its reason says so."""
    from executorch.extension.llm.export.quantize import quantize_model_

    model, inputs = mlp(features=64, hidden=64, layers=2)
    quantized = copy.deepcopy(model)
    quantize_model_(quantized, qlinear_config="4w", qlinear_group_size=16)
    result = compiler.compile(quantized, inputs, "mlx")
    check = compare_with_eager(result, quantized, inputs, tolerance=TOLERANCE)
    assert check.passed, check.describe()
    assert result.program.operators == ()
    assert "QuantizedMatmulNode" not in _payload_nodes(result)
    reasons = _quantized_nodes(result)
    assert {op_name(n.target) for n in reasons} == {DEQUANTIZE, "aten.linear.default"}
    for node, reason in reasons.items():
        assert node.meta.get("delegation_tag", "").startswith("mlx"), (node.name, reason)
        if op_name(node.target) == DEQUANTIZE:
            assert "groups of 16" in reason and "QuantizedMatmulNode" not in reason, reason


class OddRows(nn.Module):
    """Rows of 40 elements: per channel, a group of 40, which no MLX group size divides."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 40)
        self.proj = nn.Linear(40, 16)

    def forward(self, ids):
        return self.proj(self.embed(ids))


@pytest.mark.parametrize("bits", ["4w", "8w"])
def test_weights_mlx_cannot_hold_are_float_with_a_reason(bits):
    """MLX holds quantized weights in groups of 16, 32, 64 or 128 elements; a row of 40
    cannot be grouped so. Such a weight is stored dequantized (float) for MLX, which computes
    what the eager quantized model does, and the readers' reasons say why; it used to stay on
    the CPU as torchao.dequantize_affine, which the ExecuTorch runtime has no kernel for."""
    torch.manual_seed(0)
    model, inputs = OddRows().eval(), (torch.randint(0, 50, (2, 5)),)
    result = _compile_and_check(model, inputs, **_options(bits, "per_channel"))
    assert "QuantizedMatmulNode" not in _payload_nodes(result)
    reasons = _quantized_nodes(result)
    assert {op_name(n.target) for n in reasons} == {"aten.linear.default", "aten.embedding.default"}
    assert all("groups of 40" in r and "float" in r for r in reasons.values()), reasons


@pytest.mark.parametrize("options", [{"quantize": "4w"}, {"quantize": "8w", "quantize_granularity": "per_channel"}])
def test_bfloat16_product_accumulates_in_float32(options):
    """MLX's Metal kernels accumulate a quantized product in float32 whatever the input's
    dtype; mlx's CPU kernel accumulates in bfloat16, 8 to 11 ulps of the output off eager
    here. The runner computes as the device does: within about one ulp."""
    torch.manual_seed(0)
    model = nn.Linear(512, 64).to(torch.bfloat16).eval()
    inputs = (torch.randn(8, 512, dtype=torch.bfloat16),)
    result = compiler.compile(model, inputs, "mlx", **options)
    check = compare_with_eager(result.pte, result.stages["quantize"].module, inputs)
    ulp = check.largest_expected * torch.finfo(torch.bfloat16).eps
    assert check.max_abs_error <= 2 * ulp, check.describe()


def test_transformer_4w():
    model, inputs = transformer(depth=1, dim=128, heads=4, seq=8)
    result = _compile_and_check(model, inputs, quantize="4w", quantize_group_size=64)
    assert _payload_nodes(result).count("QuantizedMatmulNode") == 4


def test_per_channel_is_a_granularity_mlx_takes():
    from compiler.stages import schemes

    for name in ("4w", "8w"):
        assert set(schemes.BY_NAME[name].granularities("mlx")) == {"per_group", "per_channel"}


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["4w", "8w"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", ["mlp", "tied", "embedding_only", "transformer"])
def test_every_variant(bits, group, case):
    if case == "mlp":
        model, inputs = mlp(features=128, hidden=256)
        options = _options(bits, group, embedding=False)
    elif case == "transformer":
        model, inputs = transformer(depth=2, dim=128, heads=4, seq=8)
        options = _options(bits, group, embedding=False)
    else:
        model, inputs = _tiny_lm(tied=case == "tied")
        options = _options(bits, group)
        if case == "embedding_only":
            del options["quantize"]
            options.pop("quantize_group_size", None)
            options.pop("quantize_granularity", None)
    _compile_and_check(model, inputs, **options)
