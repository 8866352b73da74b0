"""Imported for what it loads: the pipeline's modules (torch and ExecuTorch with them), their
import-time output captured rather than printed.

A sweep's fork server imports it once; every worker it forks starts with these modules
loaded instead of importing them itself (about 5 s of each worker's start here).
"""

try:
    from compiler.process.dependency_output import DependencyOutput

    with DependencyOutput():
        import compiler.api  # noqa: F401
        import compiler.driver.pipeline  # noqa: F401
        from compiler.stages import default_stages

        default_stages()
except Exception:  # noqa: BLE001 - a job meets the same error and records it
    pass
