# Found by `python -m compiler fuzz --backend mlx --seed 3` (case 113).
# ours:  wrapped error: AssertionError: Constant s9 was tagged to be consumed by the buffer, and was found to also contain a buffer mutation. However this buffer mutation node was found to also be used as other types of outputs which is currently not supported. Please file an issue on Github. 
# stock: named error: AssertionError: Constant s9 was tagged to be consumed by the buffer, and was found to also contain a buffer mutation. However this buffer mutation node was found to also be used as other types of outputs which is currently not supported. Please file an issue on Github. 
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('c1', torch.tensor([[[False, True, True]]], dtype=torch.bool))
        self.p3 = torch.nn.Parameter(torch.randn((1,), dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer('s5', torch.zeros((1, 1, 3, 4), dtype=torch.int64))
        self.register_buffer('s9', torch.zeros((1, 1, 3, 4), dtype=torch.int64))
        self.register_buffer('s11', torch.randn((1,), dtype=torch.bfloat16))
        self.register_buffer('c13', torch.tensor([0], dtype=torch.int64))
        self.register_buffer('c14', torch.tensor([True, True], dtype=torch.bool))

    def forward(self, x0):
        v2 = x0[self.c1]
        v4 = self.p3
        self.s5.copy_(x0)
        v6 = self.s5 * 2
        v7 = torch.cat([v4, v4], 0)
        v8 = F.softmax(v7, dim=0)
        v10 = self.s9 + x0
        self.s9.copy_(v10)
        v15 = v7[self.c14]
        v16 = F.normalize(v7, dim=-1)
        v17 = v10[:, :, -2:]
        return (v17, v10,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randint(-8, 8, (1, 1, 3, 4), dtype=torch.int64), )
    return model, inputs


BACKEND = 'mlx'
CALLS = 2
TOLERANCES = [0.0, 0.0]
OUTPUTS = ['v17', 'v10']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
