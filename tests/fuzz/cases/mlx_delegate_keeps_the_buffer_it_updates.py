# Found by `python -m compiler fuzz --backend mlx --examples 150 --seed 2027` (case 89): MLX takes over the buffer it updates, and emit trusted a delegate call site that still recorded the buffer's new value as an output.
# ours:  named error: run: ReferenceExecutionError: a delegate returned shape (11, 2) for program value 4, whose shape is fixed at (3,): the payload computes more elements than the program has room for (a conversion fault; a device cannot fit them either)
# stock: ok: 
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('c3', torch.randint(-8, 8, (1,), dtype=torch.int8))
        self.register_buffer('s5', torch.zeros((3,), dtype=torch.int8))
        self.p8 = torch.nn.Parameter(torch.randn((2, 3, 3), dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x0, x1):
        v1 = x1.reshape(3, 1, 1, 1)
        v2 = torch.cat([x1, x0], 0)
        v4 = v2 * self.c3
        self.s5.add_(x1)
        v6 = self.s5
        v7 = -v2
        v9 = self.p8[1:]
        v10 = torch.bitwise_not(v2)
        v11 = torch.stack([v10, v10], 1)
        return (v11, x1, v10,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randint(-8, 8, (8,), dtype=torch.int8), torch.randint(-8, 8, (3,), dtype=torch.int8), )
    return model, inputs


BACKEND = 'mlx'
CALLS = 2
TOLERANCES = [0.0, 0.0, 0.0]
OUTPUTS = ['v11', 'x1', 'v10']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
