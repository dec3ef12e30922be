"""Lint knows the recurrent roles (issue 19): weight_ih/weight_hh take the profile's weight
caps, hidden its input caps, the cell state counts on integer-only targets, and both
per-step products get a worst-case accumulator bound."""

from torch import nn

from qdsl.lint import lint
from qdsl.parse import parse_text


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(300, 600, 2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(1200, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


POT8 = """version 1
defaults { weight = int(bits=8, signed, symmetric, scale=pot)  input = int(bits=8, unsigned, scale=pot) }
rule type:LSTM { hidden = int(bits=8, signed, symmetric, scale=pot) }
"""


def _on(d, layer):
    return f"on layer {layer}" in d.notes


def test_both_products_of_a_step_get_a_worst_case_accumulator_bound():
    diags = lint(parse_text(POT8, "r.qspec"), "pot-asic-24bit-acc", Encoder(), calibrated=False)
    acc = [d for d in diags if d.code == "W313" and _on(d, "rnn")]
    msgs = sorted(d.message for d in acc)
    # 2^7·2^7·600 needs 25 bits (signed × signed); 2^7·255·1200 needs 27 (the layer-1 input: 2·600)
    assert "weight_hh 8-bit signed × hidden 8-bit signed, fan-in 600" in msgs[0] and "needs 25 bits" in msgs[0]
    assert "weight_ih 8-bit signed × input 8-bit unsigned, fan-in 1200" in msgs[1] and "needs 27 bits" in msgs[1]
    assert all(d.span.line == 2 for d in acc)
    # integer-only target: the cell state nobody quantized is named
    cell = [d for d in diags if d.code == "E312" and d.message.startswith("cell.kind")]
    assert len(cell) == 1 and _on(cell[0], "rnn")
    assert any(d.code == "E310" and "'lstm'" in d.message for d in diags)


def test_hidden_is_checked_against_the_input_caps():
    text = POT8.replace("hidden = int(bits=8, signed, symmetric, scale=pot)", "hidden = int(bits=8, unsigned, scale=pot)")
    diags = lint(parse_text(text.replace("scale=pot", "scale=float"), "r.qspec"), "tflite-int8", Encoder(),
                 calibrated=False)
    hidden = [d for d in diags if d.message.startswith("hidden.signed = false")]
    assert len(hidden) == 1 and _on(hidden[0], "rnn") and hidden[0].span.line == 3


class _Head(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[1][-1])


W8 = """version 1
defaults { weight = int(bits=8, signed, symmetric, per_channel)  input = int(bits=8, unsigned) }
rule type:GRU, type:RNN { hidden = int(bits=8, signed, symmetric) }
"""


def test_w321_names_the_recurrent_layers_export_refuses_only():
    """GRU/LSTM/RNN have graph ops: no W321, as export agrees (before the RNN op, nn.RNN got one)."""
    spec = parse_text(W8, "r.qspec")
    for layer in (nn.GRU(4, 16, batch_first=True), nn.RNN(4, 16, batch_first=True)):
        found = [d for d in lint(spec, "tflite-int8", _Head(layer), calibrated=False) if d.code == "W321"]
        assert found == [], type(layer).__name__