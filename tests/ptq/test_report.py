"""The PTQ decision record: held-back split and the report table."""

import torch

from qdsl.ptq.report import LayerDecision, PtqReport, split_heldback


def test_split_holds_back_every_kth_batch_and_keeps_the_rest():
    batches = [torch.full((2, 3), float(i)) for i in range(8)]
    fit, held = split_heldback(batches, every=4)
    assert [int(b[0, 0]) for b in held] == [3, 7]
    assert [int(b[0, 0]) for b in fit] == [0, 1, 2, 4, 5, 6]


def test_split_two_batches_gives_one_each_side():
    fit, held = split_heldback([torch.zeros(1), torch.ones(1)])
    assert len(fit) == 1 and len(held) == 1 and float(held[0]) == 1.0


def test_single_tensor_batch_is_split_along_rows():
    x = torch.arange(16.0).reshape(8, 2)
    fit, held = split_heldback([x], every=4)
    assert fit[0].shape[0] == 6 and held[0].shape[0] == 2
    assert torch.equal(torch.cat([fit[0], held[0]]), x)


def test_single_dict_batch_cannot_be_split():
    fit, held = split_heldback([{"x": torch.zeros(4)}])
    assert len(fit) == 1 and held == []


def test_report_table_and_gain():
    r = PtqReport()
    r.add(LayerDecision("conv1", "gptq", True, 2.0, 1.0))
    r.add(LayerDecision("fc", "bias_correction", False, 1.0, 1.5, "made it worse"))
    assert r.for_step("gptq")[0].gain == 0.5
    assert r.for_step("bias_correction")[0].gain == -0.5
    text = r.format()
    assert "conv1" in text and "made it worse" in text and len(text.splitlines()) == 3
    assert PtqReport().format() == "PTQ steps: none ran"
