"""Running compiled programs: the ExecuTorch runtime, the reference executor for delegates the
pip runtime lacks, and the tolerance a comparison with eager PyTorch accepts."""
