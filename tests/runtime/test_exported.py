"""The C++ runtime equals the reference executor bit for bit on graphs exported from the
reference models (POT and float-scale specs, int8 and int4 weights, a binary CNN, the
bundled specs), on every kernel path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.export import export  # noqa: E402
from qdsl.graph import execute  # noqa: E402
from qdsl.parse import parse_text  # noqa: E402
from qdsl.runtime import kernels as K  # noqa: E402
from qdsl.zoo.data import digits, synthetic_keywords  # noqa: E402
from qdsl.zoo.models import conv1d_net, digits_resnet  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]

SPEC = """
version 1
fold_bn
quantizer w = int(bits={wbits}, signed, narrow, symmetric, {scale}per_channel, observer=minmax)
quantizer a = int(bits=8, {asig}, per_tensor, {scale}observer=minmax)
defaults {{
  weight = w
  input = a
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}}
rule type:BasicBlock optional {{
  output = a
}}
rule {last} {{
  output = a
}}
"""

BINARY = """
version 1
quantizer wbin = binary(signed, per_channel, observer=mean_abs)
quantizer abin = binary(signed, per_tensor, observer=mean_abs)
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, signed, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = wbin
  input = abin
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule c1, fc {
  weight = w8
  input = a8
}
rule fc {
  output = a8
}
"""


class BinaryCNN(nn.Module):
    """int8 conv -> binary conv (XNOR) -> binary linear -> int8 linear (binary layers without bias)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.a1 = nn.Hardtanh()
        self.c2 = nn.Conv2d(16, 32, 3, padding=1, stride=2, bias=False)
        self.a2 = nn.Hardtanh()
        self.flat = nn.Flatten()
        self.l3 = nn.Linear(32 * 16, 64, bias=False)
        self.a3 = nn.Hardtanh()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = self.a2(self.c2(self.a1(self.c1(x))))
        return self.fc(self.a3(self.l3(self.flat(x))))


@pytest.fixture(scope="module")
def data():
    xtr, _, xte, _ = digits()
    kw = synthetic_keywords(n=600)[0]
    return {"digits": (xtr[:256], xte[:64]), "keywords": (kw[:256], kw[400:464])}


def _exported(model, spec_text, calib, x):
    torch.manual_seed(0)
    model.eval()
    qdsl.apply(model, parse_text(spec_text, "test.qspec"))
    qdsl.calibrate(model, [calib[i:i + 128] for i in range(0, len(calib), 128)])
    qdsl.freeze(model)
    return export(model, x[:2])


def _assert_same(graph, x):
    want = execute(graph, x).outputs[0]
    cg = rt.CompiledGraph(graph)
    for path in PATHS:
        got = cg.run(x, path=path)
        np.testing.assert_array_equal(got, want, err_msg=f"path {path}")
    # and a batch of one (GEMV-shaped layers)
    np.testing.assert_array_equal(cg.run(x[:1]), execute(graph, x[:1]).outputs[0])


CASES = {
    "digits_resnet": (lambda: digits_resnet(seed=0), "fc", "digits"),
    "conv1d_net": (lambda: conv1d_net(seed=0), "classifier", "keywords"),
}


def _model_params():
    # the conv1d graphs and one digits ResNet graph run by default; the rest are slow
    for case in sorted(CASES):
        for pot in (True, False):
            for wbits in (8, 4, 2):
                fast = case == "conv1d_net" or (pot and wbits == 4)
                yield pytest.param(case, pot, wbits, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("case,pot,wbits", list(_model_params()))
def test_exported_models_bit_exact(case, pot, wbits, data):
    build, last, which = CASES[case]
    calib, x = data[which]
    spec = SPEC.format(wbits=wbits, last=last, scale="scale=pot, " if pot else "",
                       asig="signed, symmetric" if pot else "unsigned, asymmetric")
    graph = _exported(build(), spec, calib, x)
    _assert_same(graph, x.numpy())


def test_exported_binary_cnn_bit_exact(data):
    calib, x = data["digits"]
    graph = _exported(BinaryCNN(), BINARY, calib, x)
    _assert_same(graph, x.numpy())


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["int8-default", "pot-asic", "w4a8-per-channel"])
def test_bundled_specs_bit_exact(spec, data):
    calib, x = data["digits"]
    model = digits_resnet(seed=0).eval()
    qdsl.apply(model, qdsl.load_spec(f"specs/{spec}.qspec"))
    qdsl.calibrate(model, [calib[i:i + 128] for i in range(0, len(calib), 128)])
    qdsl.freeze(model)
    _assert_same(export(model, x[:2]), x.numpy())
