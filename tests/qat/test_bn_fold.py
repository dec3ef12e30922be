"""QAT BatchNorm folding: equivalence with the unfolded model, statistics, freezing, removal."""

import copy

import pytest
import torch
from torch import nn

from qdsl.qat import bn_fold, ste
from qdsl.testing import models


def _digits_like(n=16, seed=0):
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_pairs_found_by_tracing_including_residual_blocks():
    pairs = bn_fold.find_conv_bn_pairs(models.digits_resnet(width=8))
    assert ("stem.0", "stem.1") in pairs
    assert ("layer1.0.conv1", "layer1.0.bn1") in pairs and ("layer2.0.conv2", "layer2.0.bn2") in pairs
    assert ("layer2.0.downsample.0", "layer2.0.downsample.1") in pairs
    assert len(pairs) == 1 + 4 * 2 + 1
    assert bn_fold.find_conv_bn_pairs(models.conv1d_net()) == [
        ("features.0", "features.1"), ("features.3", "features.4"), ("features.6", "features.7")]


@pytest.mark.parametrize("factory,shape", [(models.digits_resnet, (16, 1, 8, 8)), (models.conv1d_net, (8, 1, 64))])
def test_identity_fold_equals_unfolded_in_train_and_eval(factory, shape):
    ref = factory(width=8)
    qat = copy.deepcopy(ref)
    handle = bn_fold.QatBnFold(qat)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for train in (True, False):
        ref.train(train)
        qat.train(train)
        y_ref, y = ref(x), qat(x)
        assert torch.allclose(y, y_ref, atol=1e-5, rtol=1e-4)
        y_ref.square().sum().backward()
        y.square().sum().backward()
    # running statistics were updated identically by the training forward
    for (n, b), (_, b2) in zip(ref.named_buffers(), qat.named_buffers()):
        assert torch.allclose(b.float(), b2.float(), atol=1e-5), n
    # gradients reach the float master weight and the BN affine parameters alike
    g_ref = dict(ref.named_parameters())
    for name, p in qat.named_parameters():
        key = name.replace("parametrizations.weight.original", "weight")
        assert torch.allclose(p.grad, g_ref[key].grad, atol=1e-4, rtol=1e-3), name
    handle.remove()


def test_quantizer_sees_the_folded_weight_and_eval_equals_folded_inference():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=True)
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    model = nn.Sequential(conv, bn).eval()
    seen = []

    def quant(w):
        seen.append(w.detach().clone())
        return ste.fake_quant(w, torch.tensor(0.02), None, -8, 7)

    w_fold, b_fold = bn_fold.folded_weight_and_bias(conv, bn)
    w_fold, b_fold = w_fold.detach(), b_fold.detach()
    bn_fold.QatBnFold(model, quantizers={"0": quant})
    x = torch.randn(2, 3, 6, 6)
    y = model(x)
    assert torch.allclose(seen[-1], w_fold)
    expected = nn.functional.conv2d(x, ste.fake_quant(w_fold, torch.tensor(0.02), None, -8, 7), b_fold, padding=1)
    assert torch.allclose(y, expected, atol=1e-5)


def test_freeze_bn_stats_keeps_running_stats_and_uses_them_in_train():
    model = models.conv_bn_relu_net(width=4)
    handle = bn_fold.QatBnFold(model)
    model.train()
    x = torch.randn(4, 3, 8, 8)
    model(x)
    assert bn_fold.freeze_bn_stats(model) == 3
    before = copy.deepcopy(model.state_dict())
    model.train()
    y_train = model(x)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model.eval()
    assert torch.allclose(y_train, model(x))  # training forward == inference forward
    assert bn_fold.unfreeze_bn_stats(model) == 3
    model.train()
    model(x)
    assert not torch.equal(model.features[1].running_mean, before["features.1.running_mean"])
    handle.remove()


def test_remove_restores_state_dict_bit_for_bit():
    model = models.digits_resnet(width=8)
    sd = copy.deepcopy(model.state_dict())
    handle = bn_fold.QatBnFold(model, quantizers={"stem.0": lambda w: ste.binary_weight(w)})
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: master weights must not drift
    model(_digits_like()).sum().backward()
    opt.step()
    handle.remove()
    assert set(model.state_dict()) == set(sd)
    for k, v in model.state_dict().items():
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(v, sd[k]), k


def test_double_install_is_refused():
    model = models.conv_bn_relu_net(width=4)
    bn_fold.QatBnFold(model)
    with pytest.raises(ValueError, match="already parametrized"):
        bn_fold.QatBnFold(model)
