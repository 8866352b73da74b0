"""The reference interpreter frees each value after its last reader: a run holds the values
live at once, not every weight it dequantized (a 3B model's check ran out of memory on that)."""

import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from compiler.backends.coreml.interpreter import MilInterpreter

WIDTH, LAYERS = 256, 12


def _chain_of_dequantized_linears():
    rng = np.random.default_rng(0)
    weights = [rng.integers(-8, 8, (WIDTH, WIDTH)).astype(np.int8) for _ in range(LAYERS)]
    scales = [(0.02 * rng.random((WIDTH, WIDTH // 32))).astype(np.float16) for _ in range(LAYERS)]

    @mb.program(input_specs=[mb.TensorSpec(shape=(4, WIDTH), dtype=types.fp16)], opset_version=ct.target.iOS18)
    def prog(x):
        for data, scale in zip(weights, scales):
            weight = mb.constexpr_blockwise_shift_scale(data=data, scale=scale)
            x = mb.linear(x=x, weight=weight)
        return x

    return prog, weights, scales


def test_run_frees_dequantized_weights_after_their_reader():
    program, weights, scales = _chain_of_dequantized_linears()
    interpreter = MilInterpreter(program)
    held = []
    run_op = interpreter._run_op

    def measuring(op, env):
        run_op(op, env)
        held.append(sum(v.nbytes for v in env.values() if isinstance(v, np.ndarray)))

    interpreter._run_op = measuring
    x = np.random.default_rng(1).random((4, WIDTH)).astype(np.float16)
    [out] = interpreter.run({interpreter.input_names[0]: x}).values()

    one_weight = WIDTH * WIDTH * 2  # float16, dequantized
    assert max(held) < 3 * one_weight, (max(held), LAYERS * one_weight)
    expected = x.astype(np.float32)
    for data, scale in zip(weights, scales):
        dense = (np.repeat(scale, 32, axis=1) * data.astype(np.float16)).astype(np.float32)
        expected = (expected @ dense.T).astype(np.float16).astype(np.float32)
    assert 1e-3 < np.abs(expected).max() < 1e3
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def test_a_check_keeps_no_mil_program_once_the_payload_ran(monkeypatch):
    """coremltools' MIL objects hold each other in cycles: a check dropping its program left a 3B
    model's weights to the collector (1.2 GB held after a 0.5B check; 7 GB at 3B) while the eager
    reference ran. Collection is off here, so only the check's own release can free them. (A
    program under `COLLECT_AFTER_BYTES` is left to the collector: this small one stands for a
    large one.)"""
    import gc

    import torch
    from coremltools.converters.mil.mil import Program

    import compiler
    from compiler.running import runtime
    from compiler.running.runtime import compare_at

    monkeypatch.setattr(runtime, "COLLECT_AFTER_BYTES", 0)

    torch.manual_seed(0)
    model, inputs = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval(), (torch.randn(2, 64),)
    result = compiler.compile(model, inputs, "coreml", cache=False)
    gc.collect()
    gc.disable()
    try:
        assert compare_at(result, model, inputs).passed
        alive = [o for o in gc.get_objects() if isinstance(o, Program)]
    finally:
        gc.enable()
    assert not alive
