"""A `save_pretrained` folder's model whose weights are its safetensors files, mapped.

`from_pretrained` reads every weight into the process: an 8B checkpoint is 16 GB held before the
compile starts. Here the model is built with its parameters on the meta device (no float copy
is made; buffers such as rotary tables are built as usual) and each parameter becomes a view of
the checkpoint's mapped file (`compiler.ir.mapped`): a page is read when a stage reads the
weight, and dropped again between stages. A model this cannot map whole (a weight missing from
the files, renamed by transformers' loading, of another shape, or read in another dtype) is
loaded by `from_pretrained` instead, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from typing import Any, Iterator

import attrs
import torch

from compiler.ir.errors import UserInputError
from compiler.ir.mapped import mapped_file, tensor_in

logger = logging.getLogger(__name__)

_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@attrs.frozen
class _Entry:
    path: str
    offset: int  # from the file's start
    dtype: torch.dtype
    shape: tuple[int, ...]


def _entries(path: str) -> dict[str, _Entry]:
    """The tensors a safetensors file holds, from its header (8 bytes of length, then JSON)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= size - 8:
                raise ValueError(f"its header says it is {length} bytes long, in a file of {size} bytes")
            header = json.loads(f.read(length))
        ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
        if 8 + length + max(ends, default=0) > size:
            raise ValueError(f"its tensors end at byte {8 + length + max(ends)}, past the file's {size} bytes (truncated?)")
    except (ValueError, struct.error, KeyError, TypeError, IndexError) as exc:
        raise UserInputError(
            f"the checkpoint's weights file {path} is not a readable safetensors file: its header is broken ({exc})",
            hint="write the folder again with save_pretrained, or copy the file again if it was cut short",
        ) from exc
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {name} is of dtype {info['dtype']}, which this loader does not map")
        entries[name] = _Entry(path, 8 + length + info["data_offsets"][0], dtype, tuple(info["shape"]))
    return entries


def safetensors_entries(folder: str) -> dict[str, _Entry]:
    """Every tensor of the folder's safetensors files (one file, or the shards of one)."""
    entries: dict[str, _Entry] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            entries.update(_entries(os.path.join(folder, name)))
    return entries


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built in this block get their parameters on the meta device (their buffers stay
    real: a rotary table is computed in `__init__`, and the checkpoint does not hold it)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _why_not_mapped(module: torch.nn.Module, entries: dict[str, _Entry], dtype: torch.dtype) -> str | None:
    for name, param in module.named_parameters(remove_duplicate=False):
        entry = entries.get(name)
        if entry is None:
            continue  # a tied copy: found by its twin's name, or reported there
        if entry.shape != tuple(param.shape):
            return f"{name} is {list(entry.shape)} in the checkpoint and {list(param.shape)} in the model"
        if entry.dtype != dtype:
            return f"{name} is {entry.dtype} in the checkpoint, read as {dtype}"
    return None


def mapped_model(auto_class: Any, folder: str, config: Any, dtype: torch.dtype) -> torch.nn.Module | None:
    """The model `auto_class` (transformers' `AutoModelFor...`) makes of `config`, from `config`, every parameter a view of the folder's mapped
    safetensors files; None when the folder's weights cannot be mapped onto it as they are."""
    entries = safetensors_entries(folder)
    if not entries:
        return None
    with _parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype)
    why = _why_not_mapped(model, entries, dtype)
    # Parameters a module shares (a tied lm_head) are one object: one view for all of its names.
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    if why is None:
        missing = [names[0] for names in shared.values() if not any(n in entries for n in names)]
        if missing:
            why = f"the checkpoint holds no {missing[0]}" + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
    if why is not None:
        logger.info("the weights of %s are read whole: %s", folder, why)
        return None
    maps = {path: mapped_file(path) for path in {e.path for e in entries.values()}}
    modules = dict(model.named_modules())
    for names in shared.values():
        entry = entries[next(n for n in names if n in entries)]
        weight = torch.nn.Parameter(tensor_in(maps[entry.path], entry.offset, entry.dtype, entry.shape), requires_grad=False)
        for name in names:
            owner, _, attribute = name.rpartition(".")
            modules[owner]._parameters[attribute] = weight
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in entries:  # a persistent buffer the checkpoint holds: small, copied in
                entry = entries[name]
                buffer.copy_(tensor_in(maps[entry.path], entry.offset, entry.dtype, entry.shape))
    return model.eval()
