"""A binary layer with its own bias takes an int32 bias at scale α_x·α_w (input*weight).

The XNOR accumulator times α_x·α_w is the layer's float output, so the derived bias
scale is as well defined as for int layers; export lowers it (``bias_sign``) and both
backends agree with the fake-quant model.
"""

import numpy as np
import torch

import qdsl
from qdsl.zoo.models import mlp
from qdsl.zoo.train import predict


def test_xnor_spec_on_mlp_with_biases_exports_and_agrees():
    torch.manual_seed(0)
    model = mlp()
    model.net[2] = torch.nn.Hardtanh()  # signed binary activations need signed inputs
    model.net[4] = torch.nn.Hardtanh()
    x = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    qdsl.apply(model, "specs/xnor-binary.qspec")
    qdsl.calibrate(model, [x], progress=False)
    qdsl.freeze(model)
    ints = qdsl.int_tensors(model)
    assert ints["net.3"].weight_kind == "binary"
    assert ints["net.3"].bias.dtype == torch.int32 and ints["net.3"].bias_scale.shape == (32,)
    fq = predict(model, x)
    out = torch.from_numpy(np.asarray(qdsl.run_graph(qdsl.export(model, x[:1]), x.numpy(), backend="reference")))
    assert (out.argmax(1) == fq.argmax(1)).all()
    assert torch.allclose(out, fq, atol=1e-3 * float(fq.abs().max()))
