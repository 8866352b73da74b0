"""Capture: the model's own constants that are views get their own storage."""

import pytest
import torch

from compiler.ir.artifacts import EagerModel
from compiler.stages.options import CaptureOptions
from compiler.stages.base import StageContext
from compiler.stages.capture import Capture
from tiny_models import MatmulInBfloat16


class ViewBuffers(torch.nn.Module):
    """The model's own buffers are views into one table (as a rotary cache slice would be)."""

    def __init__(self):
        super().__init__()
        table = torch.randn(16, 8)
        self.register_buffer("low", table[:8])
        self.register_buffer("high", table[8:])

    def forward(self, x):
        return x @ self.low + x @ self.high


class TransposedParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16).t())  # all of its storage, in another layout

    def forward(self, x):
        return x @ self.w


def _capture(module, inputs):
    ctx = StageContext(backend=None, options=CaptureOptions())
    return Capture().apply(EagerModel(module, inputs), ctx).program, ctx.metrics


def _owns_its_bytes(tensor):
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_model_views_get_their_own_storage_and_the_module_keeps_its_tensors():
    model = ViewBuffers()
    program, metrics = _capture(model, (torch.randn(4, 8),))
    assert metrics["views_owned"] == 2
    for name in ("low", "high"):
        assert _owns_its_bytes(program.state_dict[name])
        torch.testing.assert_close(program.state_dict[name], getattr(model, name))
    assert not _owns_its_bytes(model.high)  # the user's module is left as it was


def test_a_transposed_parameter_is_not_a_view_and_is_stored_row_major():
    model = TransposedParameter()
    program, metrics = _capture(model, (torch.randn(4, 16),))
    assert "views_owned" not in metrics and metrics["constants_made_row_major"] == 1
    assert program.state_dict["w"].stride() == (8, 1)
    torch.testing.assert_close(program.state_dict["w"], model.w)
    assert model.w.stride() == (1, 16)  # the user's module is left as it was


class AmbiguousLayouts(torch.nn.Module):
    """Constants contiguous in memory whose strides name another dim order (size-1 dims), the
    first also a bmm's first operand, as SigLIP's attention-pooling probe is once folded."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Parameter(torch.randn(1, 4, 16).transpose(0, 1))  # (4, 1, 16), strides (16, 64, 1)
        self.register_buffer("b", torch.randn(1, 8, 3).transpose(0, 1))
        self.p = torch.nn.Parameter(torch.randn(1, 64))

    def forward(self, k):
        probe = (self.p * 0.25).view(1, 4, 16).transpose(0, 1)  # folded into the same layout
        return torch.bmm(self.q, k.transpose(1, 2)), k[:1, :, :3] + self.b, torch.bmm(probe, k.transpose(1, 2))


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx"])
def test_constants_in_an_ambiguous_layout_are_stored_row_major_and_match_eager(backend):
    """Stock fails at run time (0x12 "3 input tensors have different dim orders": ExecuTorch reads dim order [1, 0, 2] from the strides)."""
    import compiler
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    model, args = AmbiguousLayouts(), (torch.randn(4, 8, 16),)
    stock = to_edge_transform_and_lower(torch.export.export(model, args)).to_executorch().buffer
    with pytest.raises(RuntimeError, match="failed with error 0x1[02]"):
        Runtime.get().load_program(stock).load_method("forward").execute(list(args))
    artifact = compiler.compile(model, args, backend)
    for got, want in zip(compiler.run(artifact, args), model(*args), strict=True):
        torch.testing.assert_close(got, want)


class SharedNewValue(torch.nn.Module):
    """Two buffers given the same new value: torch's signature check rejects the
    functionalized program ("User output x is not in the correct order"), stock too."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern = pattern
        self.register_buffer("a", torch.zeros(3))
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        if self.pattern == "same input":
            self.a.copy_(x)
            self.b.copy_(x)
        elif self.pattern == "same value":
            y = x * 2
            self.a.copy_(y)
            self.b.copy_(y)
        else:  # a buffer copied from another updated in place
            self.a.add_(x)
            self.b.copy_(self.a)
        return self.a * 2 + self.b


@pytest.mark.parametrize("pattern", ["same input", "same value", "copied buffer"])
def test_buffers_given_one_value_compile_and_carry_state(pattern):
    import compiler

    x = torch.randn(3)
    eager = SharedNewValue(pattern)
    want = [eager(x), eager(x)]
    with pytest.raises(Exception, match="not in the correct order"):
        torch.export.export(SharedNewValue(pattern), (x,)).run_decompositions({})  # what stock meets
    loaded = compiler.LoadedProgram(compiler.compile(SharedNewValue(pattern), (x,), "portable"))
    for expected in want:
        (got,) = loaded((x,))
        torch.testing.assert_close(got, expected)


class ReturnsItsBuffer(torch.nn.Module):
    def __init__(self, returned, start):
        super().__init__()
        self.returned = returned
        self.register_buffer("s", start.clone())

    def forward(self, x):
        if self.returned == "the value copied into it":
            new = self.s + x
            self.s.copy_(new)
            return new
        self.s.add_(x)
        if self.returned == "the buffer":
            return self.s
        # Ops that return the buffer itself: once functionalized, the same node as its new value.
        if self.returned == "the buffer as its own dtype":
            return self.s.to(self.s.dtype)
        if self.returned == "the buffer made contiguous":
            return self.s.contiguous()
        return self.s.detach()


@pytest.mark.parametrize(
    "returned, start",
    [
        ("the buffer", torch.arange(3.0)),
        ("the value copied into it", torch.arange(3.0)),
        # A buffer starting at zero is state a delegate can take over (MLX does).
        ("the buffer", torch.zeros(3)),
        ("the buffer as its own dtype", torch.zeros(3)),
        ("the buffer made contiguous", torch.zeros(3)),
        ("the buffer detached", torch.zeros(3)),
    ],
    ids=["buffer", "copied-value", "zero-buffer", "to-own-dtype", "contiguous", "detached"],
)
@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx"])
def test_a_returned_mutated_buffer_compiles_on_every_backend_and_carries_state(backend, returned, start):
    """Stock MLX refuses it ("buffer mutation node was found to also be used as other
    types of outputs"); a copy inside a delegate that does not own the buffer made
    XNNPACK refuse it ("Output node ... is already in the inputs"). An op that returns
    the buffer itself (`to` its own dtype, `contiguous`) is no op once functionalized:
    the returned value is the buffer's new value again, so it needs its copy too."""
    import compiler

    x = torch.randn(3)
    eager = ReturnsItsBuffer(returned, start)
    want = [eager(x).clone(), eager(x).clone()]
    artifact = compiler.compile(ReturnsItsBuffer(returned, start), (x,), backend)
    loaded = compiler.LoadedProgram(artifact)
    for expected in want:
        (got,) = loaded((x,))
        torch.testing.assert_close(got, expected)


class IndexByZeroDimTensor(torch.nn.Module):
    def forward(self, x, i):
        return x[:, i.clamp(-5, 4)] * 2, x[i.clamp(0, 2)]


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx"])
@pytest.mark.parametrize("index", [3, -2])
def test_indexing_by_a_zero_dim_tensor_reads_no_value_at_run_time(backend, index):
    from executorch.exir import to_edge_transform_and_lower

    import compiler

    x, i = torch.randn(3, 5), torch.tensor(index)
    with pytest.raises(Exception, match="data-dependent"):
        to_edge_transform_and_lower(torch.export.export(IndexByZeroDimTensor(), (x, i)))  # stock
    artifact = compiler.compile(IndexByZeroDimTensor(), (x, i), backend)
    for got, want in zip(compiler.run(artifact, (x, i)), IndexByZeroDimTensor()(x, i), strict=True):
        torch.testing.assert_close(got, want)
    ops = {str(n.target) for n in artifact.stages["capture"].program.graph.nodes}
    assert "aten.item.default" not in ops and "aten.index_select.default" in ops


class _Holder:
    """Not a module: its tensor is lifted by torch.export as a constant (as StaticCache's are)."""

    def __init__(self):
        self.total = torch.zeros(3)


class WritesAConstant(torch.nn.Module):
    """Writes in place a tensor it keeps outside its own buffers, also registered under another name."""

    def __init__(self):
        super().__init__()
        self.holder = _Holder()
        self.register_buffer("alias", self.holder.total, persistent=False)
        self.cache = torch.zeros(2, 3)  # a plain attribute, written at a position

    def forward(self, x, position):
        self.holder.total.add_(x)
        self.cache.index_copy_(0, position, x.unsqueeze(0))
        return self.holder.total * 2 + self.cache.sum(0)


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx"])
def test_a_constant_written_in_forward_becomes_a_buffer_and_carries_state(backend):
    import compiler

    inputs = [(torch.randn(3), torch.tensor([0])), (torch.randn(3), torch.tensor([1]))]
    eager = WritesAConstant()
    want = [eager(*x).clone() for x in inputs]
    from executorch.exir import to_edge_transform_and_lower

    stock = torch.export.export(WritesAConstant(), inputs[0], strict=False)
    # Stock: "Constant cache is mutated in the forward method", or for the aliased one this:
    with pytest.raises(Exception, match="is mutated in the forward method|expected compiled_fn to be GraphModule"):
        to_edge_transform_and_lower(stock)
    program, metrics = _capture(WritesAConstant(), inputs[0])
    assert metrics["constants_made_buffers"] == 2
    loaded = compiler.LoadedProgram(compiler.compile(WritesAConstant(), inputs[0], backend))
    for x, expected in zip(inputs, want, strict=True):
        (got,) = loaded(x)
        torch.testing.assert_close(got, expected)


class VmapMask(torch.nn.Module):
    """A causal mask built with nested torch.vmap over index vectors, as transformers'
    masking utilities build it when a model adds its own mask function."""

    def forward(self, x):
        idx = torch.arange(x.shape[-1])
        causal = torch.vmap(torch.vmap(lambda q, k: k <= q, in_dims=(None, 0)), in_dims=(0, None))
        return x.masked_fill(~causal(idx, idx), 0.0)


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx"])
def test_a_vmap_built_mask_is_inlined_at_capture_and_matches_eager(backend):
    """Left in the graph, fold dropped vmap's nesting markers as dead code and MLX's support
    check read a batched value: "your tensor may have escaped from inside a function being vmapped"."""
    import compiler
    from compiler.ir.graph import TRANSFORM_MARKERS

    x = torch.randn(2, 5, 5)
    exported = torch.export.export(VmapMask(), (x,), strict=False)
    assert any(n.target in TRANSFORM_MARKERS for n in exported.graph.nodes)
    program, metrics = _capture(VmapMask(), (x,))
    assert metrics["vmap_inlined"]
    assert not any(n.target in TRANSFORM_MARKERS for n in program.graph.nodes)
    artifact = compiler.compile(VmapMask(), (x,), backend)
    (got,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(got, VmapMask()(x))


class VmapMaskBesideAttention(torch.nn.Module):
    """Attention whose output layout follows its inputs' (SDPA's CPU kernel keeps the
    heads-last layout of q), beside a vmap-built mask: the retrace that inlines the mask
    also decides `reshape` from SDPA's output strides."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (x.view(b, s, 4, 8).transpose(1, 2) for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
        idx = torch.arange(s)
        causal = torch.vmap(torch.vmap(lambda i, j: j <= i, in_dims=(None, 0)), in_dims=(0, None))(idx, idx)
        return out.transpose(1, 2).reshape(b, s, -1), causal.float()


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx", "coreml"])
def test_a_reshape_decided_on_kernel_strides_survives_the_vmap_retrace(backend):
    """Left a `view`, MLX's dry run failed: "Cannot view a tensor with shape [1, 6, 4, 8] and
    strides ..." (the decomposed attention's output is laid out another way)."""
    import compiler

    args = (torch.randn(1, 6, 32),)
    artifact = compiler.compile(VmapMaskBesideAttention(), args, backend)
    if backend != "coreml":
        for got, want in zip(compiler.run(artifact, args), VmapMaskBesideAttention()(*args), strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_a_channels_last_model_is_stored_row_major_and_matches_eager(backend):
    import compiler

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).to(memory_format=torch.channels_last).eval()
    args = (torch.randn(1, 3, 16, 16),)
    program, metrics = _capture(model, args)
    assert metrics["constants_made_row_major"] == 1  # the 4-d weight (the bias is 1-d)
    (got,) = compiler.run(compiler.compile(model, args, backend), args)
    torch.testing.assert_close(got, model(*args))


class _WritesAtPosition(torch.nn.Module):
    """A cache written at an input position: run with another position than the example's, a
    program that read the tokens as the position would write the wrong row."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, tokens, position):
        self.cache.index_copy_(0, position, self.lin(torch.ones(1, 4) * tokens.float().unsqueeze(-1)))
        return self.cache.sum(0, keepdim=True)


def test_stock_export_reads_one_tensor_given_twice_as_one_input():
    """torch.export makes the first of two example inputs that are one tensor read the second:
    the program is silently wrong for any other pair of values."""

    class Add(torch.nn.Module):
        def forward(self, a, b):
            return a * 2 + b

    same = torch.tensor([1.0])
    program = torch.export.export(Add(), (same, same))
    a, b = torch.tensor([1.0]), torch.tensor([5.0])
    assert not torch.equal(program.module()(a, b), Add()(a, b))


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_one_tensor_given_as_two_example_inputs_is_two_inputs_of_the_program(backend):
    import compiler
    from compiler.running.runtime import LoadedProgram

    model = _WritesAtPosition().eval()
    same = torch.tensor([1])
    program = LoadedProgram(compiler.compile(model, (same, same), backend).program)
    eager = _WritesAtPosition().eval()
    eager.load_state_dict(model.state_dict())
    for step in range(3):
        inputs = (torch.tensor([step + 2]), torch.tensor([step]))
        torch.testing.assert_close(program(inputs)[0], eager(*inputs))
    assert torch.equal(same, torch.tensor([1]))


def test_example_inputs_that_share_storage_are_given_their_own():
    base = torch.arange(6.0)
    model = EagerModel(torch.nn.Identity(), (base, base, base[:3], {"x": base}, 2))
    tensors = [model.example_inputs[0], model.example_inputs[1], model.example_inputs[2], model.example_inputs[3]["x"]]
    assert tensors[0] is base
    pointers = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(pointers) == 4
    assert all(torch.equal(t, base[: t.numel()]) for t in tensors)
    assert model.example_inputs[4] == 2


class RotaryInFloat64(torch.nn.Module):
    """A rotary embedding computed in float64 complex inside an autocast region that turns
    autocast off, as video world-model policies write it; export keeps the region as a
    `wrap_with_autocast` call whose complex ops the real-pair rewrite cannot see."""

    def __init__(self):
        super().__init__()
        angles = torch.outer(torch.arange(4, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
            rotated = torch.view_as_real(pairs * self.freqs).flatten(-2)
        return rotated.type_as(x)


class PolarInDisabledAutocast(torch.nn.Module):
    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            angles = torch.arange(16, dtype=torch.float64).reshape(4, 4)
            freqs = torch.polar(torch.ones(4, 4, dtype=torch.float64), angles)
            pairs = torch.view_as_complex(x.double().reshape(4, 4, 2))
            return torch.view_as_real(pairs * freqs).flatten(-2).float()


AUTOCAST_CASES = {
    "rotary-float64": (RotaryInFloat64, lambda: (torch.randn(2, 4, 8),)),
    "polar-disabled": (PolarInDisabledAutocast, lambda: (torch.randn(4, 8),)),
    "matmul-bfloat16": (MatmulInBfloat16, lambda: (torch.randn(4, 8), torch.randn(8, 4))),
}


@pytest.mark.parametrize("name", AUTOCAST_CASES)
@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_autocast_regions_are_inlined_with_their_casts_and_match_eager(name, backend):
    """Stock 1.5.1 and we before: "[capture] the complex op wrap_with_autocast of flatten has no
    real-pair form here", or decompose's "AssertionError: n=copy__3" for the polar one."""
    import compiler

    model, inputs = AUTOCAST_CASES[name]
    program, metrics = _capture(model(), inputs())
    assert metrics["autocast_inlined"]
    assert not any(n.target is torch.ops.higher_order.wrap_with_autocast for n in program.graph.nodes)
    result = compiler.compile(model(), inputs(), backend, cache=False)
    check = compiler.compare_with_eager(result, model(), inputs())
    assert check.passed, check.describe()
