"""The MLX delegate runner of the reference executor (`compiler/running/reference.py`):
ExecuTorch's MLX runtime is Apple-only, so an MLX payload runs here with `mlx.core`."""

from __future__ import annotations

from typing import Any, Sequence

from compiler.backends.mlx.generated import ensure_generated
from compiler.backends.mlx.interpreter import Interpreter, MLXGraph


class MLXDelegate:
    """One MLX payload, decoded and initialised once (constants, mutable buffers at
    zero, the init chain), as the runtime's `init` does; each call then runs it
    with that state, as `execute` does. Constants come from the program's named
    data, and attention nodes use the executor's off-graph `kv_cache`."""

    def __init__(self, payload: bytes, executor: Any) -> None:
        ensure_generated()
        self.graph = MLXGraph(payload)
        self.graph_inputs = len(self.graph.inputs)
        self.interpreter = Interpreter(self.graph, executor.named_data, kv_cache=executor.kv_cache)

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        return self.interpreter.execute(inputs)
