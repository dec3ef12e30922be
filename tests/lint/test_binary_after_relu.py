"""W319: a ReLU feeding a signed binary activation makes every code +1 (without a
learned threshold: the bundled xnor spec has one, so these tests switch it off)."""

import qdsl
from qdsl.zoo.models import conv_bn_relu_net, digits_binary_cnn, digits_resnet


def _w319(model, threshold="none"):
    return [d for d in qdsl.lint("specs/xnor-binary.qspec", "xnor-fpga", model=model,
                                 overrides=[f"input.threshold={threshold}"] if threshold else None) if d.code == "W319"]


def test_relu_network_with_binary_activations_is_warned():
    found = _w319(conv_bn_relu_net(in_ch=1))
    assert found
    d = found[0]
    assert "always +1" in d.message and "xnor-binary.qspec:" in d.render()
    assert any("threshold=learned" in h for h in d.hints)


def test_hardtanh_network_is_not_warned():
    assert not _w319(digits_binary_cnn())


def test_residual_relu_network_is_warned():
    assert _w319(digits_resnet())


def test_learned_threshold_silences_the_warning():
    # the bundled spec as shipped: binary(signed, threshold=learned) after the ReLUs
    assert not _w319(conv_bn_relu_net(in_ch=1), threshold=None)
    assert not _w319(digits_resnet(), threshold=None)
