"""Weight memory of QAT with and without lean weights (``qdsl.qat.lean.LeanOptimizer``).

For ``ConvBnReluNet`` (3×32×32) and ``DigitsResNet`` (1×8×8), with 4-bit and 8-bit
per-channel symmetric weights (8-bit activations, no BN folding: lean form needs the
quantizer to see the master weight itself), this builds the applied, calibrated model
twice and counts the bytes of the weight tensors actually held after a training step
(``qdsl.qat.lean.weight_bytes``: ``tensor.numel() * element_size()`` of every tensor
the patched layers' modules hold for their weights, and of the fp32 masters held by
the lean optimizer):

* ``normal``  fp32 master ``weight_float`` + fp32 fake-quantized ``weight`` of the last
  forward, per patched layer;
* ``lean module``  packed codes + per-channel scale (+ zero point);
* ``lean total``  lean module + the fp32 masters in the optimizer.

Optimizer moments (Adam's two fp32 tensors per weight) are the same in both and left out.

    python benchmarks/qat_memory.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import qdsl.qat  # noqa: F401  (QAT gradient path)
from qdsl.parse import parse_text
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.qat.lean import LeanOptimizer, weight_bytes
from qdsl.zoo.models import conv_bn_relu_net, digits_resnet

SPEC = """version 1
quantizer w = int(bits={bits}, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults {{
  weight = w
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}}
"""


def _measure(make, shape, bits):
    torch.manual_seed(0)
    x = torch.randn(16, *shape)
    y = torch.randint(0, 10, (16,))
    spec = parse_text(SPEC.format(bits=bits), f"w{bits}.qspec")
    model = make()
    apply(model, spec)
    calibrate(model, [x])
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    normal, _ = weight_bytes(model)

    model = make()
    apply(model, spec)
    calibrate(model, [x])
    model.train()
    lean = LeanOptimizer(model, torch.optim.Adam, lr=1e-3)
    lean.zero_grad()
    F.cross_entropy(model(x), y).backward()
    lean.step()
    module, masters = weight_bytes(model, lean)
    n = sum(lay.master.numel() for lay in lean.layers.values())
    return n, len(lean.layers), len(lean.skipped), normal, module, module + masters


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'model':<16}{'bits':>5}{'weights':>9}{'layers':>8}{'normal B':>11}{'lean mod B':>12}"
          f"{'ratio':>7}{'lean tot B':>12}{'ratio':>7}")
    for name, make, shape in (("ConvBnReluNet", conv_bn_relu_net, (3, 32, 32)),
                              ("DigitsResNet", digits_resnet, (1, 8, 8))):
        for bits in (4, 8):
            n, lean_layers, skipped, normal, module, total = _measure(make, shape, bits)
            print(f"{name:<16}{bits:>5}{n:>9}{f'{lean_layers}/{lean_layers + skipped}':>8}{normal:>11}"
                  f"{module:>12}{normal / module:>6.1f}x{total:>12}{normal / total:>6.2f}x")


if __name__ == "__main__":
    main()
