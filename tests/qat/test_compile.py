"""torch.compile of an applied QAT model: outputs, gradients and state equal eager (slow: compiling)."""

import pytest
import torch

import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.zoo.models import conv_bn_relu_net
from pathlib import Path

SPECS = Path(__file__).resolve().parents[2] / "specs"


class _HardtanhNet(torch.nn.Module):
    """conv-BN-hardtanh (binary activations of a ReLU output would be constant)."""

    def __init__(self, width=8):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, padding=1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.Hardtanh(),
            torch.nn.Conv2d(width, width, 3, padding=1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.Hardtanh())
        self.classifier = torch.nn.Linear(width, 10)

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["int8-default.qspec", "pot-asic.qspec", "xnor-binary.qspec"])
def test_compiled_qat_step_matches_eager(spec):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _HardtanhNet() if spec.startswith("xnor") else conv_bn_relu_net(width=8)
    apply(model, SPECS / spec)
    x = torch.randn(8, 3, 16, 16)
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    model.train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    # load it here too, as before the eager step below: loading bumps the weights' versions,
    # so both steps see "changed" weights (a searched range starts being carried in both)
    model.load_state_dict(start)
    compiled = torch.compile(model, backend="aot_eager")
    y = compiled(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    after = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad()
    model.load_state_dict(start)
    y_eager = model(x)
    y_eager.square().sum().backward()
    assert torch.equal(y, y_eager)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
        assert p.grad.abs().sum() > 0, n
    for k, v in model.state_dict().items():
        assert torch.equal(v, after[k]), k  # BN running statistics updated alike
    model.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
