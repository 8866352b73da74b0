"""coremltools' converter registry is patched only inside `conversion.installed()`, and two
compiles in threads share the fixes: both see them while either is inside, and the
registry is exactly what it was once both have left."""

import threading

from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

from compiler.backends.coreml import conversion


def _registry() -> dict:
    return _TORCH_OPS_REGISTRY.name_to_func_mapping


def _fixed(converter, original) -> bool:
    """A fix wraps the original converter once (functools.wraps), never a fix of it."""
    return converter is not original and getattr(converter, "__wrapped__", None) is original


def test_two_threads_share_the_fixes_and_the_last_one_out_restores():
    before = dict(_registry())
    inside = threading.Barrier(2, timeout=30)
    first_left = threading.Event()
    seen: dict[str, list] = {"first": [], "second": []}
    errors: list[BaseException] = []

    def compile_(role: str) -> None:
        try:
            with conversion.installed():
                inside.wait()  # both threads are inside the block now
                seen[role].append(_fixed(_registry()["gelu"], before["gelu"]))
                inside.wait()
                if role == "second":
                    assert first_left.wait(timeout=30)
                    # The other compile has left: this one must still convert with the fixes.
                    seen[role].append(_fixed(_registry()["gelu"], before["gelu"]))
            if role == "first":
                first_left.set()
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)
            inside.abort()
            first_left.set()

    threads = [threading.Thread(target=compile_, args=(role,)) for role in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert not errors, errors
    assert seen == {"first": [True], "second": [True, True]}
    assert _registry() == before  # the same converters, not wrappers of them
    assert all(_registry()[name] is converter for name, converter in before.items())


def test_nested_blocks_install_once_and_restore_at_the_outermost():
    before = dict(_registry())
    with conversion.installed():
        outer = dict(_registry())
        with conversion.installed():
            assert _registry() == outer  # not wrapped twice
        assert _registry() == outer
    assert _registry() == before


def test_a_failing_block_restores_the_registry():
    before = dict(_registry())
    try:
        with conversion.installed():
            raise RuntimeError("conversion failed")
    except RuntimeError:
        pass
    assert _registry() == before


def test_a_converter_registered_inside_the_block_stays_registered():
    before = dict(_registry())

    def made_up_converter(context, node):
        pass

    try:
        with conversion.installed():
            _registry()["made_up_converter"] = made_up_converter
        assert _registry()["made_up_converter"] is made_up_converter
        assert {n: c for n, c in _registry().items() if n != "made_up_converter"} == before
    finally:
        _registry().pop("made_up_converter", None)


def test_two_core_ml_compiles_in_threads_both_convert_with_the_fixes():
    """torch.export and coremltools keep process-wide tracing state (two at once fail with
    "ProxyTorchDispatchMode slot already occupied" or "Var %x not visible in the block"),
    so the driver runs one stage at a time: both compiles finish, both with the fixes."""
    import torch
    import torch.nn.functional as F

    import compiler
    from compiler.backends.coreml.payload import read_models

    class Gelu(torch.nn.Module):
        def forward(self, x):
            return F.gelu(x, approximate="tanh")  # stock converts it as the exact GELU

    before = dict(_registry())
    start = threading.Barrier(2, timeout=60)
    modes, errors = {}, []

    def compile_(name: str, size: int) -> None:
        try:
            start.wait()
            pte = compiler.compile(Gelu(), (torch.randn(2, size),), "coreml").pte
            modes[name] = [op.constants["mode"] for m in read_models(pte) for op in m.ops_of_type("gelu")]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=compile_, args=args) for args in (("a", 4), ("b", 8))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert modes == {"a": ["TANH_APPROXIMATION"], "b": ["TANH_APPROXIMATION"]}
    assert _registry() == before
