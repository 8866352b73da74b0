"""The same model, options and versions give a byte-identical `.pte` on every backend.

Core ML payloads are the case that needed work: stock names each payload with a random
`executorch_<uuid4>` identifier and coremltools writes random Manifest item ids, so the
payload is rewritten with content-derived ones (`compiler.backends.coreml.payload.reproducible`).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import compiler
from compiler.backends.coreml import payload as coreml_payload
from compiler.cli.main import main

BACKENDS = ("portable", "xnnpack", "coreml", "mlx")
IDENTIFIER = re.compile(r"executorch_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
UPPER_UUID = re.compile(r"[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}")


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.linear(x))


def small(seed: int = 0):
    """A fresh model object with the same weights and inputs for the same seed."""
    torch.manual_seed(seed)
    return Small().eval(), (torch.randn(2, 4),)


def _quiet(caplog):
    caplog.set_level("ERROR", logger="coremltools")


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_compiles_give_the_same_pte(backend, caplog):
    _quiet(caplog)
    first = compiler.compile(*small(), backend).pte
    second = compiler.compile(*small(), backend).pte
    assert first == second


def _files(payload: bytes, folder: str) -> pathlib.Path:
    from executorch.backends.apple.coreml import executorchcoreml

    assert executorchcoreml.unflatten_directory_contents(payload, folder)
    return next(pathlib.Path(folder).rglob("metadata.json")).parent


def _identifier(pte: bytes) -> str:
    (payload,) = coreml_payload.coreml_payloads(pte)
    with tempfile.TemporaryDirectory() as folder:
        return json.loads((_files(payload, folder) / "metadata.json").read_text())["identifier"]


def test_coreml_identifier_is_derived_from_the_content(caplog):
    _quiet(caplog)
    model, inputs = small()
    pte = compiler.compile(model, inputs, "coreml").pte
    identifier = _identifier(pte)
    assert IDENTIFIER.fullmatch(identifier), identifier
    assert _identifier(compiler.compile(*small(), "coreml").pte) == identifier  # not random
    with torch.no_grad():
        model.linear.weight[0, 0] += 1.0
    changed = _identifier(compiler.compile(model, inputs, "coreml").pte)
    assert IDENTIFIER.fullmatch(changed), changed
    assert changed != identifier


@pytest.fixture(scope="module")
def coreml_pte() -> bytes:
    return compiler.compile(*small(), "coreml").pte


def test_coreml_payload_reads_back_and_loads(coreml_pte):
    """Our payload reader, ExecuTorch's unflattening and coremltools still read the rewritten payload."""
    import coremltools as ct

    pte = coreml_pte
    (model,) = coreml_payload.read_models(pte)
    assert "linear" in model.op_types()
    (payload,) = coreml_payload.coreml_payloads(pte)
    with tempfile.TemporaryDirectory() as folder:
        package = _files(payload, folder) / "model.mlpackage"
        manifest = json.loads((package / "Manifest.json").read_text())
        assert all(UPPER_UUID.fullmatch(key) for key in manifest["itemInfoEntries"])
        assert manifest["rootModelIdentifier"] in manifest["itemInfoEntries"]
        ct.models.MLModel(str(package), skip_model_load=True)
    out = compiler.run(pte, small()[1])
    expected = small()[0](*small()[1])
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_coreml_same_pte_in_two_processes(tmp_path, caplog):
    """Two separate processes (no stage cache) write the same `.pte` for the same model: this
    one (through the CLI's entry point) and a fresh one (`python -m compiler`)."""
    _quiet(caplog)
    argv = ["compile", "mlp:features=4,hidden=8,layers=1", "--backend", "coreml", "--no-cache", "-q", "-o"]
    assert main([*argv, str(tmp_path / "run0.pte")]) == 0
    subprocess.run(
        [sys.executable, "-m", "compiler", *argv, str(tmp_path / "run1.pte")],
        check=True, capture_output=True, cwd=pathlib.Path(compiler.__file__).parent.parent,
    )
    assert (tmp_path / "run0.pte").read_bytes() == (tmp_path / "run1.pte").read_bytes()


def test_coreml_rewrite_ignores_the_folder_order(coreml_pte, tmp_path):
    """ExecuTorch's flattening lists a folder in the order the file system gives; the rewrite
    gives the same payload for any order, and reads ExecuTorch's format as it writes it."""
    from executorch.backends.apple.coreml import executorchcoreml

    (payload,) = coreml_payload.coreml_payloads(coreml_pte)
    files = {}
    with tempfile.TemporaryDirectory() as folder:
        root = _files(payload, folder)
        files = {p.relative_to(root.parent): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    rewritten = []
    for order in (sorted(files), sorted(files, reverse=True)):
        folder = tmp_path / f"order{len(rewritten)}"
        for path in order:
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(files[path])
        stock = executorchcoreml.flatten_directory_contents(str(folder / "lowered_module"))
        root, tree = coreml_payload._read_tree(stock)
        assert (root, dict(coreml_payload._walk(tree))) == ("lowered_module", {
            str(path.relative_to("lowered_module")): data for path, data in files.items()})
        tail = stock[::-1]
        nodes, end = json.JSONDecoder().raw_decode(tail.decode("latin-1"))
        assert json.dumps(nodes, separators=(",", ":"), sort_keys=True).encode() == tail[:end]
        rewritten.append(coreml_payload.reproducible(stock))
    assert rewritten[0] == rewritten[1] == payload
