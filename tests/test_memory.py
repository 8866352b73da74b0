"""A compile holds the weights once: what it adds to the process stays under half their bytes.

Each measurement runs in a child process of its own: a warm-up compile of a tiny model first
(the libraries' own first-use memory is not the weights'), then the high-water mark is reset
(`/proc/self/clear_refs`) and one compile of a model of `WEIGHTS_MB` of weights runs. Before the
weights were written out as they were serialised, XNNPACK's payload and the joined `.pte` each
held a copy: the peak was 2.1x the weights over the RSS before the compile. Each compile takes
a child process of its own (about 10 s): they run with `-m slow`.
"""

import json
import subprocess
import sys

import pytest

WEIGHTS_MB = 96
BOUND = 0.5  # the compile's peak over the RSS before it, in weights

_CHILD = r"""
import json, sys, torch, compiler

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

class Stack(torch.nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

backend, scheme, megabytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {"cache": False} | ({"quantize": scheme} if scheme != "float" else {})
with torch.no_grad():
    compiler.compile(Stack(64, 2).eval(), (torch.randn(1, 64),), backend, **options)  # warm-up
    width = 1024
    depth = max(1, megabytes * 2**20 // (4 * width * width))
    model, inputs = Stack(width, depth).eval(), (torch.randn(1, width),)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    before = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")
    result = compiler.compile(model, inputs, backend, **options)
    peak = status("VmHWM:")
    error = (result.run(*inputs)[0] - model(*inputs)).abs().max().item()
print(json.dumps({"weights": weights, "before": before, "peak": peak, "error": error}))
"""


def _measure(backend: str, scheme: str = "float") -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, backend, scheme, str(WEIGHTS_MB)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(measured: dict, tolerance: float) -> None:
    added = (measured["peak"] - measured["before"]) / measured["weights"]
    assert added <= BOUND, f"the compile added {added:.2f}x the weights ({measured})"
    assert measured["error"] < tolerance


@pytest.mark.slow
def test_an_xnnpack_compile_adds_under_half_the_weights():
    _check(_measure("xnnpack"), 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["portable", "mlx"])
def test_a_compile_adds_under_half_the_weights(backend):
    _check(_measure(backend), 1e-3)


@pytest.mark.slow
def test_a_quantized_xnnpack_compile_holds_no_quantization_garbage():
    """Quantizing makes and frees float temporaries of each weight's size; glibc kept them (1.55x
    the float weights added) until large blocks were made to go back to the system. What is left is
    the quantized weights themselves (0.29x) and XNNPACK's packing (the issue's bound, half the
    quantized weights, is not met yet)."""
    measured = _measure("xnnpack", "8da4w")
    added = (measured["peak"] - measured["before"]) / measured["weights"]
    assert added <= 0.8, f"the compile added {added:.2f}x the float weights ({measured})"
    assert measured["error"] < 0.5


def test_a_compile_the_machine_cannot_hold_is_refused_before_it_starts(monkeypatch):
    import torch

    import compiler
    from compiler.ir.errors import InsufficientMemory
    from compiler.process import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)  # a machine with 1 kB to spare
    model = torch.nn.Linear(64, 64).eval()
    with pytest.raises(InsufficientMemory, match="needs about .* more memory; this machine has") as error:
        compiler.compile(model, (torch.randn(1, 64),), "xnnpack", cache=False)
    assert error.value.stage == "capture" and "quantize" in error.value.hint
    result = compiler.compile(model, (torch.randn(1, 64),), "xnnpack", cache=False, memory_check=False)
    assert result.stopped_after == "emit"


def test_the_memory_check_counts_the_weights_a_scheme_codes_as_codes(monkeypatch):
    """A 3B Llama compiled with 4w for Core ML was refused (an estimate of 38.6 GB, every weight
    widened to float32 and converted) although it compiled here at an 11.4 GB anonymous peak."""
    import torch

    import compiler
    from compiler.ir.errors import InsufficientMemory
    from compiler.process import memory

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(4))).to(torch.bfloat16).eval()
    inputs = (torch.randn(2, 256, dtype=torch.bfloat16),)
    elements = 4 * 256 * 256
    # Between the two estimates: float widens and converts 12 bytes a weight, 4w holds 3.
    monkeypatch.setattr(memory, "available_bytes", lambda: 6 * elements)
    with pytest.raises(InsufficientMemory, match="compiling this model for Core ML"):
        compiler.compile(model, inputs, "coreml", cache=False, stop_after="capture")
    result = compiler.compile(model, inputs, "coreml", cache=False, stop_after="capture", quantize="4w")
    assert result.stopped_after == "capture"
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(InsufficientMemory) as error:  # already quantized: the hint does not say to quantize
        compiler.compile(model, inputs, "coreml", cache=False, stop_after="capture", quantize="4w")
    assert "quantize the model" not in error.value.hint and "3 bytes each" in error.value.hint


def test_a_checkpoint_too_large_to_read_is_refused_before_it_is_read(monkeypatch, tmp_path):
    """Weights that cannot be mapped (a pickled `.bin`) are read whole: refused first when they do not fit."""
    from compiler.ir.errors import InsufficientMemory
    from compiler.models.checkpoint import load_checkpoint
    from compiler.process import memory

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(InsufficientMemory, match="reading the checkpoint .* into memory"):
        load_checkpoint(tmp_path, "text-generation")


def test_a_mapped_checkpoint_needs_no_memory_for_its_weights_and_a_broken_one_is_named(monkeypatch, tmp_path):
    """Safetensors weights are mapped, not read: no refusal for their size. A file whose header
    cannot be read is named, with what is wrong."""
    from compiler.ir.errors import UserInputError
    from compiler.models.checkpoint import load_checkpoint
    from compiler.process import memory

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(UserInputError, match="model.safetensors.*header") as caught:
        load_checkpoint(tmp_path, "text-generation")
    assert "save_pretrained" in caught.value.hint


def test_a_core_ml_check_without_memory_for_its_float32_recheck_says_so_instead_of_dying(monkeypatch):
    """The float32 re-check converts the partitions again (1B Llama on Core ML: the check was killed
    at 24.5 GB). Without the memory for it, the float16 check stands alone and says what it skipped."""
    import torch

    import compiler
    from compiler.process import memory

    torch.manual_seed(0)
    model, inputs = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval(), (torch.randn(2, 64),)
    result = compiler.compile(model, inputs, "coreml", cache=False)
    monkeypatch.setattr(memory, "RECHECK_RUN_PER_STATE_BYTE", 1e15)  # more than any machine has
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.at_float32 is None and "float32 re-check" in check.float32_skipped
    assert check.passed and "computing in float32: not checked: converting the partitions again" in check.describe()
    monkeypatch.undo()
    assert compiler.compare_with_eager(result, model, inputs).at_float32 is not None


def test_a_check_whose_reference_run_the_machine_cannot_hold_is_refused_before_it_loads(monkeypatch):
    """A 3B Core ML program's check reached a 23.2 GB peak on this 24 GB machine: a program the
    reference executor cannot hold is a named error, not a process the kernel kills."""
    import torch

    import compiler
    from compiler.ir.errors import InsufficientMemory
    from compiler.process import memory

    model, inputs = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval(), (torch.randn(2, 64),)
    result = compiler.compile(model, inputs, "coreml", cache=False)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(InsufficientMemory, match="running the CoreMLBackend payloads in the reference executor") as error:
        compiler.compare_with_eager(result, model, inputs)
    assert error.value.stage == "run"
