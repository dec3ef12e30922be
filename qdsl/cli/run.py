"""``qdsl run GRAPH --input FILE.npy [--output FILE.npy] [--backend auto|reference|cpp]``.

Loads and validates a ``.qgraph`` file, runs it on the array stored in the ``.npy`` input
file, and writes the output array (``.npy``) or prints a short summary. ``--overflow``
prints the per-layer accumulator overflow counts (reference backend). A corrupt graph,
a missing file or an input of the wrong shape/dtype exits 2 with a message.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run an integer graph (.qgraph) on a .npy input",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("graph", help="the .qgraph file")
    p.add_argument("--input", "-i", required=True, help="input array (.npy), batch first")
    p.add_argument("--output", "-o", help="write the output array here (.npy); several outputs: .npz")
    p.add_argument("--backend", choices=("auto", "reference", "cpp"), default="auto")
    p.add_argument("--overflow", action="store_true", help="print accumulator overflow counts per layer (reference)")
    p.set_defaults(func=run)


def _load_npy(path: str):
    import numpy as np

    from qdsl.spec.diagnostics import QdslError

    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise QdslError(f"cannot read input array {path!r}: {e}") from None


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from qdsl.export import execute, load_graph, run_graph

    graph = load_graph(args.graph)
    x = _load_npy(args.input)
    if args.overflow:
        res = execute(graph, x)
        outputs = res.outputs
        for name, n in res.overflow.items():
            print(f"overflow {name}: {n}")
    else:
        y = run_graph(graph, x, backend=args.backend)
        outputs = y if isinstance(y, tuple) else (y,)
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
