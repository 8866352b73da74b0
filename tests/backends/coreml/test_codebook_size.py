"""A 4-bit codebook program holds its codes once, packed: 4 bits each in the Core ML payload.
The .pte also held the uint8 codes TorchAO keeps (read in the ATen program only by a metadata
assert the Edge dialect drops): 801 KB for a 512-wide MLP whose payload is 276 KB."""

import torch

import compiler
from compiler.backends.coreml.payload import coreml_payloads


def test_codebook_codes_are_stored_once_and_packed():
    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)).eval()
    result = compiler.compile(model, (torch.randn(4, width),), "coreml", quantize="codebook", cache=False)
    packed_codes = 2 * width * width // 2  # two layers, 4 bits a weight
    [payload] = coreml_payloads(result.pte)
    assert len(payload) < packed_codes * 1.1
    assert len(result.pte) < len(payload) + 16 * 1024
    lowered = result.stages["lower"].program
    assert not [name for name, value in {**lowered.state_dict, **lowered.constants}.items() if value.dtype == torch.uint8]
