"""The Core ML delegate runner of the reference executor (`compiler/running/reference.py`).

The Core ML runtime exists only on Apple systems; here a Core ML payload's MIL program
runs in the MIL reference interpreter (`interpreter.py`), bound to the delegate call the
way ExecuTorch's Core ML delegate binds it: the call's first arguments are the model's
inputs in the payload's `metadata.json` order (`inputNames`), the rest its outputs
(`outputNames`); each input is converted to the dtype the model declares and each output
back to the program's tensor (the runtime copies through `MLMultiArray`s). Core ML state
starts at zero, as `MLModel.newState` allocates it, and carries from call to call. A delegate
whose payload is a reference to a model stored as the program's named data (a multifunction
model of several methods, `multifunction.py`) runs the function the reference names, with that
function's input and output names from the model's metadata, as the runtime does.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from compiler.backends.coreml.interpreter import STAGE, MilInterpreter, MilInterpreterError, load_payload
from compiler.backends.coreml.payload import read_reference


class AliasedPayloadOutput(MilInterpreterError):
    """A payload output that is also an input or another output: how the runtime binds such
    buffers is not MIL semantics, so the reference runner does not guess."""


class CoreMLDelegate:
    def __init__(self, payload: bytes, executor: Any = None) -> None:
        link = read_reference(payload)
        function = "main" if link is None else link["functionName"]
        program, metadata = load_payload(payload if link is None else bytes(executor.named_data[link["key"]]))
        if "methods" in metadata:  # a multifunction model: this delegate's function
            metadata = {**metadata, **metadata["methods"][function]}
        self.interpreter = MilInterpreter(program, function)
        self.input_names = list(metadata.get("inputNames", self.interpreter.input_names))
        self.output_names = list(metadata.get("outputNames", self.interpreter.output_names))
        self.identifier = metadata.get("identifier", "?")
        self._refuse_aliased_outputs()
        self.interpreter.state = self.interpreter.zero_state()
        self.graph_inputs = len(self.input_names)

    @property
    def computes_in_float16(self) -> bool:
        return self.interpreter.computes_in_float16

    def _refuse_aliased_outputs(self) -> None:
        seen: set[str] = set()
        for position, name in enumerate(self.output_names):
            problem = (
                "is also an input of the model" if name in self.input_names
                else "is returned twice" if name in seen
                else None
            )
            seen.add(name)
            if problem:
                error = AliasedPayloadOutput(
                    f"Core ML payload {self.identifier}: output {name!r} {problem}; how the Core ML "
                    "runtime binds one buffer to two tensors is not defined by the MIL program, so "
                    "the reference runner cannot run it",
                    stage=STAGE, nodes=[name],
                    hint="compile with this project's Core ML backend, which gives every output its own "
                    "value (stock ExecuTorch returns an input itself for ops such as clone)",
                )
                error.output = position  # which of the delegate's outputs (compiler.locate names its node)
                raise error

    def _bound(self, name: str, value: np.ndarray) -> np.ndarray:
        """The delegate copies an input's elements into the array the model declares: a 0-d
        tensor into the rank-1 input coremltools makes of it (Core ML has no 0-d inputs)."""
        shape = self.interpreter.input_shape(name)
        if shape is not None and value.shape != shape and value.size == math.prod(shape):
            return value.reshape(shape)
        return value

    def execute(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        given = {name: self._bound(name, _as_numpy(value)) for name, value in zip(self.input_names, inputs)}
        outputs = self.interpreter.run(given)
        return [torch.from_numpy(np.ascontiguousarray(outputs[name])) for name in self.output_names]


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
