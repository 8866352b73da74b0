"""The backends' own LLM ops: which the generation job chooses and why, the rewritten decoder
step against the model as given, and programs calling the ops on each backend against eager."""

import pytest
import torch

import compiler
from compiler import backends
from compiler.backends.mlx.llm_ops import MLX
from compiler.ir.errors import UserInputError
from compiler.models import llm, llm_ops
from compiler.running.runtime import LoadedProgram

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "backend, chosen", [("portable", "llama"), ("xnnpack", "llama"), ("mlx", "mlx"), ("coreml", None)]
)
def test_the_backends_own_ops_are_chosen_with_the_reason(backend, chosen):
    ops, why = llm_ops.choose(backends.load(backend), None)
    assert (ops and ops.name) == chosen
    assert (f"{chosen}:: ops" in why) if chosen else ("Core ML" in why and why.startswith("plain"))
    off, why_off = llm_ops.choose(backends.load(backend), False)
    assert off is None and why_off.startswith("plain")


def test_asking_for_ops_a_backend_lacks_is_a_named_error():
    with pytest.raises(UserInputError, match="coreml"):
        llm_ops.choose(backends.load("coreml"), True)


@pytest.mark.parametrize("model", ["llama", "gemma"])
@pytest.mark.parametrize("ops", [llm_ops.LLAMA, MLX], ids=["llama", "mlx"])
def test_the_rewritten_step_computes_the_models_logits(model, ops):
    text = llm.text_model(model, max_cache_len=16)
    step = llm_ops.rewritten_step(text, ops)
    calls = [([2], 0), ([5], 1), ([9], 2), ([3, 4, 6], 3)]  # token by token, then three in one call
    text.reset()
    with torch.no_grad():
        for tokens, start in calls:
            args = torch.tensor([tokens]), torch.arange(start, start + len(tokens))
            torch.testing.assert_close(step(*args), text.step(*args), atol=1e-5, rtol=0)
    text.reset()
    assert text.hf_model.config._attn_implementation == "sdpa"  # the model as given is untouched


class _CachedAttention(torch.nn.Module):
    """A one-layer KV cache written at the call's position and attended over causally, in one
    backend's ops: `llama` ([batch, positions, heads, dim]) or `mlx` ([batch, heads, positions, dim])."""

    def __init__(self, ops: str) -> None:
        super().__init__()
        self.ops = ops
        shape = (1, 8, 2, 4) if ops == "llama" else (1, 2, 8, 4)
        self.register_buffer("k", torch.zeros(shape))
        self.register_buffer("v", torch.zeros(shape))

    def forward(self, q, k, v, position):
        start = position[0].item()
        torch._check(start >= 0)
        torch._check(start + 1 <= 8)
        if self.ops == "llama":
            torch.ops.llama.update_cache(k, self.k, start)
            torch.ops.llama.update_cache(v, self.v, start)
            return torch.ops.llama.custom_sdpa(q, self.k, self.v, start, None, 0.0, True, None)
        torch.ops.mlx.kv_cache_update(self.k, k, start)
        torch.ops.mlx.kv_cache_update(self.v, v, start)
        return torch.ops.mlx.custom_sdpa(q, self.k, self.v, start, None, 0.0, True, None)


def _steps(module: _CachedAttention, run) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shape = (1, 1, 2, 4) if module.ops == "llama" else (1, 2, 1, 4)
    outputs = []
    for position in range(3):
        q, k, v = (torch.randn(shape) for _ in range(3))
        outputs.append(run(q, k, v, torch.tensor([position])))
    return outputs


@pytest.mark.parametrize("backend, ops", [("xnnpack", "llama"), ("portable", "llama"), ("mlx", "mlx")])
def test_a_program_calling_the_ops_keeps_its_cache_as_eager_does(backend, ops):
    if ops == "llama":
        from compiler.ir.kernels import load_llm_kernels

        load_llm_kernels()
    else:
        pytest.importorskip("mlx.core")
        import executorch.backends.mlx.custom_ops  # noqa: F401  (registers mlx::)
    module = _CachedAttention(ops).eval()
    shape = (1, 1, 2, 4) if ops == "llama" else (1, 2, 1, 4)
    example = (torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), torch.tensor([0]))
    result = compiler.compile(module, example, backend)
    eager = _CachedAttention(ops).eval()
    with torch.no_grad():
        want = _steps(eager, eager)
    loaded = LoadedProgram(result)  # one program: its cache carries from call to call
    got = _steps(module, lambda *args: loaded(list(args))[0])
    for step, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"call {step}")
    placed = result.report.placement
    if backend == "xnnpack":
        assert any("llama::custom_sdpa" in row.reason and "CPU kernel" in row.reason for row in placed)
        assert any("llama::update_cache" in row.reason for row in placed)
    if backend == "mlx":
        assert all("MLX" in row.where for row in placed), [(r.op, r.where) for r in placed]
        assert any("custom_sdpa" in row.op for row in placed)


@pytest.mark.parametrize("wanted, chosen", [(None, "llama"), (False, None)])
def test_the_generation_job_says_which_ops_it_chose_and_checks_them(wanted, chosen):
    from compiler.tools import generation

    job = generation.generate("llama", "portable", tokens=4, check=True, max_cache_len=16, backend_llm_ops=wanted)
    assert job.llm_ops == chosen and job.check.llm_ops == chosen and job.check.passed, job.check.describe()
    assert job.check.to_json()["llm_ops_reason"] == job.llm_ops_reason
    called = " ".join(job.result.artifact.operators)
    assert ("llama::custom_sdpa" in called) == (chosen == "llama"), called


@pytest.mark.slow  # a fresh process: 13-15 s
def test_a_fresh_process_runs_a_program_calling_the_llama_ops(tmp_path):
    """The runtime's llama:: kernels come with the AOT library: loading a program must load it."""
    import subprocess
    import sys

    from compiler.ir.kernels import load_llm_kernels

    load_llm_kernels()
    example = (torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.tensor([0]))
    path = tmp_path / "cached.pte"
    compiler.compile(_CachedAttention("llama").eval(), example, "portable").save(path)
    code = (
        "import sys, torch; from compiler.running.runtime import LoadedProgram; "
        "out = LoadedProgram(sys.argv[1])([torch.ones(1, 1, 2, 4)] * 3 + [torch.tensor([0])]); "
        "print(float(out[0].sum()))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert done.returncode == 0 and float(done.stdout.strip().splitlines()[-1]) == 8.0, done.stderr[-2000:]


@pytest.mark.slow  # a fresh process: 13-15 s
def test_a_stage_file_calling_the_ops_resumes_in_a_fresh_process(tmp_path):
    """Stage files name the ops; a process that never imported their libraries must still read them."""
    import subprocess
    import sys

    from compiler.ir.kernels import load_llm_kernels

    pytest.importorskip("mlx.core")
    import executorch.backends.mlx.custom_ops  # noqa: F401

    load_llm_kernels()
    files = []
    for backend, ops in (("portable", "llama"), ("mlx", "mlx")):
        shape = (1, 1, 2, 4) if ops == "llama" else (1, 2, 1, 4)
        example = (torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), torch.tensor([0]))
        dumps = tmp_path / backend
        compiler.compile(_CachedAttention(ops).eval(), example, backend, stop_after="decompose", dump_dir=dumps)
        files.append(str(next(dumps.glob("*-decompose.stage"))))
    code = "import sys, compiler; [compiler.compile(None, resume_from=path) for path in sys.argv[1:]]; print('resumed')"
    done = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True)
    assert done.returncode == 0 and "resumed" in done.stdout, done.stderr[-3000:]


def test_a_model_with_sliding_window_layers_keeps_torchs_ops_and_says_why():
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    text = llm.text_model(config, max_cache_len=16)
    ops, why = llm_ops.choose(backends.load("xnnpack"), None, text)
    assert ops is None and "sliding-window" in why and why.startswith("plain")
    with pytest.raises(UserInputError, match="sliding-window"):
        llm_ops.choose(backends.load("mlx"), True, text)


def test_the_cli_says_which_ops_and_turns_them_off(capsys):
    from compiler.cli.main import main

    assert main(["generate", "llama", "--tokens", "2", "--max-cache-len", "16", "--no-backend-llm-ops"]) == 0
    assert "LLM ops: plain attention and cache update: the backend's llama:: ops" in capsys.readouterr().out
