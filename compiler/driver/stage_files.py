"""Stage files: an artifact saved so a later run can resume after that stage.

A stage file is ExecuTorch's serialized ExportedProgram (a zip) with one more
member, a JSON manifest naming the artifact type, the stage that produced it,
the whole compile configuration and the dependency versions (so the file alone
replays the run), and what the graph alone cannot carry (the placement plan, the
ops kept whole, which values are symbolic floats). Delegation tags live in node
metadata, which serialization drops, so they are re-applied from the plan on load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import operator
import os
import zipfile
from typing import Any, Iterator, Mapping

import attrs
import torch
from torch._guards import detect_fake_mode
from torch.utils._sympy.value_ranges import ValueRanges

from executorch.exir import EdgeCompileConfig
from executorch.exir.serde.serialize import load as load_program
from executorch.exir.verification.verifier import EXIREdgeDialectVerifier
from executorch.exir.serde.serialize import save as save_program

from compiler.driver.config import CompileConfig, dependency_versions
from compiler.driver.weight_store import MIN_BYTES, WeightStore, storable
from compiler.models import llm_ops
from compiler.ir.artifacts import (
    AtenProgram,
    EdgeProgram,
    KeepWholePlan,
    LoweredProgram,
    PartitionedProgram,
    PlannedProgram,
    SplitProgram,
)
from compiler.ir.dialect import op_from_name
from compiler.ir.errors import ResumeError
from compiler.ir.graph import DELEGATION_TAG
from compiler.ir.placement import PlacementPlan
from compiler.ir.private_api import file_blob, set_delegate_named_data, set_verifiers

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
# Format 2 files (no delegate payloads beside the program) still load.
READABLE_FORMATS = (2, FORMAT_VERSION)
MANIFEST = "compiler_manifest.json"
# Zip members holding each delegate's payload and its original program's weights as raw bytes.
DELEGATE_BLOBS = "compiler_delegates"
SUFFIX = ".stage"

RESUMABLE_TYPES = {
    t.__name__: t
    for t in (AtenProgram, PlannedProgram, EdgeProgram, PartitionedProgram, SplitProgram, LoweredProgram)
}


@attrs.frozen
class StageFile:
    artifact: Any
    stage: str  # the stage that produced the artifact; a resume continues after it
    config: CompileConfig  # the configuration of the run that wrote it
    versions: Mapping[str, Any]  # the dependency versions that run used
    # Backend options the file could not record (name -> repr): a resume must give them.
    unrecorded: Mapping[str, str] = attrs.field(factory=dict)


def can_save(artifact: Any) -> bool:
    return type(artifact).__name__ in RESUMABLE_TYPES


def save_stage_file(
    path: str | os.PathLike, artifact: Any, stage: str, config: CompileConfig, extra: Mapping[str, str] | None = None,
    weights: WeightStore | None = None,
) -> None:
    """`extra`: more JSON members by name (the stage cache's entry record); a load ignores them.
    `weights`: large weights go to this store and the file names them (the stage cache's entries);
    without it the file holds every byte itself."""
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "artifact": type(artifact).__name__,
        "stage": stage,
        "config": config.to_json(),
        "versions": dependency_versions(),
    }
    if hasattr(artifact, "preserved_ops"):
        manifest["preserved_ops"] = list(artifact.preserved_ops)
    if hasattr(artifact, "plan"):
        manifest["plan"] = artifact.plan.to_json()
    if hasattr(artifact, "keep_whole"):
        manifest["keep_whole"] = artifact.keep_whole.to_json()
    if hasattr(artifact, "refused_input_dtypes"):
        manifest["refused_input_dtypes"] = sorted(artifact.refused_input_dtypes)
    manifest["placeholders"] = [n.name for n in artifact.program.graph.nodes if n.op == "placeholder"]
    signature = artifact.program.module_call_graph[0].signature
    manifest["forward_arg_names"] = getattr(signature, "forward_arg_names", None)
    manifest["positional_args"] = {
        n.name: len(n.args) for n in artifact.program.graph.nodes if n.op == "call_function"
    }
    manifest["symbolic_floats"] = [n.name for n in _symbolic_float_nodes(artifact.program)]
    manifest["requires_grad"] = [
        n.name for n in artifact.program.graph.nodes if getattr(n.meta.get("val"), "requires_grad", False)
    ]
    blobs: dict[str, Any] = {}
    with (
        _symbolic_floats_as_placeholder_ints(artifact.program),
        _weights_stored(artifact.program, weights, manifest),
        _delegate_blobs_aside(artifact.program, blobs),
    ):
        if weights is not None:  # payloads and named data to the store too
            manifest["stored_blobs"] = {}
            for name in [name for name, data in blobs.items() if len(data) >= MIN_BYTES]:
                data = blobs.pop(name)
                manifest["stored_blobs"][name] = [weights.put_bytes(data), len(data)]
        manifest["delegate_blobs"] = sorted(blobs)
        save_program(artifact.program, os.fspath(path), extra_files={**(extra or {}), MANIFEST: json.dumps(manifest)})
    if blobs:
        with zipfile.ZipFile(os.fspath(path), "a") as archive:
            for name, data in blobs.items():
                if isinstance(data, bytes):
                    archive.writestr(f"{DELEGATE_BLOBS}/{name}", data)
                else:  # a weight spilled to a file as it was made: copied in from there
                    with archive.open(f"{DELEGATE_BLOBS}/{name}", "w", force_zip64=True) as member:
                        data.write_to_file(member)


def load_stage_file(path: str | os.PathLike, weights: WeightStore | None = None) -> StageFile:
    """`weights`: the store a file written with one names its large weights in (mapped, not read)."""
    path = os.fspath(path)
    hint = "pass a .stage file written by a dump of the stages (dump_dir) or by the crash reproducer"
    if not os.path.isfile(path):
        raise ResumeError(f"resume file {path!r} does not exist", hint=hint)
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if not any(name.endswith(MANIFEST) for name in names):
            raise ResumeError(f"{path!r} is not a stage file of this compiler (no manifest)", hint=hint)
        extra = {MANIFEST: ""}
        llm_ops.register_ops()
        program = load_program(path, extra_files=extra)
        manifest = json.loads(extra[MANIFEST])
        stored = manifest.get("stored_blobs", {})
        if (manifest.get("stored_weights") or stored) and weights is None:
            raise ResumeError(f"{path!r} is a stage cache entry: its weights are in the cache's store", hint=hint)
        if manifest.get("delegate_blobs") or stored:
            with zipfile.ZipFile(path) as archive:
                blobs = {name: archive.read(f"{DELEGATE_BLOBS}/{name}") for name in manifest["delegate_blobs"]}
            for name, (digest, size) in stored.items():
                blobs[name] = _stored_blob(name, weights.checked_path(digest, size))
            _restore_delegate_blobs(program, blobs)
        _restore_stored_weights(program, manifest.get("stored_weights", []), weights)
    except ResumeError:
        raise
    except Exception as exc:  # zip, JSON and deserializer errors all mean "corrupt"
        raise ResumeError(
            f"resume file {path!r} is corrupt or from another version: {type(exc).__name__}: {exc}",
            hint=hint,
        ) from exc

    if manifest.get("format") not in READABLE_FORMATS or manifest.get("artifact") not in RESUMABLE_TYPES:
        raise ResumeError(f"resume file {path!r} has an unknown format {manifest.get('format')!r}", hint=hint)
    try:
        config = CompileConfig.from_json(manifest["config"])
    except Exception as exc:
        raise ResumeError(
            f"resume file {path!r} records a configuration this version cannot read: {type(exc).__name__}: {exc}",
            hint=hint,
        ) from exc
    _restore_placeholder_names(program, manifest.get("placeholders", []), manifest.get("forward_arg_names"))
    _restore_symbolic_floats(program, manifest.get("symbolic_floats", []))
    _restore_requires_grad(program, manifest["requires_grad"])
    _restore_positional_args(program, manifest.get("positional_args", {}))
    _drop_unused_tuple_accesses(program)
    artifact_type = RESUMABLE_TYPES[manifest["artifact"]]
    fields: dict[str, Any] = {"program": program}
    if "preserved_ops" in manifest and "preserved_ops" in attrs.fields_dict(artifact_type):
        fields["preserved_ops"] = tuple(manifest["preserved_ops"])
        _restore_edge_verifier(program, fields["preserved_ops"])
        # Each delegate's original program holds the ops kept whole too, and a copy of the
        # delegate (`copy.deepcopy`) verifies it again.
        for module in _lowered_modules(program):
            _restore_edge_verifier(module.original_module, fields["preserved_ops"])
    if "keep_whole" in manifest:
        fields["keep_whole"] = KeepWholePlan.from_json(manifest["keep_whole"])
    if "refused_input_dtypes" in manifest:
        fields["refused_input_dtypes"] = frozenset(manifest["refused_input_dtypes"])
    if "plan" in manifest:
        plan = PlacementPlan.from_json(manifest["plan"])
        _restore_tags(program, plan.tags())
        fields["plan"] = plan
    unrecorded = manifest["config"].get("unrecorded", {})
    return StageFile(artifact_type(**fields), manifest["stage"], config, manifest["versions"], unrecorded)


def _lowered_modules(program) -> list[Any]:
    """The delegates of the program's top graph, in call order."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    found = []
    for node in program.graph.nodes:
        if node.op == "get_attr":
            module = getattr(program.graph_module, node.target, None)
            if isinstance(module, LoweredBackendModule):
                found.append(module)
    return found


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of `tensor`'s dtype and shape holding one element (all strides 0)."""
    stand_in = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
    return stand_in


def _weight_dicts(program) -> dict[str, dict]:
    """Every dict of weights a program holds, by a name a manifest can give: its own state_dict and
    constants, and each delegate's original program's state_dict."""
    dicts = {"state_dict": program.state_dict, "constants": program.constants}
    for index, module in enumerate(_lowered_modules(program)):
        dicts[f"delegate.{index}"] = module.original_module.state_dict
    return dicts


@contextlib.contextmanager
def _weights_stored(program, weights: WeightStore | None, manifest: dict) -> Iterator[None]:
    """With a store, each large weight goes there once and the file holds a one-element stand-in
    while it is written; the manifest lists `[dict, name, reference]` (a weight held under two
    names is stored once and named `[dict, name, {"same_as": [dict, name]}]`)."""
    if weights is None:
        yield
        return
    listed: list = []
    first: dict[int, list[str]] = {}
    saved: list[tuple[dict, str, Any]] = []
    try:
        for where, tensors in _weight_dicts(program).items():
            for name, tensor in list(tensors.items()):
                if not storable(tensor):
                    continue
                if id(tensor) in first:
                    reference = {"same_as": first[id(tensor)]}
                else:
                    reference = weights.put_tensor(tensor)
                    first[id(tensor)] = [where, name]
                listed.append([where, name, reference])
                saved.append((tensors, name, tensor))
                tensors[name] = _stand_in(tensor)
        manifest["stored_weights"] = listed
        yield
    finally:
        for tensors, name, tensor in saved:
            tensors[name] = tensor


def _restore_stored_weights(program, listed: list, weights: WeightStore | None) -> None:
    """Each weight a manifest lists mapped from the store in place of its stand-in."""
    dicts = _weight_dicts(program)
    restored: dict[tuple[str, str], torch.Tensor] = {}
    for where, name, reference in listed:
        if "same_as" in reference:
            tensor = restored[tuple(reference["same_as"])]
        else:
            tensor = weights.tensor(reference)
        dicts[where][name] = restored[where, name] = tensor


def _stored_blob(name: str, path: str) -> Any:
    """A delegate's payload is read (the emitter takes bytes); its named data stays in the file."""
    if name.endswith(".payload") or name.endswith(".state_dict"):
        with open(path, "rb") as f:
            return f.read()
    return file_blob(path)


@contextlib.contextmanager
def _delegate_blobs_aside(program, blobs: dict[str, bytes]) -> Iterator[None]:
    """ExecuTorch's serializer writes each delegate's payload, and its original program's
    weights, as base64 inside JSON inside JSON (a depth-48 Core ML transformer's lowered
    program took 9 s to load, most of it decoding them). While it runs, each delegate holds
    an empty payload and one-element stand-ins for its original weights; the real bytes
    go into zip members of their own (`blobs`), which the load puts back."""
    saved = []
    try:
        for index, module in enumerate(_lowered_modules(program)):
            original = module.original_module
            buffer = io.BytesIO()
            torch.save(dict(original.state_dict), buffer)
            blobs[f"{index}.payload"] = module.processed_bytes
            blobs[f"{index}.state_dict"] = buffer.getvalue()
            named = module.named_data_store_output
            for position, data in enumerate(named.buffers if named is not None else ()):
                blobs[f"{index}.named.{position}"] = data
            saved.append((module, module._processed_bytes, dict(original.state_dict), named))
            module._processed_bytes = b""
            original.state_dict.update({name: _stand_in(t) for name, t in original.state_dict.items()})
            if named is not None:
                set_delegate_named_data(module, dataclasses.replace(named, buffers=[b""] * len(named.buffers)))
        yield
    finally:
        for module, payload, state_dict, named in saved:
            module._processed_bytes = payload
            module.original_module.state_dict.update(state_dict)
            set_delegate_named_data(module, named)


def _restore_delegate_blobs(program, blobs: Mapping[str, bytes]) -> None:
    for index, module in enumerate(_lowered_modules(program)):
        if f"{index}.payload" not in blobs:
            continue
        module._processed_bytes = blobs[f"{index}.payload"]
        state_dict = torch.load(io.BytesIO(blobs[f"{index}.state_dict"]), weights_only=True)
        module.original_module.state_dict.update(state_dict)
        named = module.named_data_store_output
        if named is not None and named.buffers and f"{index}.named.0" in blobs:  # (older files keep them inline)
            buffers = [blobs[f"{index}.named.{position}"] for position in range(len(named.buffers))]
            set_delegate_named_data(module, dataclasses.replace(named, buffers=buffers))


def _symbolic_float_nodes(program) -> list[torch.fx.Node]:
    """Nodes whose value is a float known only at run time (`zuf0` from `.item()` of a
    float tensor, and arithmetic on it)."""
    return [n for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.SymFloat)]


@contextlib.contextmanager
def _symbolic_floats_as_placeholder_ints(program) -> Iterator[None]:
    """ExecuTorch 1.5.1's serializer (a fork of torch.export's, without SymFloat in its
    schema) refuses a node whose value is a symbolic float ("Unable to serialize output
    zuf0"). While it runs, such values read as the integer 0, which it writes as a
    constant; the manifest names those nodes and the load gives them floats back."""
    hidden = [(node, node.meta["val"]) for node in _symbolic_float_nodes(program)]
    try:
        for node, _ in hidden:
            node.meta["val"] = 0
        yield
    finally:
        for node, value in hidden:
            node.meta["val"] = value


def _restore_symbolic_floats(program, names: list[str]) -> None:
    """Give the nodes saved as placeholder integers their symbolic floats back, in graph
    order: a node reading a float from a tensor gets a fresh unbacked float, as capture
    made it; arithmetic on floats (operator.mul, torch.sym_float, ...) is re-evaluated on
    its restored inputs."""
    wanted = set(names)
    nodes = [n for n in program.graph.nodes if n.name in wanted]
    if len(nodes) != len(wanted):
        raise ResumeError(
            "the stage file names symbolic float nodes its graph lacks: "
            f"{sorted(wanted - {n.name for n in nodes})}",
            hint="the file is corrupt or from another version; dump the stages again",
        )
    if not nodes:
        return
    fake_mode = detect_fake_mode([n.meta.get("val") for n in program.graph.nodes])
    shape_env = fake_mode.shape_env
    for node in nodes:
        if any(isinstance(arg.meta.get("val"), torch.Tensor) for arg in node.all_input_nodes):
            with shape_env.ignore_fresh_unbacked_symbols():
                value = shape_env.create_unbacked_symfloat()
            node.meta["unbacked_bindings"] = {value.node.expr: ()}
            program.range_constraints[value.node.expr] = ValueRanges.unknown()
        else:
            value = node.target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args))
        node.meta["val"] = value
    logger.debug("restored %d symbolic floats", len(nodes))


def _restore_requires_grad(program, names: list[str]) -> None:
    """The deserializer makes every value's fake tensor not require grad; the emitter writes
    the flag into the `.pte` (parameters keep it), so a resumed run would emit other bytes."""
    wanted = set(names)
    for node in program.graph.nodes:
        if node.name in wanted:
            node.meta["val"].requires_grad_(True)


def _restore_positional_args(program, positional: dict[str, int]) -> None:
    """Give nodes back the positional arguments the deserializer turned into keywords.

    Partitioners read arguments by position (XNNPACK reads linear's bias as
    `node.args[2]`), so a resumed program must look exactly like the saved one.
    """
    for node in program.graph.nodes:
        want = positional.get(node.name, len(node.args))
        if len(node.args) >= want or not hasattr(node.target, "_schema"):
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        for argument in node.target._schema.arguments[len(args) : want]:
            args.append(kwargs.pop(argument.name, argument.default_value))
        node.args, node.kwargs = tuple(args), kwargs


def _restore_edge_verifier(program, preserved_ops: tuple[str, ...]) -> None:
    """A loaded Edge program gets the default Edge verifier, which refuses the ops kept whole
    for the backend (e.g. aten.linear); give it back the one that allows them."""
    ops = [op_from_name(name) for name in preserved_ops]
    verifier = EXIREdgeDialectVerifier(edge_compile_config=EdgeCompileConfig(), class_only=True, preserve_ops=ops)
    set_verifiers(program, [verifier])


def _restore_tags(program, tags: dict[str, str]) -> None:
    """Put the delegation tags back by node name. The deserializer re-creates the tuple
    accesses (getitem) of multi-output ops under new names, so those take their source's tag."""
    for node in program.graph.nodes:
        if node.name in tags:
            node.meta[DELEGATION_TAG] = tags[node.name]
        elif node.target is operator.getitem and node.args[0].meta.get(DELEGATION_TAG):
            node.meta[DELEGATION_TAG] = node.args[0].meta[DELEGATION_TAG]


def _drop_unused_tuple_accesses(program) -> None:
    """The deserializer adds a getitem for every output of a multi-output op, used or not
    (`..._unused_1`); the saved program had none, and backends count them as outputs."""
    for node in list(program.graph.nodes):
        if node.op == "call_function" and node.target is operator.getitem and not node.users:
            program.graph.erase_node(node)
    program.graph_module.recompile()


def _restore_placeholder_names(program, names: list[str], forward_arg_names: list[str] | None) -> None:
    """The deserializer renames user inputs (`x` -> `arg_0`) and forgets the forward
    argument names later retraces name them by; some backends hash the graph into their
    payload, so a resumed run must see the saved names."""
    signature = program.module_call_graph[0].signature
    if forward_arg_names and signature is not None:
        signature.forward_arg_names = list(forward_arg_names)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        return
    taken = {n.name for n in program.graph.nodes}
    for node, name in zip(placeholders, names):
        if node.name == name or name in taken:
            continue
        old = node.name
        node.name = node.target = name
        taken.add(name)
        for spec in program.graph_signature.input_specs:
            if getattr(spec.arg, "name", None) == old:
                spec.arg.name = name
    program.graph_module.recompile()
