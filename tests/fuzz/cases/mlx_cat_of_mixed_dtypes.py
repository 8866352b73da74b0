# Found by `python -m compiler fuzz --backend mlx --seed 3` (case 0).
# ours:  wrapped error: SpecViolationError: These operators are taking Tensor inputs with mismatched dtypes:
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x0, x1):
        v1 = torch.relu(x0)
        v2 = torch.relu(x0)
        v3 = torch.relu(x0)
        v4 = torch.relu(x0)
        v5 = torch.relu(x0)
        v6 = torch.cat([x1, x0], 0)
        return (v6,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randn((2, 2), dtype=torch.float32), torch.randn((3, 2), dtype=torch.float16), )
    return model, inputs


BACKEND = 'mlx'
CALLS = 1
TOLERANCES = [2e-06]
OUTPUTS = ['v6']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
