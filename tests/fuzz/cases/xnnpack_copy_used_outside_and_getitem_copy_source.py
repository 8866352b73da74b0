# Found by `python -m compiler fuzz --backend xnnpack --seed 2026` (case 285).
# ours:  wrapped error: AttributeError: 'builtin_function_or_method' object has no attribute '_schema'
# stock: named error: RuntimeError: Output node 'aten_view_copy_default' is already in the inputs. This is likely due to pass through arguments, which are not supported in XNNPACK Delegate.
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p1 = torch.nn.Parameter(torch.randn(8, 3, dtype=torch.float16), requires_grad=False)
        self.register_buffer('s3', torch.randn((2, 2, 8), dtype=torch.float16))
        self.register_buffer('c5', torch.tensor([-2], dtype=torch.int64))
        self.p6 = torch.nn.Parameter(torch.randn((1, 2, 8), dtype=torch.float16), requires_grad=False)
        self.c15 = torch.tensor([[False, True], [True, True]], dtype=torch.bool)
        self.register_buffer('s16', torch.randn((2, 2, 1), dtype=torch.float16))
        self.register_buffer('s19', torch.randn((1, 2, 8), dtype=torch.float16))

    def forward(self, x0):
        v2 = F.linear(x0, self.p1.t())
        self.s3[self.c5] = x0[self.c5]
        v4 = self.s3[1:]
        v7 = x0 >= self.p6
        v8 = x0 <= 0.5
        v9, v10, v11, = v2.chunk(3, 2)
        v12 = F.hardswish(v4)
        v13 = v8[1:2]
        v14 = v2.clone()
        v14[self.c15] = 0.0
        self.s16.copy_(v9)
        v17 = self.s16 * 2
        v18 = v7.any(0, keepdim=True)
        self.s19.add_(v12)
        v20 = self.s19
        v21 = v14.unsqueeze(1)
        return (v21, v2, v10,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randn((2, 2, 8), dtype=torch.float16), )
    return model, inputs


BACKEND = 'xnnpack'
CALLS = 2
TOLERANCES = [0.002, 0.256, 0.256]
OUTPUTS = ['v21', 'v2', 'v10']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
