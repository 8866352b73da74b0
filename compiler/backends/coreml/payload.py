"""Reading a Core ML delegate payload back: the MIL program the backend converted.

The Core ML runtime exists only on macOS, so on other machines what the
backend built is checked here, in the payload: the payload is a flattened
`model.mlpackage` folder, which coremltools reads back as a model spec.
`reproducible()` rewrites a payload stock just built without its random identifiers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import tempfile
import uuid
from typing import Any, Iterator, Mapping

import attrs

from compiler.ir.invariants import register_payload_check
from compiler.ir.private_api import deserialize_pte, named_data_store


BACKEND_ID = "CoreMLBackend"

logger = logging.getLogger(__name__)


@attrs.frozen
class MilOp:
    type: str
    name: str
    # Input name -> the constant's value, for inputs that are constants (e.g. gelu's mode).
    constants: dict = attrs.field(factory=dict)
    # Output names -> their dtype in Core ML's spelling (fp32, int32, bool...).
    outputs: dict = attrs.field(factory=dict)


@attrs.frozen
class CoreMLModel:
    """What a Core ML payload holds: its input/output names and the main function's ops."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: tuple[MilOp, ...]
    specification_version: int

    def op_types(self) -> list[str]:
        return [op.type for op in self.ops]

    def ops_of_type(self, op_type: str) -> list[MilOp]:
        return [op for op in self.ops if op.type == op_type]


def _dtype_name(value_type) -> str:
    from coremltools.proto import MIL_pb2

    tensor = value_type.tensorType
    return MIL_pb2.DataType.Name(tensor.dataType).lower()


# MIL dtypes whose immediate values are stored as raw bytes, as numpy reads them.
_BYTES_DTYPES = {"float16": "float16", "int8": "int8", "uint8": "uint8", "int16": "int16", "uint16": "uint16"}


def _constant(value) -> object:
    imm = value.immediateValue
    tensor = imm.tensor
    for field in ("strings", "bools", "ints", "floats", "longInts", "doubles"):
        if tensor.HasField(field):
            values = list(getattr(tensor, field).values)
            return values[0] if len(values) == 1 else values
    if tensor.HasField("bytes"):
        import numpy as np
        from coremltools.proto import MIL_pb2

        dtype = _BYTES_DTYPES.get(MIL_pb2.DataType.Name(value.type.tensorType.dataType).lower())
        if dtype:
            values = np.frombuffer(tensor.bytes.values, dtype=dtype).tolist()
            return values[0] if len(values) == 1 else values
    return None


def _spec(payload: bytes):
    """The model specification (protobuf) of one Core ML delegate payload."""
    import coremltools as ct
    from executorch.backends.apple.coreml import executorchcoreml

    with tempfile.TemporaryDirectory() as folder:
        executorchcoreml.unflatten_directory_contents(payload, folder)
        package = next(pathlib.Path(folder).rglob("*.mlpackage"))
        return ct.utils.load_spec(str(package))


def input_size_ranges(payload: bytes) -> dict[str, list[tuple[int, int]]]:
    """Input name -> (lower, upper) of each dimension, for the inputs the payload declares with a
    range of sizes (coremltools' RangeDim; an upper bound of -1 is none)."""
    return {
        i.name: [(r.lowerBound, r.upperBound) for r in i.type.multiArrayType.shapeRange.sizeRanges]
        for i in _spec(payload).description.input
        if i.type.multiArrayType.shapeRange.sizeRanges
    }


def read_model(payload: bytes) -> CoreMLModel:
    """Unpack one Core ML delegate payload and read its MIL program (the ops of every function of
    a multifunction model, one function after another in name order)."""
    spec = _spec(payload)
    ops = []
    for function_name in sorted(spec.mlProgram.functions):
        function = spec.mlProgram.functions[function_name]
        ops += _read_ops(function.block_specializations[function.opset].operations)
    return CoreMLModel(
        inputs=tuple(i.name for i in spec.description.input),
        outputs=tuple(o.name for o in spec.description.output),
        ops=tuple(ops),
        specification_version=spec.specificationVersion,
    )


def _read_ops(operations) -> list[MilOp]:
    """One function's ops, the constants they read by name (const ops) resolved into them."""
    const_values = {
        name: _constant(op.attributes["val"]) if "val" in op.attributes else None
        for op in operations
        if op.type == "const"
        for name in [o.name for o in op.outputs]
    }
    ops = []
    for op in operations:
        constants = {}
        for name, argument in op.inputs.items():
            for binding in argument.arguments:
                if binding.HasField("value"):
                    constants[name] = _constant(binding.value)
                elif binding.HasField("name") and binding.name in const_values:
                    constants[name] = const_values[binding.name]
        outputs = {out.name: _dtype_name(out.type) for out in op.outputs}
        ops.append(MilOp(op.type, op.attributes["name"].immediateValue.tensor.strings.values[0]
                         if "name" in op.attributes else "", constants, outputs))
    return ops


# MIL ops that compute f(x + epsilon) with a nonzero default epsilon (inverse 1e-4, rsqrt
# 1e-12, log 1e-45): no torch op means that, so in a payload each must say epsilon 0.
EPSILON_OPS = ("inverse", "rsqrt", "log")


def ops_adding_an_epsilon(model: CoreMLModel) -> list[str]:
    """The ops of `model` that add an epsilon to their input: a default left in, or a nonzero one."""
    found = []
    for op in model.ops:
        epsilon = op.constants.get("epsilon", "left at its default")
        if op.type in EPSILON_OPS and epsilon != 0:
            shown = f"{epsilon:.3g}" if isinstance(epsilon, float) else epsilon
            found.append(f"{op.name or op.type} ({op.type}, epsilon {shown})")
    return found


@register_payload_check(BACKEND_ID, "a Core ML payload computes f(x + epsilon) where the program computes f(x)")
def payload_adds_no_epsilon(processed: bytes, named: Mapping[str, bytes]) -> list[str]:
    return ops_adding_an_epsilon(read_model(stored_model(processed, named)))


# A delegate's processed bytes that name a model stored as the program's named data instead of
# holding it: "CMJR" and JSON {"version": 1, "key": ..., "functionName": ...}, the format stock's
# multimethod preprocess writes and ExecuTorch's Core ML runtime reads (a multifunction model, one
# function per method).
REFERENCE_MAGIC = b"CMJR"


def reference(key: str, function: str) -> bytes:
    """The processed bytes of a delegate running `function` of the model stored under `key`."""
    return REFERENCE_MAGIC + json.dumps({"version": 1, "key": key, "functionName": function}).encode()


def stored_model(processed: bytes, named: Mapping[str, bytes]) -> bytes:
    """The model a delegate's processed bytes hold, or the one they reference in `named`."""
    link = read_reference(processed)
    return processed if link is None else bytes(named[link["key"]])


# A payload of at least this many bytes is stored as the program's named data, its delegate
# holding a reference: the lowering writes it to a file as it is made instead of holding every
# piece's model until the program is emitted (a 4-bit 8B model: 4.5 GB of payloads).
STORED_PAYLOAD_BYTES = 8 << 20


def stored_as_named_data(result: Any) -> Any:
    """A `PreprocessResult` whose large payload becomes the named data it carries (keyed by
    its digest), its processed bytes a reference to it. ExecuTorch's Core ML runtime reads such
    a reference for any model (since 1.2), ignoring the function name for a model of one
    function; a program of several methods (stock's multifunction models) keeps its own."""
    data = result.processed_bytes
    if len(data) < STORED_PAYLOAD_BYTES or result.data_store_output is not None:
        return result
    key = "coreml_" + hashlib.sha256(data).hexdigest()[:32]
    store = named_data_store()
    store.add_named_data(key, data)
    return dataclasses.replace(result, processed_bytes=reference(key, "main"), data_store_output=store.get_named_data_store_output())


def read_reference(processed: bytes) -> dict | None:
    """The reference these processed bytes hold (key, functionName), or None for a payload."""
    return json.loads(processed[len(REFERENCE_MAGIC):]) if processed[:len(REFERENCE_MAGIC)] == REFERENCE_MAGIC else None


def coreml_payloads(pte: bytes) -> Iterator[bytes]:
    """The Core ML delegate payloads of a `.pte`, in execution-plan order; a model several
    delegates reference (a multifunction model of several methods) once, at its first."""
    pte_file = deserialize_pte(pte)
    program, named = pte_file.program, pte_file.named_data
    seen: set[str] = set()
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            if delegate.id != BACKEND_ID:
                continue
            data = delegate.processed
            if not (data.location.name == "INLINE" or int(data.location) == 0):  # not by the default emit config
                raise NotImplementedError("Core ML payload stored in a segment")
            processed = bytes(program.backend_delegate_data[data.index].data)
            link = read_reference(processed)
            if link is None:
                yield processed
            elif link["key"] not in seen:
                seen.add(link["key"])
                yield bytes(named.buffers[named.pte_data[link["key"]].buffer_index])


def read_models(pte: bytes) -> list[CoreMLModel]:
    """Every Core ML model inside a `.pte`."""
    return [read_model(payload) for payload in coreml_payloads(pte)]


# --- Reproducible payloads ----------------------------------------------------------
#
# A payload is ExecuTorch's flattened folder (`executorchcoreml.flatten_directory_contents`,
# runtime/inmemoryfs): the files' bytes one after another, then the folder tree as compact
# JSON with sorted keys, written reversed at the end (`{"nodes": [...]}`, children before
# their folder, the root last; a file node names its `dataRegion` {offset, size} in the
# payload). Readers find the tree by reading back from the end, skipping zero padding.

_PLACEHOLDER = "executorch_" + str(uuid.UUID(int=0))
_NAMESPACE = uuid.NAMESPACE_URL


def _read_tree(payload: bytes) -> tuple[str, dict]:
    """(root name, tree), a tree mapping a file's name to its bytes (a view into `payload`,
    not a copy: the weights are most of it) and a folder's to a tree."""
    end = len(payload.rstrip(b"\0"))
    size = 4096
    while True:
        tail = payload[max(0, end - size):end][::-1].decode("latin-1")
        try:
            metadata, _ = json.JSONDecoder().raw_decode(tail)
            break
        except json.JSONDecodeError:
            if size >= end:
                raise
            size *= 4
    built: list[tuple[str, object]] = []
    view = memoryview(payload)
    for node in metadata["nodes"]:
        name = node["name"].encode("latin-1").decode("utf-8")
        if node["kind"] == 0:
            region = node["dataRegion"]
            built.append((name, view[region["offset"]:region["offset"] + region["size"]]))
        else:
            built.append((name, {child.encode("latin-1").decode("utf-8"): built[index][1]
                                 for child, index in node["children"].items()}))
    return built[-1]


def _write_tree(root: str, tree: dict) -> bytes:
    """The payload ExecuTorch's flattening writes for this tree with alignment 1 (files of
    less than 1 GB), its nodes in name order instead of the order the folder was listed in."""
    return b"".join(_tree_parts(root, tree))


def _tree_digest(root: str, tree: dict) -> str:
    """The SHA-256 of `_write_tree(root, tree)`, without joining its parts into one copy."""
    digest = hashlib.sha256()
    for part in _tree_parts(root, tree):
        digest.update(part)
    return digest.hexdigest()


def _tree_parts(root: str, tree: dict) -> list:
    data: list = []
    nodes: list[dict] = []
    offset = 0

    def add(name: str, item) -> int:
        nonlocal offset
        if isinstance(item, dict):
            children = {child: add(child, item[child]) for child in sorted(item)}
            node = {"children": children, "dataRegion": {"offset": 0, "size": 0}, "kind": 1, "name": name}
        else:
            node = {"children": {}, "dataRegion": {"offset": offset, "size": len(item)}, "kind": 0, "name": name}
            data.append(item)
            offset += len(item)
        nodes.append(node)
        return len(nodes) - 1

    add(root, tree)
    text = json.dumps({"nodes": nodes}, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return [*data, text.encode("utf-8")[::-1]]


def _content_digest(tree: dict) -> str:
    digest = hashlib.sha256()
    for path, data in _walk(tree):
        digest.update(f"{path}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _walk(tree: dict, prefix: str = "") -> Iterator[tuple[str, bytes]]:
    for name in sorted(tree):
        if isinstance(tree[name], dict):
            yield from _walk(tree[name], f"{prefix}{name}/")
        else:
            yield f"{prefix}{name}", tree[name]


def _deterministic_specs(tree: dict) -> None:
    """Every `.mlmodel` spec serialized with its map fields in key order (protobuf writes maps,
    e.g. the metadata's `userDefined` and MIL op attributes, in an order that changes from
    one process to the next)."""
    from coremltools.proto import Model_pb2

    for name, item in tree.items():
        if isinstance(item, dict):
            _deterministic_specs(item)
        elif name.endswith(".mlmodel"):
            spec = Model_pb2.Model()
            spec.ParseFromString(bytes(item))
            tree[name] = spec.SerializeToString(deterministic=True)


def _deterministic_package(package: dict) -> None:
    """A `.mlpackage`'s specs written in a fixed order, then its Manifest item ids made from
    each item's entry and content (coremltools draws them at random), as uppercase UUIDs like
    coremltools writes on macOS; the Manifest written as coremltools does (4-space indent,
    sorted keys)."""
    _deterministic_specs(package)
    manifest = json.loads(bytes(package["Manifest.json"]))
    renamed = {}
    for old, entry in manifest["itemInfoEntries"].items():
        item = package.get("Data", {})  # an item's path is relative to the package's Data folder
        for part in entry["path"].split("/"):
            item = item.get(part, {}) if isinstance(item, dict) else {}
        content = _content_digest(item if isinstance(item, dict) else {"": item})
        name = f"coreml-item:{json.dumps(entry, sort_keys=True)}:sha256:{content}"
        renamed[old] = str(uuid.uuid5(_NAMESPACE, name)).upper()
    manifest["itemInfoEntries"] = {renamed[k]: v for k, v in manifest["itemInfoEntries"].items()}
    if manifest.get("rootModelIdentifier") in renamed:
        manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    package["Manifest.json"] = (json.dumps(manifest, indent=4, sort_keys=True, ensure_ascii=False) + "\n").encode()


def reproducible(payload: bytes) -> bytes:
    """`payload` with nothing random or machine-dependent left in it: the same model, options
    and versions give the same bytes.

    Stock puts `"identifier": "executorch_" + uuid4()` in the payload's `metadata.json`,
    coremltools gives the `.mlpackage`'s Manifest items random ids and writes the model
    spec's protobuf maps in an order that differs between processes, and the flattened
    folder lists files in the order the temporary folder did. The Core ML runtime names
    (and may cache compiled) models by that identifier, so it cannot be a constant: it
    becomes `executorch_` + a UUID (v5) made from the SHA-256 of the whole payload,
    computed with the identifier set to a placeholder; Manifest ids are made from each
    item's content; specs are written with deterministic protobuf serialization; the files
    are written in name order. A payload this does not
    recognise is returned unchanged, with a warning."""
    if not payload:
        return payload
    try:
        root, tree = _read_tree(payload)
        for name, item in list(tree.items()):
            if name.endswith(".mlpackage") and isinstance(item, dict) and "Manifest.json" in item:
                _deterministic_package(item)
        metadata = json.loads(bytes(tree["metadata.json"])) if "metadata.json" in tree else None
        if metadata is None or "identifier" not in metadata:
            return _write_tree(root, tree)
        metadata["identifier"] = _PLACEHOLDER
        tree["metadata.json"] = json.dumps(metadata).encode()  # as stock writes it
        digest = _tree_digest(root, tree)
        metadata["identifier"] = "executorch_" + str(uuid.uuid5(_NAMESPACE, f"coreml-payload:sha256:{digest}"))
        tree["metadata.json"] = json.dumps(metadata).encode()
        return _write_tree(root, tree)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        logger.warning("coreml: payload left as stock wrote it (not reproducible): %s", exc)
        return payload
