# Found by the fuzz campaign for backend 'mlx' with seed 2031 (case 8), cut by hand to what fails.
# ours:  wrapped error: AssertionError: Constant s3 was tagged to be consumed by the buffer, and was found to also contain a buffer mutation. However this buffer mutation node was found to also be used as other types of outputs which is currently not supported. Please file an issue on Github.
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s3', torch.zeros((2, 2, 2, 2), dtype=torch.int32))

    def forward(self, x0, x1):
        self.s3.add_(x1)
        v4 = self.s3
        v15 = v4.to(torch.int32)
        return (v15, x0 + 1)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randn((2,), dtype=torch.float32), torch.randint(-8, 8, (2, 2, 2, 2), dtype=torch.int32), )
    return model, inputs


BACKEND = 'mlx'
CALLS = 2
TOLERANCES = [0.0, 1e-06]
OUTPUTS = ['v15', 'x0 + 1']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
