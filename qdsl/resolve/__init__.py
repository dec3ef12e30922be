"""Resolve a spec against a model into a frozen, fully explicit :class:`Plan`.

Public API::

    resolve(model_or_index, spec, *, registries=None, overrides=None) -> Plan
    check_spec(spec, registries=None) -> list[Diagnostic]     # no model needed
    explain(plan, layers=None, roles=None) -> str              # provenance table
    to_records(plan, layers=None, roles=None) -> list[dict]    # the same, as JSON records
    validate_recipe(recipe, role, spans) -> list[Diagnostic]
    load_model_ref("pkg.mod:factory" | "path/file.py:factory") -> nn.Module

Semantics (the details live in each module's docstring):

* ``targets.py``  - target forms (exact, glob with ``*``/``**``/``?``/``[...]``, ``re:``
  full match, ``type:`` exact class name, no subclasses) and their specificity.
* ``resolver.py`` - which modules get a layer plan, the field-by-field cascade
  (built-in < defaults < type < glob/regex < exact < overrides), ``priority`` and
  conflicts, skip / ``kind = float``, overrides, provenance.
* ``presets.py``  - ``extends`` chains and how a preset's fields carry provenance.
* ``validate.py`` - built-in defaults and validity rules, group granularity definition.
* ``check.py``    - what is checked without a model.

Nothing here imports torch: a model is indexed by duck typing
(``ModelIndex.from_module``), so ``qdsl check`` works in a torch-free environment.

Diagnostic codes (stable; E2xx = resolve):

======  ==============================================================================
E201    a rule target matches no module (rule not ``optional``); hint: close names
E202    a rule matches modules but applies to none (none has the tensor it sets)
E203    an exact-name rule sets weight/bias on a module without that parameter, or a ``type:``
        rule on a class without a weight kernel (``type:LayerNorm { weight = ... }``)
        or a recurrent role on a class that is not recurrent (``type:Linear { hidden = ... }``); not an
        ``optional`` rule naming a parameterless container (it sets the container's input/output)
E204    unknown observer / rounding / scale rule name; lists the registered names
E205    unknown observer parameter
E206    bad observer parameter value
E207    ``extends`` names an unknown preset
E208    cycle in preset ``extends`` chains (the whole chain is shown)
E209    two rules at the same specificity and priority set one field differently
E210    bits out of range (1..16; bias up to 32), or a 1-bit int grid with < 2 codes
        (signed: -1..0; narrow: 0..0)
E211    kind constraint: binary needs bits 1, ternary 2, pot >= 2; all are symmetric
E212    group granularity on a non-weight tensor, or group size not positive
E213    learned scale on a dynamic quantizer
E214    ``input*weight`` scale on a non-bias tensor, without quantized input and weight, or
        with scales that do not multiply into one per output channel (input not per
        tensor, weight per group / along another axis / dynamic)
E215    observer not allowed for the kind (``mean_abs`` is for binary/ternary)
E216    channel axis out of range for the tensor's dimensions (weights; a convolution's
        activations, which have its weight's rank; other activations: E507 at run time)
E217    group size does not divide the weight's reduction size
E218    malformed target (empty, bad regex, unterminated ``[``) or rule without targets
E219    ``dynamic`` on a weight or bias (it is for activations)
E220    ``threshold = learned`` on a weight/bias, or on a kind other than signed binary
E222    a rule that sets nothing
E223    a rule that both skips and sets quantizers
E224    a minifloat kind that names no format (``fp8_e3m2``: 1 + 3 + 2 is 6 bits, not 8; bias
        out of range; ``_ieee`` with 1 exponent bit), or ``kind = minifloat`` without a format
======  ==============================================================================
"""

from qdsl._callable import make_callable
from qdsl.resolve.check import check_spec
from qdsl.resolve.explain import explain, to_records
from qdsl.resolve.model_ref import load_model_ref
from qdsl.resolve.resolver import resolve
from qdsl.resolve.validate import validate_recipe

__all__ = ["resolve", "check_spec", "explain", "to_records", "validate_recipe", "load_model_ref"]


make_callable(__name__, resolve)  # qdsl.resolve(model, spec) keeps working (qdsl/_callable.py)
