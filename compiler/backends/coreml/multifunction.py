"""Core ML payloads of several methods joined into one multifunction model, so the weights the
methods share are stored once.

Each method of `compiler.compile_methods` is lowered on its own, so each Core ML delegate holds
its own model, its weights included: the `.pte` of two methods sharing one weight held it twice.
As ExecuTorch's Core ML multimethod preprocess does (its POSITIONAL strategy), the methods' n-th
Core ML delegates become the functions of one model (`coremltools.utils.save_multifunction`, which
stores a weight the functions share once), stored once as the program's named data; each delegate
then holds stock's reference to it ("CMJR" and the model's key and its method's function), which
ExecuTorch's Core ML runtime reads, and so does the reference executor (`reference.py`). The
methods' n-th delegates are joined when some weight is in more than one of them (weights shared in
eager; methods that share none keep their own models), and only when every method has as many
Core ML delegates (stock refuses the rest).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import tempfile
from typing import Mapping

import attrs
import coremltools as ct
import torch

from executorch.backends.apple.coreml import executorchcoreml
from executorch.backends.apple.coreml.compiler import CoreMLBackend
from executorch.backends.apple.coreml.compiler.coreml_preprocess import MethodMetadata, MultifunctionModelMetadata
from executorch.exir.lowered_backend_module import LoweredBackendModule, get_lowered_submodules

from compiler.backends.coreml import payload
from compiler.ir.artifacts import LoweredProgram
from compiler.ir.graph import copy_program
from compiler.ir.private_api import delegate_named_data, named_data_store

logger = logging.getLogger(__name__)


def _delegates(program) -> list[tuple[str, LoweredBackendModule]]:
    return [(name, module) for name, module, _ in get_lowered_submodules(program.graph_module)
            if module.backend_id == payload.BACKEND_ID]


def _weights(module: LoweredBackendModule) -> set[str]:
    """The digests of the tensors the delegate's program holds (its weights)."""
    program = module.original_module
    tensors = [*program.state_dict.values(), *program.constants.values()]
    return {
        hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + _bytes(t)).hexdigest()
        for t in tensors if isinstance(t, torch.Tensor) and t.numel()
    }


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()


def _shares_a_weight(modules: list[LoweredBackendModule]) -> bool:
    seen: set[str] = set()
    for weights in map(_weights, modules):
        if seen & weights:
            return True
        seen |= weights
    return False


def _joined(payloads: Mapping[str, bytes]) -> bytes | None:
    """One multifunction model payload of the methods' payloads (a function per method), or None
    when a payload holds no `.mlpackage` (a compiled model, which coremltools cannot join)."""
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        functions = ct.utils.MultiFunctionDescriptor()
        methods = {}
        for method, data in payloads.items():
            (root / method).mkdir()
            executorchcoreml.unflatten_directory_contents(data, str(root / method))
            package = next((root / method).rglob("*.mlpackage"), None)
            if package is None:
                return None
            names = json.loads((package.parent / "metadata.json").read_text())
            methods[method] = MethodMetadata(names["inputNames"], names["outputNames"])
            functions.add_function(str(package), src_function_name="main", target_function_name=method)
        functions.default_function_name = next(iter(payloads))
        joined = root / "joined"
        joined.mkdir()
        ct.utils.save_multifunction(functions, str(joined / "model.mlpackage"))
        # The identifier is made from the content (payload.reproducible), as for every payload.
        CoreMLBackend.save_model_metadata(MultifunctionModelMetadata("executorch_", methods), joined)
        return payload.reproducible(executorchcoreml.flatten_directory_contents(str(joined.resolve())))


def share_weights(lowered: Mapping[str, LoweredProgram]) -> dict[str, LoweredProgram]:
    """The methods' lowered programs with their n-th Core ML delegates joined into one multifunction
    model where they share a weight (the module docstring); the programs given are left as they were."""
    found = {method: _delegates(one.program) for method, one in lowered.items()}
    counts = {method: len(delegates) for method, delegates in found.items()}
    if len(lowered) < 2 or not any(counts.values()):
        return dict(lowered)
    if len(set(counts.values())) > 1:
        logger.info("coreml: each method keeps its own models: the methods have different numbers of Core ML "
                    "delegates (%s)", ", ".join(f"{m} {n}" for m, n in counts.items()))
        return dict(lowered)
    programs = {}
    for position in range(next(iter(counts.values()))):
        modules = {method: delegates[position][1] for method, delegates in found.items()}
        if not _shares_a_weight(list(modules.values())):
            logger.info("coreml: the methods' Core ML delegates %d share no weight: each keeps its own model", position)
            continue
        data = _joined({method: payload.stored_model(module.processed_bytes, delegate_named_data(module))
                        for method, module in modules.items()})
        if data is None:
            logger.info("coreml: Core ML delegates %d are compiled models, which cannot be joined", position)
            continue
        key = "coreml_" + hashlib.sha256(data).hexdigest()[:32]
        store = named_data_store()
        store.add_named_data(key, data)
        stored = store.get_named_data_store_output()
        for method, module in modules.items():
            if method not in programs:
                programs[method] = copy_program(lowered[method].program)
            name = found[method][position][0]
            setattr(programs[method].graph_module, name, LoweredBackendModule(
                module.original_module, module.backend_id, payload.reference(key, method), module.compile_specs, stored,
            ))
        logger.info("coreml: the methods' Core ML delegates %d are one multifunction model (%d bytes)",
                    position, len(data))
    return {method: attrs.evolve(one, program=programs[method]) if method in programs else one
            for method, one in lowered.items()}
