# Found by `python -m compiler fuzz --backend coreml --seed 4` (case 2).
# ours:  named error: VerificationError: [partition] invariant 'cpu_ops_have_kernels' violated: ops left on the CPU have no kernel in the ExecuTorch runtime
# stock: compiled: 
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c4 = torch.tensor([[[True, False]], [[False, False]], [[False, True]], [[False, False]]], dtype=torch.bool)
        self.p9 = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float32), requires_grad=False)

    def forward(self, x0, x1):
        v1 = x0.to(dtype=torch.uint8)
        v2 = x0.all(2, keepdim=False)
        v3 = v2.all(1, keepdim=True)
        v5 = v1[self.c4]
        v6 = torch.ones((4, 3))
        v7 = torch.full((2,), 7)
        v8 = torch.softmax(v6, -1)
        v10 = v6 @ self.p9
        return (v10, x0,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.rand((4, 1, 2)) > 0.5, torch.randint(-8, 8, (1, 1, 5, 2), dtype=torch.int32), )
    return model, inputs


BACKEND = 'coreml'
CALLS = 1
TOLERANCES = [4.8e-05, 0.0]
OUTPUTS = ['v10', 'x0']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
