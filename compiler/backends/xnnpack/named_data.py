"""The named data an XNNPACK payload reads: its weights, stored outside the payload by key.

A program whose weights were written to a data file and is loaded without it makes ExecuTorch
1.5.1's XNNPACK delegate crash the process (a segmentation fault in `load_method`), so the
runtime asks which keys a payload reads before loading it. The payload's graph is a flatbuffer
with no Python reader in ExecuTorch; each constant names its data by the SHA-256 hex digest of
its bytes (`node_visitor.get_serialized_buffer_index`), a 64-character string stored as is (a
quantized weight's scales after a `scale_` prefix).
"""

from __future__ import annotations

import re

from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import XNNHeader

# A digest, alone or after a prefix (a quantized weight's scales are `scale_<digest>`); each string is
# stored after its length, whose last byte next to it is zero for a key this short.
_KEY = re.compile(rb"(?<![A-Za-z0-9_])[A-Za-z0-9_]*[0-9a-f]{64}(?![A-Za-z0-9_])")


def named_data_keys(payload: bytes) -> frozenset[str]:
    """The keys of the named data the payload's graph reads."""
    header = XNNHeader.from_bytes(payload[: XNNHeader.EXPECTED_LENGTH])
    graph = payload[header.flatbuffer_offset : header.flatbuffer_offset + header.flatbuffer_size]
    return frozenset(key.decode() for key in _KEY.findall(graph))
