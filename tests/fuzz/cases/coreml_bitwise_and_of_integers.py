# Found by `python -m compiler fuzz --backend coreml --examples 40 --seed 2029` (case 5, shrunk): coremltools converts bitwise_and only of bool tensors; ours delegated an integer one and the lower stage failed.
# ours:  wrapped error: NotImplementedError: The `bitwise_and` op only supports boolean input, but get [int, int].
# stock: named error: the same NotImplementedError
import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x0):
        v1 = -x0
        v2 = x0 & x0
        return (v2,)


def make():
    torch.manual_seed(0)
    model = Program().eval()
    inputs = (torch.randint(-8, 8, (2,), dtype=torch.int64), )
    return model, inputs


BACKEND = 'coreml'
CALLS = 1
TOLERANCES = [0.0]
OUTPUTS = ['v2']

if __name__ == '__main__':
    from compiler.tools.fuzz.oracle import replay

    replay(__file__)
