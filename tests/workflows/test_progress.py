"""Training progress: one line per epoch off a terminal, a redrawn bar on one; the
training loops report every step (and nothing when the result comes from the cache)."""

import io

import torch

import qdsl
import qdsl.qat
from qdsl.zoo.models import mlp
from qdsl.zoo.train import train_float
from qdsl.workflows.progress import TrainProgress


def _feed(p, epochs, steps):
    for e in range(epochs):
        for s in range(steps):
            p(e, s, steps, 1.0 + e)


def test_one_line_per_epoch_when_not_a_terminal():
    buf = io.StringIO()  # isatty() is False
    p = TrainProgress("train", 3, stream=buf)
    _feed(p, 3, 5)
    lines = buf.getvalue().splitlines()
    assert [line.split()[:3] for line in lines] == [["train", "epoch", f"{e}/3"] for e in (1, 2, 3)]
    assert [line.split()[4] for line in lines] == ["1.000", "2.000", "3.000"]  # the epoch's mean loss
    assert "\r" not in buf.getvalue() and p.steps == 15


def test_a_bar_on_a_terminal():
    buf = io.StringIO()
    p = TrainProgress("train", 2, stream=buf, tty=True)
    _feed(p, 2, 4)
    text = buf.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    assert text.rsplit("\r", 1)[1].split()[:4] == ["train", "epoch", "2/2", "[" + "#" * 20 + "]"]


class _Calls(list):
    def __call__(self, *args):
        self.append(args)


def test_train_float_reports_every_step_and_nothing_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QDSL_TRAIN_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(70, 1, 8, 8, generator=g), torch.randint(0, 10, (70,), generator=g)
    calls = _Calls()
    train_float(mlp(), x, y, epochs=2, batch_size=32, progress=calls)
    # 70 samples in batches of 32: 32, 32, 6 -> 3 steps per epoch
    assert [c[:3] for c in calls] == [(e, s, 3) for e in range(2) for s in range(3)]
    again = _Calls()
    train_float(mlp(), x, y, epochs=2, batch_size=32, progress=again)
    assert again == []


def test_qat_fit_reports_every_step():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)
    model = mlp()
    qdsl.apply(model, qdsl.load_spec("specs/int8-default.qspec"))
    qdsl.calibrate(model, [x], progress=False)
    calls = _Calls()
    qdsl.qat.fit(model, x, y, epochs=2, batch_size=16, progress=calls)
    assert [c[:3] for c in calls] == [(e, s, 3) for e in range(2) for s in range(3)]
    assert all(c[3] > 0 for c in calls)
