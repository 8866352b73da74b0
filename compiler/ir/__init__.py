"""Typed artifacts that flow between stages, their dialects and their invariants.

This package imports nothing else of ours, so every layer above can use it.
"""
