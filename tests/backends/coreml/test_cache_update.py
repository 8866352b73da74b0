"""A KV cache written at a dynamic number of positions (a prompt of any length, then tokens) as
Core ML state: the update converts to a slice_update at consecutive positions, to a scatter at any
others; integer buffers stay the CPU's; a dynamic size read in two partitions is read in each."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compiler
from compiler.ir.graph import DELEGATION_TAG
from coreml_helpers import compile_coreml, cpu_ops, delegated_ops, models, stock_error

CACHE = 16
SEQ = torch.export.Dim("seq", min=1, max=CACHE)


class CachedAttention(nn.Module):
    """One attention layer over a static KV cache, written as transformers' StaticCache writes it:
    at `arange(new tokens) + length`, `length` an int64 buffer counting the tokens written."""

    def __init__(self, dim=16, heads=2, consecutive=True):
        super().__init__()
        self.heads, self.head_dim, self.consecutive = heads, dim // heads, consecutive
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("k_cache", torch.zeros(1, heads, CACHE, dim // heads))
        self.register_buffer("v_cache", torch.zeros(1, heads, CACHE, dim // heads))
        self.register_buffer("length", torch.zeros(1, dtype=torch.long))
        self.register_buffer("slots", torch.arange(CACHE), persistent=False)

    def forward(self, x, pos):
        tokens = x.shape[1]
        q, k, v = (t.view(1, tokens, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        # consecutive=False: the positions as given, which the graph cannot show consecutive
        positions = torch.arange(tokens) + self.length if self.consecutive else pos
        self.length.add_(tokens)
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        mask = self.slots[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)


def _prompt_then_tokens(lengths):
    """Calls of `lengths` tokens each, at the positions that follow one another."""
    calls, start = [], 0
    for tokens in lengths:
        calls.append(("forward", (torch.randn(1, tokens, 16), torch.arange(start, start + tokens))))
        start += tokens
    return calls


def _compile(model, **options):
    example = (torch.randn(1, 2, 16), torch.arange(2))
    return compiler.compile(
        model, example, "coreml", backend_options={"minimum_deployment_target": "iOS18", **options},
        dynamic_shapes=({1: SEQ}, {0: SEQ}),
    )


def _buffer_tags(result) -> dict[str, str | None]:
    program = result.stages["partition"].program
    buffers = program.graph_signature.inputs_to_buffers
    return {buffers[n.name]: n.meta.get(DELEGATION_TAG) for n in program.graph.nodes if n.name in buffers}


def test_cache_written_at_a_dynamic_number_of_positions_is_core_ml_state():
    # Before: CoreMLStateSplit at partition, the update (index_put of several positions next to
    # slices) on the CPU while the attention in Core ML owned the cache.
    torch.manual_seed(0)
    model = CachedAttention().eval()
    result = _compile(model)
    assert not cpu_ops(result)
    tags = _buffer_tags(result)
    assert tags["k_cache"] and tags["v_cache"], "the caches are Core ML state"
    assert tags["length"] is None, "Core ML state is float16: the int64 count stays a CPU buffer"
    assert "length" in result.stages["lower"].program.graph_signature.buffers_to_mutate.values()
    (payload,) = models(result)
    assert len(payload.ops_of_type("slice_update")) == 2 and not payload.ops_of_type("scatter")
    assert len(payload.ops_of_type("write_state")) == 2
    # The state carries from call to call: a prompt of 4, a token, 3, a token, 5.
    check = compiler.check_methods(result, _prompt_then_tokens([4, 1, 3, 1, 5]), eager={"forward": model})
    assert check.passed, check.describe()
    assert check.methods[0].worst_error < 3e-3  # float16


def test_positions_the_graph_cannot_show_consecutive_are_scattered():
    torch.manual_seed(0)
    model = CachedAttention(consecutive=False).eval()
    result = _compile(model)
    assert not cpu_ops(result)
    (payload,) = models(result)
    assert len(payload.ops_of_type("scatter")) == 2 and not payload.ops_of_type("slice_update")
    calls = _prompt_then_tokens([4, 1, 3])
    calls.append(("forward", (torch.randn(1, 3, 16), torch.tensor([11, 9, 13]))))  # any positions
    check = compiler.check_methods(result, calls, eager={"forward": model})
    assert check.passed and check.methods[0].worst_error < 3e-3, check.describe()


class IndexPut(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write

    def forward(self, y, v):
        y = y.clone()
        self.write(y, v)
        return y.float() * 2


def _two_columns(y, v):
    y[:, torch.tensor([0, 2])] = v


def _two_consecutive_columns(y, v):
    y[:, torch.tensor([1, 2])] = v


@pytest.mark.parametrize(
    "write, inputs, target, mil_op",
    [
        (_two_columns, (torch.randn(2, 4, 3), torch.randn(2, 2, 3)), None, "scatter"),
        # The default run samples two forms; -m slow adds the rest.
        pytest.param(_two_columns, (torch.randn(2, 4, 3), torch.randn(3)), None, "scatter",  # values broadcast
                     marks=pytest.mark.slow),
        pytest.param(_two_columns, (torch.randn(2, 4, 3) > 0, torch.randn(2, 2, 3) > 0), None, "scatter",  # bool data
                     marks=pytest.mark.slow),
        (_two_consecutive_columns, (torch.randn(2, 4, 3), torch.randn(2, 2, 3)), "iOS18", "slice_update"),
        pytest.param(_two_consecutive_columns, (torch.randn(2, 4, 3), torch.randn(2, 2, 3)), None, "scatter",
                     marks=pytest.mark.slow),  # before iOS 18
    ],
    ids=["any-positions", "values-broadcast", "bool", "consecutive-ios18", "consecutive-ios17"],
)
def test_index_of_several_entries_next_to_slice_runs_in_core_ml(write, inputs, target, mil_op):
    model = IndexPut(write)
    assert "Input squeeze_0 has rank 1 != other inputs rank 0" in stock_error(model, inputs)
    result = compile_coreml(model, inputs, **({"minimum_deployment_target": target} if target else {}))
    assert "aten.index_put.default" in delegated_ops(result) and not cpu_ops(result)
    (payload,) = models(result)
    assert payload.ops_of_type(mil_op)
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.passed, check


class SizeReadInTwoPartitions(nn.Module):
    """Reshapes by the dynamic length before and after an op kept on the CPU: one `sym_size`,
    read in both Core ML partitions."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        heads = self.linear(x).view(1, x.shape[1], 2, 4)
        return self.linear(torch.cumsum(heads, -1).reshape(1, x.shape[1], 8))


@pytest.mark.slow  # 7-8 s: over the default run's budget; runs with -m slow
def test_a_dynamic_size_read_in_two_partitions_is_read_in_each():
    # Before: lower failed in coremltools, "Placeholder val must be a tensor or fake tensor, but
    # got SymInt": the second partition took the size from the first as an input.
    torch.manual_seed(0)
    model = SizeReadInTwoPartitions().eval()
    result = compiler.compile(
        model, (torch.randn(1, 3, 8),), "coreml",
        backend_options={"skip_ops_for_coreml_delegation": ["aten.cumsum.default"]},
        dynamic_shapes=({1: torch.export.Dim("seq", min=1, max=16)},),
    )
    sizes = [p for p in result.program.plan.nodes if p.op == "aten.sym_size.int"]
    assert len(sizes) == 2 and len({p.tag for p in sizes} - {None}) == 2, sizes
    for tokens in (1, 5, 16):
        check = compiler.compare_with_eager(result, model, (torch.randn(1, tokens, 8),))
        assert check.passed, check


@pytest.mark.slow
@pytest.mark.parametrize("take_over_mutable_buffer", [True, False])
def test_llama_prefills_a_prompt_in_one_call_on_core_ml(take_over_mutable_buffer):
    # Before: CoreMLStateSplit at partition; with take_over_mutable_buffer=False, the SymInt
    # placeholder at lower.
    job = compiler.generate(
        "llama", "coreml", tokens=8, check=True, max_cache_len=24, dynamic_prefill=True,
        backend_options={"take_over_mutable_buffer": take_over_mutable_buffer},
    )
    assert job.check.passed, job.check.describe()
    assert job.check.program_tokens == job.check.eager_tokens and len(job.check.program_tokens) == 8
    assert not cpu_ops(job.result)
