# Found by `python -m compiler fuzz --backend coreml --seed 4` (case 0).
# ours:  wrapped error: ValueError: Op "aten_slice_scatter_default" (op_type: torch_tensor_assign) Input x="dim_order_ops__clone_dim_order_default" expects tensor or scalar of dtype from type domain ['fp16', 'fp32', 'int32'] but got tensor[3,2,2,2,bool]
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('c3', torch.rand((2, 2, 2, 2)) > 0.5)

    def forward(self, x0, x1):
        v1 = torch.relu(x0)
        v2 = x1.clone()
        v2[0:2] = self.c3
        v4 = torch.relu(x0)
        v5 = torch.relu(x0)
        v6 = torch.relu(x0)
        v7 = torch.relu(x0)
        v8 = torch.relu(x0)
        v9 = torch.relu(x0)
        v10 = ~v2
        return (v10,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randn((2, 2, 2), dtype=torch.float32), torch.rand((3, 2, 2, 2)) > 0.5, )
    return model, inputs


BACKEND = 'coreml'
CALLS = 1
TOLERANCES = [0.0]
OUTPUTS = ['v10']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
