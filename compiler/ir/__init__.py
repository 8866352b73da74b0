"""Typed artifacts that flow between stages, their dialects and their invariants, and the one
module that names ExecuTorch's private API.

The bottom layer: it imports nothing else of ours, so every layer above can use it
(checked by the import contracts in pyproject.toml).
"""
