"""Decomposition node by node (compiler.passes.node_decompositions) against torch's retrace.

For each program the node-by-node path must give what `run_decompositions` gives, after the
decompose stage's own steps (kept ops restored, casts): the same nodes in the same order
with the same names, targets, arguments, values (dtype, shape, strides, storage offset,
requires_grad, which inputs' storage each shares), `tensor_meta`, `stack_trace`, `nn_module_stack`, `torch_fn`, `original_aten`
and `from_node`; the same signature and module call graph; and bit-equal outputs.
"""

import pytest
import torch
from torch.utils import _pytree as pytree

import compiler
from compiler.models import examples
from compiler.passes import node_decompositions
from compiler.passes.decomposition import decompose
from node_decomposition_checks import assert_same, both_paths, program_to_decompose
from tiny_models import AddMul, RandomProgram


class Views(torch.nn.Module):
    """Views, expands, slices, selects, transposes, unbinds and reshapes of non-contiguous values."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(12, 12)

    def forward(self, x):
        y = self.linear(x)
        a, b, c = y.chunk(3, dim=-1)
        t = a.transpose(0, 1)
        s = t[1:, ::2].contiguous()
        e = b[:, :1].expand(-1, 4) * c
        u = torch.unbind(y.view(2, 3, 3, 4), dim=1)
        r = u[0].reshape(2, -1) + u[2].flatten(1)
        sel = y.select(0, 1).unsqueeze(0).squeeze(0)
        return s.sum(0), e.permute(1, 0).reshape(-1), r, torch.narrow(sel, 0, 2, 5), y.t().contiguous().view(-1)


class ConvBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, groups=2)
        self.bn2 = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.nn.functional.hardswish(self.bn2(self.conv2(x)))
        x = torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(self.drop(x)).softmax(-1)


class MaskedAttention(torch.nn.Module):
    """Attention with a boolean mask, an additive mask made from it, a causal one, and GQA."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, mask, additive):
        q, k, v = (t.view(1, 4, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        bias = additive + torch.zeros(4, 4).masked_fill(mask.logical_not(), float("-inf"))
        b = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        c = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
        d = torch.nn.functional.scaled_dot_product_attention(q, k[:, :1], v[:, :1], enable_gqa=True)
        return (a + b + c + d).transpose(1, 2).reshape(1, 4, 16)


class BuffersAndConstants(torch.nn.Module):
    """A persistent buffer, a tensor constant and an integer input: the retrace's input order."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.rand(6) + 0.5)
        self.offset = torch.arange(6.0)
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x, index):
        y = self.linear(x * self.scale + self.offset)
        return torch.nn.functional.embedding(index, y), y.mean(dim=0, keepdim=True).expand(3, 6)


def _masked_attention():
    torch.manual_seed(0)
    mask = torch.tensor([[True, False, True, True]] * 4)
    return MaskedAttention().eval(), (torch.randn(1, 4, 16), mask, torch.randn(1, 2, 4, 4))


def _mha():
    """torch's attention module converts a boolean mask in place (`masked_fill_`)."""
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x, mask):
            return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]

    return Module(), (torch.randn(1, 4, 16), torch.tensor([[False, True, False, False]] * 4))


def _seeded(model, *inputs):
    def make():
        torch.manual_seed(0)
        return model().eval(), tuple(i() for i in inputs)

    return make


PROGRAMS = {
    "stack": lambda: examples.transformer(depth=3, dim=32, heads=4, seq=8),
    "mlp": lambda: examples.mlp(),
    "convnet": lambda: examples.convnet(),
    "conv_batchnorm": _seeded(ConvBatchNorm, lambda: torch.randn(1, 3, 12, 12)),
    "masked_attention": _masked_attention,
    "views": _seeded(Views, lambda: torch.randn(6, 12)),
    "addmul": _seeded(AddMul, lambda: torch.randn(2, 8)),
    "buffers_and_constants": _seeded(BuffersAndConstants, lambda: torch.randn(6, 6), lambda: torch.tensor([[0, 5], [2, 2]])),
    # Its input is named `input`, which a new fx graph renames `input_1` (a Python builtin).
    "sequential": _seeded(lambda: torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()), lambda: torch.randn(2, 16)),
}


# The default run: each program once, on a backend that keeps ops whole in it.
DEFAULT = [
    ("stack", "mlx"),
    ("mlp", "xnnpack"),
    ("convnet", "xnnpack"),
    ("conv_batchnorm", "mlx"),
    ("masked_attention", "mlx"),
    ("views", "xnnpack"),
    ("addmul", "portable"),
    ("buffers_and_constants", "mlx"),
    ("sequential", "coreml"),
]
EVERY = [
    pytest.param(name, backend, marks=() if (name, backend) in DEFAULT else pytest.mark.slow)
    for name in sorted(PROGRAMS)
    for backend in ("mlx", "xnnpack", "coreml", "portable")
]


@pytest.mark.parametrize("name,backend", EVERY)
def test_node_by_node_equals_torchs_retrace(name, backend):
    model, inputs = PROGRAMS[name]()
    program, keep = program_to_decompose(model, inputs, backend)
    reference, ours = both_paths(program, keep)
    assert_same(reference, ours, inputs)


@pytest.mark.slow
def test_benchmark_stack_at_its_size_equals_torchs_retrace():
    from benchmarks.compile_time import stack

    model, inputs = stack(2)
    program, keep = program_to_decompose(model, inputs, "mlx")
    assert keep  # linears, attention and GELU kept whole: twins in the decomposed program
    reference, ours = both_paths(program, keep)
    assert_same(reference, ours, inputs)


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["gpt2", "qwen3"])
def test_transformers_models_equal_torchs_retrace(builder):
    pytest.importorskip("transformers")
    from compiler.models import model_suite

    made = getattr(model_suite, builder)(layers=2) if builder == "qwen3" else model_suite.gpt2(layers=2, embd=32)
    torch.manual_seed(0)
    model, inputs = made[0].eval(), made[1]
    program, keep = program_to_decompose(model, inputs, "mlx")
    reference, ours = both_paths(program, keep)
    assert_same(reference, ours, inputs)


# --- what falls back ------------------------------------------------------------------------


def _export(model, inputs, **kwargs):
    with torch.no_grad():
        return torch.export.export(model.eval(), inputs, **kwargs)


class InPlace(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        return y


class Branch(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x):
        self.count.add_(1)
        return x + self.count


def _dynamic():
    return _export(AddMul(), (torch.randn(3, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))


INELIGIBLE = {
    "buffer mutation": (lambda: _export(Counter(), (torch.randn(4),)), "mut"),
    "fuzzed buffer copy": (lambda: _export(RandomProgram(), (torch.randn(2, 2, 4), torch.randn(4, 4))), "mut"),
    "attention module's mask": (lambda: _export(*_mha()), "mutable op"),
    "in-place op": (lambda: _export(InPlace(), (torch.randn(4),)), "mutable op"),
    "dynamic dim": (_dynamic, "symbolic"),
    "control flow": (lambda: _export(Branch(), (torch.randn(4),)), "higher-order"),
}


def _whole_retraces(program, monkeypatch) -> list[bool]:
    """Per call of torch's `run_decompositions` from now on: whether it retraced `program` itself."""
    calls = []
    original = torch.export.ExportedProgram.run_decompositions

    def spy(self, *args, **kwargs):
        calls.append(self is program)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", spy)
    return calls


@pytest.mark.parametrize("name", sorted(INELIGIBLE))
def test_ineligible_programs_fall_back_to_torchs_retrace(name, monkeypatch):
    make, why = INELIGIBLE[name]
    program = make()
    reason = node_decompositions.why_ineligible(program)
    assert reason is not None and why in reason, reason
    calls = _whole_retraces(program, monkeypatch)
    assert node_decompositions.decompose_by_node(program, {}) is None
    decompose(program, frozenset())
    assert calls[-1] is True  # torch's retrace of the program itself


def test_an_eligible_program_is_not_retraced_whole(monkeypatch):
    model, inputs = examples.transformer(depth=2, dim=32, heads=4, seq=8)
    program, keep = program_to_decompose(model, inputs, "mlx")
    retraced = _whole_retraces(program, monkeypatch)
    decompose(program, keep)
    assert True not in retraced  # only per-node programs, if any recipe was missing


def test_copies_of_a_node_are_decomposed_once():
    """The deeper stack holds more copies of each block, not more distinct nodes."""
    model, inputs = examples.transformer(depth=4, dim=32, heads=4, seq=8)
    program, keep = program_to_decompose(model, inputs, "mlx")
    node_decompositions._RECIPES.clear()
    decompose(program, keep)
    distinct = len(node_decompositions._RECIPES)
    nodes = sum(1 for n in program.graph.nodes if n.op == "call_function")
    assert distinct < nodes / 3


class Remainder(torch.nn.Module):
    def forward(self, a, b):
        return torch.remainder(a, b) + torch.remainder(a, 3)


def test_a_node_is_decomposed_again_when_the_table_or_a_switch_changes():
    """What a node decomposes into is remembered with the table and the switches that made it:
    integer `remainder` is ours with the kernel fix on, the portable kernel's with it off; a
    backend keeping an op whole takes it out of the table."""
    from compiler.ir import kernel_fixes

    program = _export(Remainder(), (torch.tensor([-2, 7, 5]), torch.tensor([5, -3, 2])))
    inputs = (torch.tensor([-2, 7, 5]), torch.tensor([5, -3, 2]))
    on_ref, on_ours = both_paths(program, frozenset())
    with kernel_fixes.fixes_off("integer_remainder"):
        off_ref, off_ours = both_paths(program, frozenset())
    assert_same(on_ref, on_ours, inputs)
    assert_same(off_ref, off_ours, inputs)
    targets = lambda p: [str(n.target) for n in p.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert targets(on_ours) != targets(off_ours)


def test_a_stack_is_decomposed_by_one_per_node_program(monkeypatch):
    """Attention kept whole gives its output other strides than the capture did, and the nodes
    after it other inputs: predicted before decomposing, so torch decomposes the distinct
    nodes once, in one program, not in a round per changed layout."""
    model, inputs = examples.transformer(depth=2, dim=32, heads=4, seq=8)
    program, keep = program_to_decompose(model, inputs, "mlx")
    calls = []
    original = node_decompositions._decompose_exported_program

    def spy(tiny, **kwargs):
        calls.append(sum(n.op == "placeholder" for n in tiny.graph.nodes))
        return original(tiny, **kwargs)

    monkeypatch.setattr(node_decompositions, "_decompose_exported_program", spy)
    node_decompositions._RECIPES.clear()
    reference, ours = both_paths(program, keep)
    assert len(calls) == 1
    assert_same(reference, ours, inputs)


def test_a_prediction_torch_cannot_decompose_alone_costs_only_itself(monkeypatch):
    """When the per-node program with the predicted nodes fails, the program's own nodes are
    decomposed without them, node by node still."""
    model, inputs = examples.transformer(depth=2, dim=32, heads=4, seq=8)
    program, keep = program_to_decompose(model, inputs, "mlx")
    sizes = []
    original = node_decompositions._recipes_for

    def first_fails(pending, table, context):
        sizes.append(len(pending))
        if len(sizes) == 1:
            raise node_decompositions._NotExact("a predicted node cannot be decomposed alone")
        return original(pending, table, context)

    monkeypatch.setattr(node_decompositions, "_recipes_for", first_fails)
    node_decompositions._RECIPES.clear()
    reference, ours = both_paths(program, keep)
    assert len(sizes) >= 3 and sizes[1] < sizes[0]  # then the missed layouts, one by one
    assert_same(reference, ours, inputs)


def test_copies_of_a_node_take_their_values_from_the_first_ones_form(monkeypatch):
    """A kept op's value (linear, attention, GELU: no-decompose twins, which the fake mode's
    cache passes by) and a builtin op's that is no view are made from the form the first copy's
    dispatch gave, as the fake mode's cache makes them; views are dispatched (their base is
    recorded by the dispatcher). The program is torch's, storage sharing included."""
    model, inputs = examples.transformer(depth=3, dim=32, heads=4, seq=8)
    program, keep = program_to_decompose(model, inputs, "mlx")
    made = []
    original = node_decompositions._value_of_form

    def spy(forms, mode):
        value = original(forms, mode)
        made.append(value)
        return value

    monkeypatch.setattr(node_decompositions, "_value_of_form", spy)
    node_decompositions.forget_recipes()
    reference, ours = both_paths(program, keep)
    assert_same(reference, ours, inputs)
    kept = sum(1 for n in program.graph.nodes if n.name in keep)
    assert len(made) >= kept * 2 // 3  # the copies in blocks 2 and 3
    assert not any(v._is_view() for value in made for v in pytree.tree_leaves(value))


@pytest.mark.slow  # compiles many distinct graphs to fill the memo
def test_the_recipes_remembered_are_bounded(monkeypatch):
    """Past the bound the oldest are forgotten; a program needing more distinct nodes than the
    bound still decomposes node by node, as torch does."""
    model, inputs = examples.transformer(depth=1, dim=32, heads=4, seq=8)
    program, keep = program_to_decompose(model, inputs, "mlx")
    monkeypatch.setattr(node_decompositions, "_MAX_RECIPES", 8)
    node_decompositions.forget_recipes()
    reference, ours = both_paths(program, keep)
    assert len(node_decompositions._RECIPES) <= 8
    assert_same(reference, ours, inputs)


def test_a_codebook_program_is_decomposed_node_by_node(monkeypatch):
    """A 4-bit codebook MLP on Core ML fell back with `KeyError: 'input_1'` (its Sequential's input)."""
    outcomes = []
    original = node_decompositions._decompose_by_node

    def spy(*args, **kwargs):
        try:
            result = original(*args, **kwargs)
        except Exception as exc:
            outcomes.append(repr(exc))
            raise
        outcomes.append(result is not None)
        return result

    monkeypatch.setattr(node_decompositions, "_decompose_by_node", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
    result = compiler.compile(model, (torch.randn(2, 64),), "coreml", quantize="codebook", quantize_group_size=16, cache=False)
    assert outcomes and all(taken is True for taken in outcomes), outcomes
    rows = {row.stage: row.metrics for row in result.report.stages}
    assert "retraced" not in rows["dry_run"] and "retraced" not in rows.get("decompose", {})


def test_an_unforeseen_failure_falls_back_in_one_line_without_a_traceback(monkeypatch, capsys, caplog):
    from compiler.passes import node_decompositions

    def failing(program, table):
        raise KeyError("somewhere")

    monkeypatch.setattr(node_decompositions, "_decompose_by_node", failing)
    model, inputs = PROGRAMS["mlp"]()
    with caplog.at_level("INFO"):
        result = compiler.compile(model, inputs, "xnnpack", cache=False)
    notes = {row.stage: row.metrics.get("retraced") for row in result.report.stages}
    assert "KeyError: 'somewhere'" in (notes["dry_run"] or notes.get("decompose") or "")
    shown = capsys.readouterr()
    assert "Traceback" not in shown.out + shown.err
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= 20]
