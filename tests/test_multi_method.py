"""Programs of several methods: one .pte, weights stored once, one KV cache the methods share,
stage files and resumes per method, and the check of a sequence of calls against eager."""

import types

import pytest
import torch

import compiler
from compiler.ir.errors import UserInputError
from compiler.ir.private_api import deserialize_pte

CACHE, WIDTH = 16, 8


class TinyKV(torch.nn.Module):
    """A cache of projected tokens: prefill writes several positions, decode one, both read all."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("cache", torch.zeros(1, CACHE, WIDTH))

    def _step(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(1, pos, self.proj(x))
        return self.out(self.cache.sum(1))

    def prefill(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._step(x, pos)

    def decode(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._step(x, pos) * 2


def _methods(model: TinyKV) -> dict:
    return {
        "prefill": (model.prefill, (torch.randn(1, 4, WIDTH), torch.arange(4))),
        "decode": (model.decode, (torch.randn(1, 1, WIDTH), torch.tensor([4]))),
    }


def _calls() -> list:
    torch.manual_seed(1)
    return [
        ("prefill", (torch.randn(1, 4, WIDTH), torch.arange(4))),
        ("decode", (torch.randn(1, 1, WIDTH), torch.tensor([4]))),
        ("decode", (torch.randn(1, 1, WIDTH), torch.tensor([5]))),
    ]


def _model() -> TinyKV:
    torch.manual_seed(0)
    return TinyKV().eval()


def _shared_state(pte: bytes) -> dict[str, set]:
    """Per method: where each planned mutable buffer lives, (memory id, offset), by its name."""
    program = deserialize_pte(pte).program
    placed: dict[str, set] = {}
    for plan in program.execution_plan:
        for value in plan.values:
            spec = value.val
            info = getattr(spec, "allocation_info", None)
            name = getattr(getattr(spec, "extra_tensor_info", None), "fully_qualified_name", None)
            if info is not None and name:
                placed.setdefault(plan.name, set()).add((name, info.memory_id, info.memory_offset_low))
    return placed


@pytest.mark.parametrize("backend", ["portable", pytest.param("xnnpack", marks=pytest.mark.slow)])
def test_two_methods_share_one_cache_and_match_eager(backend):
    model = _model()
    result = compiler.compile_methods(_methods(model), backend, emit_constant_methods=("get_max_seq_len=16",))
    names = {plan.name for plan in deserialize_pte(result.pte).program.execution_plan}
    assert names == {"prefill", "decode", "get_max_seq_len"}
    placed = _shared_state(result.pte)
    assert placed["prefill"] == placed["decode"] and {name for name, *_ in placed["decode"]} == {"owner.cache"}
    check = compiler.check_methods(result, _calls())
    assert check.passed, check.describe()
    assert [row.method for row in check.methods] == ["prefill", "decode"]
    assert [row.calls for row in check.methods] == [1, 2]
    assert all(row.worst_error < 1e-5 for row in check.methods)
    # The eager model's cache is as it was: the check ran eager from the compiled state and put it back.
    assert not model.cache.any()


@pytest.mark.parametrize(
    "backend, options",
    [("coreml", {"minimum_deployment_target": "iOS18", "take_over_mutable_buffer": False}), ("mlx", None)],
)
def test_two_methods_share_one_cache_on_apple_backends_in_the_reference_executor(backend, options):
    """The cache stays the program's (Core ML told not to take it over; MLX leaves index_copy on the
    CPU); the delegates compute around it, in the reference executor with one arena for both methods."""
    result = compiler.compile_methods(_methods(_model()), backend, backend_options=options)
    assert result.program.delegates
    check = compiler.check_methods(result, _calls())
    assert check.passed, check.describe()


def test_a_program_that_keeps_state_apart_would_fail_the_check():
    """The check is a real one: decode's output depends on what prefill wrote into the shared cache."""
    model = _model()
    result = compiler.compile_methods(_methods(model), "portable")
    calls = _calls()
    check = compiler.check_methods(result, calls[1:])  # decode without the prefill eager saw
    assert check.passed
    with torch.no_grad():
        model.prefill(*calls[0][1])  # eager now starts from another cache than the program
    assert not compiler.check_methods(result, calls[1:]).passed


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(256, 256)

    def one(self, x):
        return self.big(x)

    def two(self, x):
        return self.big(x).relu()


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_weights_shared_in_eager_are_stored_once(backend):
    model, x = Shared().eval(), torch.randn(2, 256)
    single = compiler.compile_methods({"one": (model.one, (x,))}, backend)
    both = compiler.compile_methods({"one": (model.one, (x,)), "two": (model.two, (x,))}, backend)
    weights = 257 * 256 * 4
    assert len(single.pte) > weights
    assert len(both.pte) < len(single.pte) + weights // 4


def test_report_has_a_row_per_method_and_stage():
    result = compiler.compile_methods(_methods(_model()), "portable")
    header, rows = result.report.stage_rows()
    assert header[:2] == ["method", "stage"]
    assert [row[:2] for row in rows if row[1] == "lower"] == [["prefill", "lower"], ["decode", "lower"]]
    assert rows[-2][:2] == ["prefill, decode", "emit"] and rows[-1][0] == "total"
    text = result.report.format_stages()
    assert "prefill" in text and "decode" in text
    assert "method decode:" in result.report.format_placement()
    assert result.report.to_json()["methods"]["decode"]["stages"][-1]["stage"] == "lower"


@pytest.mark.slow
def test_stage_files_per_method_and_a_resume_of_one(tmp_path):
    model = _model()
    first = compiler.compile_methods(_methods(model), "xnnpack", dump_dir=str(tmp_path))
    for method in ("prefill", "decode"):
        assert (tmp_path / method / "09-lower.stage").is_file()
    assert (tmp_path / "10-emit.pte").read_bytes() == first.pte
    methods = _methods(model)
    methods["decode"] = str(tmp_path / "decode" / "06-decompose.stage")
    resumed = compiler.compile_methods(methods, "xnnpack")
    assert resumed.methods["decode"].report.resumed_from.endswith("06-decompose.stage")
    assert resumed.methods["decode"].report.stages[0].stage == "partition"
    assert resumed.pte == first.pte
    assert compiler.check_methods(resumed, _calls(), eager={"prefill": model.prefill, "decode": model.decode}).passed


def test_stop_after_a_stage_before_emit_keeps_each_method():
    result = compiler.compile_methods(_methods(_model()), "portable", stop_after="partition")
    assert set(result.methods) == {"prefill", "decode"}
    assert all(r.stopped_after == "partition" for r in result.methods.values())
    with pytest.raises(UserInputError, match="stopped after partition"):
        result.pte


@pytest.mark.parametrize(
    "methods, match",
    [
        ({}, "no methods"),
        ({"bad name": (torch.nn.Linear(2, 2), (torch.randn(1, 2),))}, "not a method name"),
        ({"a": torch.nn.Linear(2, 2)}, "method 'a'"),
        ({"a": (lambda x: x, (torch.randn(1, 2),))}, "method 'a'"),
    ],
)
def test_a_bad_method_set_is_named(methods, match):
    with pytest.raises(UserInputError, match=match):
        compiler.compile_methods(methods, "portable")


def test_a_method_whose_inputs_do_not_fit_is_named():
    model = _model()
    methods = _methods(model)
    methods["decode"] = (model.decode, (torch.randn(1, 1, WIDTH + 1), torch.tensor([4])))
    with pytest.raises(compiler.CompileError, match="method 'decode'") as info:
        compiler.compile_methods(methods, "portable")
    assert info.value.stage == "capture"


def test_a_constant_method_named_like_a_method_is_refused():
    with pytest.raises(UserInputError, match="prefill"):
        compiler.compile_methods(_methods(_model()), "portable", emit_constant_methods=("prefill=1",))


def test_state_shared_under_two_names_is_refused():
    """One cache given through two modules at different paths would be planned twice."""
    model = _model()
    holder = torch.nn.Module()
    holder.inner = model
    methods = {"prefill": (model.prefill, _methods(model)["prefill"][1]), "other": (holder, (torch.randn(1, WIDTH),))}
    holder.forward = lambda x: model.out(x)
    with pytest.raises(UserInputError, match="cache"):
        compiler.compile_methods(methods, "portable")


class Accumulator(torch.nn.Module):
    """State a delegate can own whole (Core ML from iOS 18): every use of it in one partition."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(1, WIDTH))

    def add(self, x):
        self.state.add_(x)
        return self.state * 2.0

    def read(self, x):
        return self.state + x


@pytest.mark.parametrize(
    "backend, options",
    [
        ("portable", None),
        ("xnnpack", None),
        # 'read' alone would copy the state into its payload as a constant: it stays the program's
        ("coreml", {"minimum_deployment_target": "iOS18", "take_over_mutable_buffer": False}),
    ],
)
def test_state_one_method_writes_and_another_reads(backend, options):
    model, x = Accumulator().eval(), torch.randn(1, WIDTH)
    result = compiler.compile_methods({"add": (model.add, (x,)), "read": (model.read, (x,))}, backend, backend_options=options)
    if backend == "coreml":
        assert result.methods["read"].report.stage("partition").metrics["program_state"] == "owner.state"
    calls = [("add", (x,)), ("read", (x,)), ("add", (x,)), ("read", (x,))]
    assert compiler.check_methods(result, calls).passed


@pytest.mark.parametrize(
    "backend, options",
    [
        ("coreml", {"minimum_deployment_target": "iOS18"}),  # Core ML state in 'add'
        ("mlx", None),  # MLX state in 'add'
    ],
)
def test_state_a_delegate_holds_cannot_be_shared(backend, options):
    """The state would be the writing method's delegate's own: 'read' would never see what 'add' wrote."""
    model, x = Accumulator().eval(), torch.randn(1, WIDTH)
    methods = {"add": (model.add, (x,)), "read": (model.read, (x,))}
    with pytest.raises(compiler.CompileError, match="held by a delegate") as info:
        compiler.compile_methods(methods, backend, backend_options=options)
    assert info.value.stage == "emit"


class CrossKeys(torch.nn.Module):
    """Whisper's cross-attention keys: 'fill' writes them, 'attend' only reads them, transposed.
    Alone, 'attend' would see a constant buffer whose transpose folds into a new constant."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keys", torch.zeros(4, WIDTH))
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def fill(self, x):
        self.keys.copy_(self.proj(x))
        return x.sum(dim=0, keepdim=True)

    def attend(self, q):
        return q @ self.keys.transpose(0, 1)


def _cross_keys_methods():
    model = CrossKeys().eval()
    return model, {"fill": (model.fill, (torch.randn(4, WIDTH),)), "attend": (model.attend, (torch.randn(1, WIDTH),))}


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_state_another_method_writes_is_never_folded(backend):
    """The fold stage (and XNNPACK's fold before its search) made the transpose of the keys a
    constant of their zeros at capture: 'attend' returned zeros whatever 'fill' wrote."""
    model, methods = _cross_keys_methods()
    result = compiler.compile_methods(methods, backend)
    attend = result.methods["attend"]
    assert attend.report.stage("fold").metrics["folded"] == 0
    assert "owner.keys" in attend.artifact.program.graph_signature.inputs_to_buffers.values()
    calls = [("fill", methods["fill"][1]), ("attend", methods["attend"][1])]
    assert compiler.check_methods(result, calls).passed


def test_a_stage_reading_state_as_a_constant_fails_verification(monkeypatch):
    """The invariant behind the fix: a stage whose output no longer reads the state at run time fails."""
    from compiler.passes import folding as fold

    reading_it_as_constant = fold.constant_inputs
    monkeypatch.setattr(fold, "constant_inputs", lambda ep, state=frozenset(): reading_it_as_constant(ep))
    _, methods = _cross_keys_methods()
    with pytest.raises(compiler.CompileError, match="program_state_read") as info:
        compiler.compile_methods(methods, "portable")
    assert info.value.stage == "fold" and info.value.nodes == ("owner.keys",)


class ThroughAnObject(torch.nn.Module):
    """State reached through a plain object, as transformers' caches are: export lifts it as a
    constant, which capture reads through the module's buffer of the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(1, WIDTH))
        self.box = types.SimpleNamespace(state=self.state)

    def write(self, x):
        self.box.state.copy_(x * 3)
        return x + 1

    def read(self, x):
        return self.box.state + x


def test_state_reached_through_an_object_is_shared():
    model, x = ThroughAnObject().eval(), torch.randn(1, WIDTH)
    result = compiler.compile_methods({"write": (model.write, (x,)), "read": (model.read, (x,))}, "portable")
    assert compiler.check_methods(result, [("write", (x,)), ("read", (x,))]).passed


@pytest.mark.parametrize("rows", [1, 2])
def test_two_buffers_under_one_name_are_refused(rows):
    """Two modules whose state has the same path are two states: planned once by name, they would clash."""
    first, second = Accumulator().eval(), Accumulator().eval()
    second.state = torch.zeros(rows, WIDTH)
    methods = {"add": (first.add, (torch.randn(1, WIDTH),)), "read": (second.read, (torch.randn(rows, WIDTH),))}
    with pytest.raises(UserInputError, match=r"different buffers under one name .*owner.state \(methods add, read\)"):
        compiler.compile_methods(methods, "portable")


@pytest.mark.slow
def test_the_stage_cache_serves_each_method(tmp_path):
    model = _model()
    first = compiler.compile_methods(_methods(model), "xnnpack", cache_dir=str(tmp_path))
    again = compiler.compile_methods(_methods(model), "xnnpack", cache_dir=str(tmp_path))
    for method in ("prefill", "decode"):
        assert again.methods[method].report.stage("lower").cached
    assert again.pte == first.pte


@pytest.mark.parametrize("by_name", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_method_with_a_dynamic_size(by_name):
    model = _model()
    seq = torch.export.Dim("seq", min=1, max=CACHE)
    dynamic = {"x": {1: seq}, "pos": {0: seq}} if by_name else ({1: seq}, {0: seq})
    methods = _methods(model)
    methods["prefill"] = (*methods["prefill"], dynamic)
    result = compiler.compile_methods(methods, "xnnpack")
    calls = [("prefill", (torch.randn(1, 6, WIDTH), torch.arange(6))), ("decode", (torch.randn(1, 1, WIDTH), torch.tensor([6])))]
    assert compiler.check_methods(result, calls).passed


def test_dynamic_shapes_naming_no_parameter_are_refused():
    model = _model()
    methods = _methods(model)
    methods["prefill"] = (*methods["prefill"], {"tokens": {1: torch.export.Dim("seq", max=8)}})
    with pytest.raises(UserInputError, match="method 'prefill': dynamic shapes name no parameter of it: tokens"):
        compiler.compile_methods(methods, "portable")


@pytest.mark.slow
def test_prefill_and_decode_of_an_lm_share_the_cache():
    """A Llama as ExecuTorch's two-method LLM layout (prefill over the prompt, decode one token,
    metadata methods): our runtime (executorch.runtime's Program shares host arenas between methods)
    decodes as eager. ExecuTorch 1.5.1's TextLLMRunner picks prefill and decode, but its Module gives
    each method its own planned memory (no share_memory_arenas), so decode starts from an empty
    cache: its first token is right and the rest are an empty cache's. The test xfails on that
    and passes once the runner shares the arenas."""
    import pathlib
    import tempfile

    from compiler.models import llm
    from compiler.tools import generation

    text = llm.text_model("llama", dynamic_prefill=True)
    text.reset()
    methods = {
        "prefill": (text.step, text.example_inputs, text.dynamic_shapes),
        "decode": (text.step, (torch.tensor([[text.bos]]), torch.tensor([0]))),
    }
    result = compiler.compile_methods(methods, "xnnpack", emit_constant_methods=text.constant_methods)
    prompt = generation.prompt_tokens(text, generation.DEFAULT_PROMPT)
    eager = generation.eager_greedy(text, prompt, 16)
    calls = [("prefill", (torch.tensor([prompt]), torch.arange(len(prompt))))]
    calls += [("decode", (torch.tensor([[t]]), torch.tensor([len(prompt) + i]))) for i, t in enumerate(eager.tokens[:-1])]
    check = compiler.check_methods(result, calls, eager={"prefill": text.step, "decode": text.step})
    assert check.passed, check.describe()
    with tempfile.TemporaryDirectory() as scratch:
        pte, tokenizer = pathlib.Path(scratch, "lm.pte"), pathlib.Path(scratch, "tokenizer.json")
        pte.write_bytes(result.pte)
        llm.tokenizer(text).save(str(tokenizer))
        tokens, _, _ = generation._runner_generation(str(pte), str(tokenizer), text, generation.DEFAULT_PROMPT, 16, 1)
    assert tokens[0] == eager.tokens[0]
    if tokens != eager.tokens:
        pytest.xfail("TextLLMRunner 1.5.1 gives prefill and decode separate memory: decode sees an empty KV cache")
