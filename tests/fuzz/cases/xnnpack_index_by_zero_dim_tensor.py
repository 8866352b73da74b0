# Found by `python -m compiler fuzz --backend xnnpack --seed 6` (case 0).
# ours:  wrapped error: GuardOnDataDependentSymNode: Could not guard on data-dependent expression 2 <= -u6 - 1 (unhinted: 2 <= -u6 - 1).  (Size-like symbols: none)
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x0, x1, x2):
        v1 = torch.relu(x1)
        v2 = x0 + x1
        v3 = x0.select(0, 0)
        v4 = x0[v3.long().clamp(0, 1)]
        return (v4,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randint(-8, 8, (2,), dtype=torch.int64), torch.randn((2,), dtype=torch.float32), torch.randn((2,), dtype=torch.float32), )
    return model, inputs


BACKEND = 'xnnpack'
CALLS = 1
TOLERANCES = [0.0]
OUTPUTS = ['v4']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
