# Found by `python -m compiler fuzz --backend coreml --seed 3` (case 5).
# ours:  wrapped error: ValueError: To use fp16 input, please set minimum deployment target to iOS16+
# stock: named error: ValueError: State model is supported only >= iOS18. Please update the minimum_deployment_target to at least coremltools.target.iOS18
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s2', torch.randn((8, 4, 5), dtype=torch.float16))
        self.p4 = torch.nn.Parameter(torch.randn((5, 3, 3), dtype=torch.float32), requires_grad=False)
        self.register_buffer('c6', torch.randn(5, dtype=torch.float32))
        self.register_buffer('c7', torch.rand(5, dtype=torch.float32) + 0.5)
        self.p8 = torch.nn.Parameter(torch.randn(5, dtype=torch.float32), requires_grad=False)
        self.p9 = torch.nn.Parameter(torch.randn(5, dtype=torch.float32), requires_grad=False)
        self.c10 = torch.randn((8, 5, 4), dtype=torch.float16)
        self.register_buffer('c12', torch.tensor([False, False, True, True, True, False, True, False], dtype=torch.bool))

    def forward(self, x0, x1):
        v1 = x1.mT
        self.s2[torch.tensor([2], dtype=torch.int64)] = x1[torch.tensor([2], dtype=torch.int64)]
        v3 = self.s2[1:]
        v5 = F.conv1d(x0, self.p4, None, stride=2, padding=0, groups=1)
        v5 = F.batch_norm(v5, self.c6, self.c7, self.p8, self.p9, False, 0.1, 1e-5)
        v11 = v1 >= self.c10
        v13 = v11[self.c12]
        v14 = torch.cat([x0, x0], 0)
        return (v14,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randn((3, 3, 4), dtype=torch.float32), torch.randn((8, 4, 5), dtype=torch.float16), )
    return model, inputs


BACKEND = 'coreml'
CALLS = 2
TOLERANCES = [2e-06]
OUTPUTS = ['v14']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
