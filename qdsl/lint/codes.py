"""Lint diagnostic codes: stable, one meaning each (the table in ``docs/profiles.md``).

E3xx findings make a spec unusable on the target; W3xx are likely mistakes or risks.
``qdsl lint`` exits 1 when it reports any of them.  SARIF output lists this table as
the tool's rules.
"""

from __future__ import annotations

__all__ = ["CODES", "title"]

CODES: dict[str, str] = {
    "E301": "tensor kind not supported (int/binary/ternary/pot/float)",
    "E302": "bit width not supported",
    "E303": "signedness not supported",
    "E304": "scale type not supported (float/pot, or the bias's input*weight)",
    "E305": "granularity, channel axis or group size not supported",
    "E306": "zero point not supported: symmetric quantization required",
    "E307": "narrow range required (or forbidden)",
    "E308": "dynamic (run-time) scales not supported",
    "E309": "learned binarisation threshold (threshold = learned) not supported",
    "E310": "op type not supported by the target",
    "E311": "op supported only fused after another op",
    "E312": "float left on an integer-only target (skipped layer, float tensor, float op)",
    "W313": "worst-case accumulator width exceeds the target's (or the spec's narrower) accumulator",
    "E314": "accumulator overflow reachable with the actual integer weights",
    "E315": "spec's accumulator is wider than, or overflows differently from, the target's",
    "E316": "bias rule violated (own scale where input*weight is required or vice versa, float bias, "
    "derived scale without quantized operands)",
    "E317": "output quantization conflicts with the target's fixed output range for the op",
    "W318": "pairs of raw products can saturate the target's intermediate pair sum (x86 VPMADDUBSW)",
    "W319": "signed binary activation fed by a ReLU: every code is +1 (a constant input)",
    "W320": "weights wider than their format can export (power-of-two beyond 4 bits spans more than int8; on a "
            "frozen model, minifloat/group-scaled weights that are not exact int8 per output channel)",
    "W321": "op with no integer lowering (the catalog's construct table), or an integer op reading a value no "
            "module can carry a quantizer for (y * torch.sigmoid(y)), or an activation format with no graph type "
            "(minifloat): qdsl.export refuses the model",
    "W330": "rule matches no layer (and is not optional)",
    "W331": "rule fully shadowed: everything it sets is overridden on every layer it matches",
    "W340": "model could not be traced: functional ops were not checked",
}


def title(code: str) -> str:
    return CODES.get(code, code)
