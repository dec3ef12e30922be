"""QAT under DistributedDataParallel (gloo, CPU, 2 processes) equals single-process training.

Each rank calibrates on its own half of the data; ``sync_observers`` makes the
statistics (and so every scale) identical on both ranks and equal to calibrating on all
the data in one process.  Training the global batch split over two ranks then gives the
same parameters and learned scales as one process on the whole batch.  BatchNorm
statistics are frozen (inference fold) so per-rank batch statistics do not differ.
"""

import os

import pytest
import torch

SPEC = """version 1
fold_bn
quantizer w4 = int(bits=4, signed, narrow, symmetric, per_channel, scale=learned, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, scale=learned, observer=minmax)
quantizer a8h = int(bits=8, signed, symmetric, per_tensor, observer=histogram(percentile=99.9))
defaults {
  weight = w4
  input = a8
}
rule classifier {
  input = a8h
}
"""
STEPS = 3
GLOBAL_BATCH = 16


def _data():
    g = torch.Generator().manual_seed(0)
    calib = torch.randn(32, 3, 8, 8, generator=g)
    x = torch.randn(STEPS, GLOBAL_BATCH, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (STEPS, GLOBAL_BATCH), generator=g)
    return calib, x, y


def _prepared(calib, sync: bool = False):
    """Applied and calibrated on ``calib``: through ``calibrate`` (which syncs observers
    across ranks) when ``sync``, else observing in the ``calibrating`` context (no sync)."""
    import qdsl.qat
    from qdsl.parse import parse_text
    from qdsl import calibrate, calibrating
    from qdsl.patch import apply
    from qdsl.zoo.models import conv_bn_relu_net

    model = conv_bn_relu_net(width=4, seed=0)
    apply(model, parse_text(SPEC, "ddp.qspec"))
    if sync:
        calibrate(model, [calib])
    else:
        with calibrating(model), torch.no_grad():
            model(calib)
    return model


def _finish_setup(model, calib):
    import qdsl.qat

    qdsl.qat.freeze_bn_stats(model)
    with torch.no_grad():  # initialises the learned scales from the (synchronised) observers
        model(calib[:2])
    model.train()


def _train(model, forward, xs, ys):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    import qdsl.qat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        calib, xs, ys = _data()
        half = len(calib) // world
        model = _prepared(calib[rank * half:(rank + 1) * half])
        torch.save(_state(model), os.path.join(out_dir, f"calib_unsynced{rank}.pt"))
        qdsl.qat.sync_observers(model)
        torch.save(_state(model), os.path.join(out_dir, f"calib{rank}.pt"))
        # calibrate() itself syncs under torch.distributed: same state as the explicit sync
        auto = _prepared(calib[rank * half:(rank + 1) * half], sync=True)
        torch.save(_state(auto), os.path.join(out_dir, f"calib_auto{rank}.pt"))
        _finish_setup(model, calib)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        b = GLOBAL_BATCH // world
        _train(model, ddp, xs[:, rank * b:(rank + 1) * b], ys[:, rank * b:(rank + 1) * b])
        torch.save(_state(model), os.path.join(out_dir, f"final{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_ranks_equal_single_process(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    calib, xs, ys = _data()
    ref = _prepared(calib)
    ref_calib = _state(ref)
    c0, c1 = (torch.load(tmp_path / f"calib{r}.pt") for r in (0, 1))
    # histograms merged across ranks bin differently from one histogram of all the data;
    # train the reference from the synchronised calibration so only training differs
    ref.load_state_dict(c0)
    _finish_setup(ref, calib)
    _train(ref, ref, xs, ys)
    ref_final = _state(ref)

    u0, u1 = (torch.load(tmp_path / f"calib_unsynced{r}.pt") for r in (0, 1))
    obs = [k for k in c0 if ".observer." in k and ":input" in k]
    assert obs and any(not torch.equal(u0[k], u1[k]) for k in obs)  # the shards really differed
    for k in obs:
        assert torch.equal(c0[k], c1[k]), k  # identical on every rank after the sync
    a0 = torch.load(tmp_path / "calib_auto0.pt")
    for k in obs:
        assert torch.equal(a0[k], c0[k]), k  # calibrate() synced by itself
        if "min_val" in k or "max_val" in k:
            assert torch.equal(c0[k], ref_calib[k]), k  # minmax: exactly the single-process result
    f0, f1 = (torch.load(tmp_path / f"final{r}.pt") for r in (0, 1))
    learned = [k for k in f0 if k.endswith("scale_rule.scale")]
    assert len(learned) >= 6
    for k, v in f0.items():
        assert torch.equal(v, f1[k]), k
        if v.is_floating_point():
            # gradient all-reduce sums in another order than one big batch: float noise only
            assert torch.allclose(v, ref_final[k], atol=1e-5, rtol=1e-4), (k, (v - ref_final[k]).abs().max())
        else:
            assert torch.equal(v, ref_final[k]), k
    moved = [k for k in learned if not torch.equal(ref_calib.get(k, torch.empty(0)), f0[k])]
    assert moved  # the learned scales trained
