"""Searched weight ranges during QAT: search again on request.

The ``mse`` observer (and ``auto`` below 8 bits) searches a weight's clipping range once
(at calibration, or at the first forward when never calibrated) and then *carries* it
through training as a clip ratio per channel applied to the current weight's min/max
(:class:`qdsl.quantizers.observers.MseObserver` explains why).  :func:`research_ranges`
is the explicit way to search again, e.g. after loading new weights into an applied
model without calibrating, or every few epochs of a long QAT run::

    qdsl.qat.research_ranges(model)            # every carried weight range, now
    qdsl.qat.research_ranges(model, ["fc"])    # only these layers

Periodic searches are a spec setting (``observer=mse(search_every=N)``) or
``qdsl.qat.prepare_qat(model, weight_search_every=N)``.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from qdsl.patch.handle import get_handle
from qdsl.spec.diagnostics import QdslError

__all__ = ["research_ranges"]


def research_ranges(model: nn.Module, layers: Iterable[str] | None = None) -> int:
    """Search the carried weight/bias ranges of an applied model again, now, on the current
    weights (then training carries the new clip ratios).  ``layers``: module names to
    limit it to (unknown names are an error).  Frozen quantizers are left alone.  Returns
    how many quantizers searched."""
    handle = get_handle(model)
    names = list(handle.layers) if layers is None else list(layers)
    unknown = [n for n in names if n not in handle.layers]
    if unknown:
        raise QdslError(f"research_ranges: no quantized layer named {', '.join(map(repr, unknown))}")
    n = 0
    for name in names:
        patch = handle.layers[name]
        hit = False
        for q in patch.param_proxies():
            obs = getattr(q, "observer", None)
            if q is None or q.frozen or not hasattr(obs, "request_search"):
                continue
            obs.request_search()
            q._observed = None  # the proxy's "same tensor, skip observing" memo: observe now
            hit = True
            n += 1
        if hit:
            patch.refresh_now()  # recomputes module.weight/bias: the proxies observe, i.e. search
    return n
