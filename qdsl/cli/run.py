"""``qdsl run GRAPH --input FILE.npy [--output FILE.npy] [--backend auto|reference|cpp] [--plan]``.

Loads and validates a ``.qgraph`` file, runs it on the array stored in the ``.npy`` input
file, and writes the output array (``.npy``) or prints a short summary. A graph with
several inputs takes ``--input`` once per input, in the graph's input order
(``-i x.npy -i mask.npy``) or by name (``-i x=x.npy -i mask=m.npy``), or one ``.npz``
whose keys are the input names; several outputs are written to an ``.npz`` by name. ``--overflow``
prints the per-layer accumulator overflow counts (reference backend). ``--plan`` prints,
per op, what the C++ runtime proved and chose: the input's value range, the AVX2 int
kernel of convs and linears, and whether an accumulator can overflow (no input needed).
A corrupt graph, a missing file or an input of the wrong shape/dtype exits 2 with a message.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run", "print_plan", "plan_names"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run an integer graph (.qgraph) on a .npy input",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("graph", help="the .qgraph file")
    p.add_argument("--input", "-i", action="append",
                   help="input array (.npy), batch first (required unless --plan); several inputs: repeat it, "
                        "in input order or as NAME=FILE.npy, or pass one .npz keyed by input name")
    p.add_argument("--output", "-o", help="write the output array here (.npy); several outputs: .npz")
    p.add_argument("--backend", choices=("auto", "reference", "cpp"), default="auto")
    p.add_argument("--overflow", action="store_true", help="print accumulator overflow counts per layer (reference)")
    p.add_argument("--plan", action="store_true",
                   help="print per op the proven input range and the kernel choice of the C++ runtime")
    p.set_defaults(func=run)


def _load_npy(path: str):
    import numpy as np

    from qdsl.spec.diagnostics import QdslError

    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise QdslError(f"cannot read input array {path!r}: {e}") from None


def _read_inputs(graph, specs: list[str]):
    """The graph's inputs from ``--input`` values: a tuple (positional) or a dict by name."""
    import numpy as np

    from qdsl.spec.diagnostics import QdslError

    if len(specs) == 1 and specs[0].endswith(".npz") and "=" not in specs[0]:
        try:
            with np.load(specs[0], allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:
            raise QdslError(f"cannot read input arrays {specs[0]!r}: {e}") from None
    named = ["=" in s for s in specs]
    if any(named) and not all(named):
        raise QdslError("--input: give every input by name (NAME=FILE.npy) or none")
    if all(named):
        pairs = [s.split("=", 1) for s in specs]
        return {k: _load_npy(v) for k, v in pairs}
    if len(specs) != len(graph.inputs):
        raise QdslError(f"the graph takes {len(graph.inputs)} input(s) ({', '.join(graph.inputs)}), "
                        f"got {len(specs)} --input file(s)")
    arrays = [_load_npy(s) for s in specs]
    return arrays[0] if len(arrays) == 1 else tuple(arrays)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from qdsl.graph import execute, load_graph
    from qdsl.runtime.run import run_graph

    from qdsl.spec.diagnostics import QdslError

    graph = load_graph(args.graph)
    if args.plan:
        print_plan(graph)
        if not args.input:
            return 0
    if not args.input:
        raise QdslError("qdsl run needs --input FILE.npy (or --plan alone)")
    x = _read_inputs(graph, args.input)
    if args.overflow:
        res = execute(graph, x)
        outputs = res.outputs
        for name, n in res.overflow.items():
            print(f"overflow {name}: {n}")
    else:
        y = run_graph(graph, x, backend=args.backend)
        outputs = tuple(y.values()) if isinstance(y, dict) else y if isinstance(y, tuple) else (y,)
    if args.output:
        if len(outputs) == 1:
            np.save(args.output, outputs[0])
        else:
            np.savez(args.output, **{n: o for n, o in zip(graph.outputs, outputs)})
    else:
        for name, o in zip(graph.outputs, outputs):
            line = f"{name}: {o.dtype}{list(o.shape)}"
            if o.ndim == 2 and o.shape[1] > 1:
                line += f" argmax {o.argmax(axis=1)[:16].tolist()}{' ...' if o.shape[0] > 16 else ''}"
            print(line, file=sys.stdout)
    return 0


def print_plan(graph) -> None:
    import qdsl.runtime as rt

    if not rt.available():
        from qdsl.spec.diagnostics import QdslError

        raise QdslError(f"--plan needs the C++ runtime, which is unavailable: {rt.load_error()}")
    plan = rt.CompiledGraph(graph).plan()
    names = plan_names(graph)
    types = [op.type.name.lower() for op in graph.ops]
    width = max([len(n) for n in names] + [2])
    twidth = max([len(t) for t in types] + [4])
    print(f"{'op':<{width}}  {'type':<{twidth}}  {'input range':<12}  {'AVX2 int kernel':<22}  no overflow")
    for name, kind, p in zip(names, types, plan):
        rng = "-" if p["input_range"] is None else f"[{p['input_range'][0]}, {p['input_range'][1]}]"
        steps = p.get("maddubs_steps")
        kernel = "-" if steps is None else ("vpmaddwd (int16)" if steps == 0 else f"vpmaddubsw, {steps} in int16")
        overflow = {True: "yes", False: "no", None: "-"}[p.get("no_overflow")]
        print(f"{name:<{width}}  {kind:<{twidth}}  {rng:<12}  {kernel:<22}  {overflow}")


def plan_names(graph) -> list[str]:
    """One distinct label per op: its name, or, where ops share a name (a module called
    twice, a pool and the flatten after it), the tensor it writes (unique in a graph)."""
    counts: dict[str, int] = {}
    for op in graph.ops:
        counts[op.name] = counts.get(op.name, 0) + 1
    labels = [op.name if counts[op.name] == 1 or not op.outputs else op.outputs[0] for op in graph.ops]
    seen: dict[str, int] = {}
    out = []
    for label in labels:  # a name that still collides (hand-built graphs) gets a call number
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out
