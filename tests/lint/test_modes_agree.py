"""Spec-only and model-aware lint agree on what the spec's defaults get wrong.

For random defaults on a model that has every op the defaults reach (conv2d and
linear), the capability findings (E301-E308, E312, E316) located in the spec are the
same set in both modes: spec-only lint neither misses nor invents one.
"""

from __future__ import annotations

from functools import lru_cache

from hypothesis import given, settings, strategies as st

from qdsl.lint import lint
from qdsl.parse import parse_text

CAPABILITY = {"E301", "E302", "E303", "E304", "E305", "E306", "E307", "E308", "E312", "E316"}


@lru_cache(maxsize=1)
def _model():
    from qdsl.zoo.models import digits_resnet

    return digits_resnet()


def _quant(kind, bits, signed, symmetric, narrow, scale, gran, dynamic) -> str:
    fields = [f'kind = "{kind}"']
    if kind == "int":
        fields += [f"bits = {bits}", f"signed = {str(signed).lower()}", f"symmetric = {str(symmetric).lower()}",
                   f"narrow_range = {str(narrow).lower()}"]
    fields += [f'scale = "{scale}"', f'granularity = "{gran}"']
    if dynamic:
        fields.append("dynamic = true")
    return "{ " + ", ".join(fields) + " }"


weights = st.tuples(st.sampled_from(["int", "binary"]), st.sampled_from([4, 8]), st.booleans(), st.booleans(),
                    st.booleans(), st.sampled_from(["float", "pot", "learned"]),
                    st.sampled_from(["tensor", "channel"]), st.just(False))
inputs = st.tuples(st.just("int"), st.sampled_from([4, 8]), st.booleans(), st.booleans(), st.just(False),
                   st.sampled_from(["float", "pot"]), st.just("tensor"), st.booleans())
bias = st.sampled_from(['"float"', '{ kind = "int", bits = 32, scale = "input*weight" }',
                        '{ kind = "int", bits = 16, scale = "float" }'])


@settings(max_examples=15, deadline=None)
@given(w=weights, x=inputs, b=bias,
       profile=st.sampled_from(["tflite-int8", "x86-fbgemm", "pot-asic-24bit-acc", "int-only-photonic"]))
def test_spec_only_and_model_aware_agree_on_defaults(w, x, b, profile):
    if w[0] == "binary" and b != '"float"':
        b = '"float"'  # a derived bias needs int operands (the resolver's rule)
    text = (f"version = 1\nfold_bn = true\n[defaults]\nweight = {_quant(*w)}\ninput = {_quant(*x)}\n"
            f"bias = {b}\n")
    spec = parse_text(text, "r.qspec.toml")

    def found(diags):
        return {(d.code, d.span.line, d.span.col) for d in diags if d.code in CAPABILITY and d.span.known}

    assert found(lint(spec, profile)) == found(lint(spec, profile, _model()))
