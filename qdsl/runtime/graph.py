"""``CompiledGraph``: a ``.qgraph`` loaded and validated by the C++ runtime, run in one call.

Guarantees: construction parses and validates every byte in C++ (a corrupt or truncated
graph raises :class:`qdsl.export.GraphFormatError`, never crashes); ``run`` checks the
input array against the graph's declared input (dtype, shape, value range) and raises
:class:`qdsl.graph.reference.GraphInputError` on a mismatch; outputs equal
``qdsl.graph.reference`` bit for bit.  Buffers are planned once per batch size.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from qdsl.runtime import _native
from qdsl.runtime.errors import STATUS_NAMES, RuntimeError_, RuntimeUnavailable
from qdsl.runtime.kernels import PATHS

__all__ = ["CompiledGraph"]

_F32, _I8, _U8, _I32, _BIN = 1, 2, 3, 4, 9
_NP = {_F32: np.float32, _I8: np.int8, _U8: np.uint8, _I32: np.int32, _BIN: np.int8}
_RANGE = {_I8: (-128, 127), _U8: (0, 255), _I32: (-(2**31), 2**31 - 1)}


class _IO:
    def __init__(self, name: str, dtype: int, dims: tuple[int, ...]):
        self.name, self.dtype, self.dims = name, dtype, dims
        self.np: np.dtype | None = None  # the container dtype, set by CompiledGraph


class CompiledGraph:
    """A graph ready to run: ``CompiledGraph(graph_or_bytes).run(x)``."""

    def __init__(self, graph: Any):
        lib = _native.lib()
        if lib is None:
            raise RuntimeUnavailable(f"qdsl C++ runtime unavailable: {_native.load_error()}")
        if isinstance(graph, (bytes, bytearray, memoryview)):
            data = bytes(graph)
        else:
            from qdsl.graph.qgraph import graph_to_bytes

            data = graph_to_bytes(graph)
        self._lib = lib
        self._lock = threading.Lock()  # the C++ graph owns its run buffers
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(1024)
        buf = ctypes.create_string_buffer(data, len(data))
        code = lib.qdsl_graph_load(buf, len(data), ctypes.byref(handle), err, 1024)
        if code != 0:
            msg = err.value.decode("utf-8", "replace")
            if STATUS_NAMES.get(code) == "format_error":
                from qdsl.graph.ir import GraphFormatError

                raise GraphFormatError(msg)
            raise RuntimeError_(msg, STATUS_NAMES.get(code, str(code)))
        self._handle = handle
        self.inputs = self._entries(0)
        self.outputs = self._entries(1)
        self.op_names = [e.name for e in self._entries(2)]
        for spec in self.inputs + self.outputs:
            spec.np = np.dtype(_NP[spec.dtype])
        self._in_names = [spec.name for spec in self.inputs]
        self._out_names = [o.name for o in self.outputs]
        self._out_alloc = [(o.dims[1:], o.np) for o in self.outputs]
        self._in_ptr_type = ctypes.c_void_p * len(self.inputs)
        self._out_ptr_type = ctypes.c_void_p * len(self.outputs)
        self._err = ctypes.create_string_buffer(1024)  # used under self._lock only
        self._ran: str | None = None  # "ok" after a run, "empty" after a batch of 0, None before / after an error

    def _entries(self, which: int) -> list[_IO]:
        info = (ctypes.c_int64 * 12)()
        name = ctypes.create_string_buffer(4100)
        count = self._lib.qdsl_graph_entry(self._handle, which, -1, info, name, 4100)
        out = []
        for i in range(count):
            self._lib.qdsl_graph_entry(self._handle, which, i, info, name, 4100)
            out.append(_IO(name.value.decode("utf-8", "replace"), int(info[0]), tuple(int(info[2 + d]) for d in range(info[1]))))
        return out

    def plan(self) -> list[dict[str, Any]]:
        """Per op, what the validator proved and chose: ``input_range`` (the first input's
        proven value range: the clamp of its producer, else its dtype's range; None for
        F32/I32/BIN inputs),
        ``maddubs_steps`` (int conv/linear only: S >= 1 means AVX2 CPUs without VNNI run the
        exact ``vpmaddubsw`` kernel, adding S pair sums in int16; 0 the int16 kernel) and
        ``no_overflow`` (int conv/linear only: no accumulator can overflow, so the fast output
        stage runs), ``implicit_gemm`` (int conv/linear only: AVX2 runs the implicit-GEMM NHWC
        conv; with ``implicit_gemm_int16`` telling its kernel kind: True for the int16 one that
        is exact on full-range 8-bit activations, False for the 7-bit vpmaddubsw one; and
        ``implicit_gemm_vnni`` True when that kind runs as bit-identical ``vpdpbusd``
        kernels instead, on CPUs with AVX512_VNNI + AVX512VL such as Zen 4, unless
        ``QDSL_EVEX_VNNI=0``: exact for any codes, so full-range 8-bit convs take it too; and
        ``implicit_gemm_rows`` True when its taps are whole kernel rows of a padded NHWC copy,
        for input channels off the multiples of 4, e.g. an RGB stem),
        ``register_stage`` (int conv/linear only: its output stage is prepared for the AVX2
        kernel's epilogue, applied to the sums in registers when the output is one I8/U8 tensor
        stored NHWC; ``depthwise_maddubs``: an NHWC depthwise conv whose sums AVX2 takes by
        ``vpmaddubsw``, exact for its U8 input's codes, e.g. 7-bit), ``fused_add_stage`` (implicit-GEMM convs: its int32 stage and the residual
        ADD fused into it run as one float estimate with an exact recompute, when the ADD's
        tensors are stored NHWC; ``fused_add_registers``: applied to the sums in registers by the
        AVX-512 epilogue, on CPUs with AVX512_VNNI + AVX512VL unless ``QDSL_EVEX_VNNI=0``, K <= 512,
        no twin convs), ``fused_gemm`` (LINEAR only: off the reference path it runs as one GEMM
        with the bias and the output stage fused, I8/U8/I32 outputs), ``nhwc_output`` (the
        op's output was stored NHWC in the last run) and ``images_per_pass`` (in the last run the
        op was in a cache-sized segment run this many images at a time; 0: the whole batch at
        once; csrc/runtime/segment.cc, ``QDSL_SEGMENT=0`` turns segments off) and ``row_band``
        (int convs: in the last run, "computed" on a depthwise conv that computed the rows of
        its input from the 1x1 conv just before it, "producer" on that 1x1 conv, whose own run
        then wrote nothing; None otherwise; csrc/runtime/ops/conv_dw_nhwc.cc,
        ``QDSL_ROW_BAND=0`` turns it off)."""
        info = (ctypes.c_int64 * 12)()
        name = ctypes.create_string_buffer(4100)
        out = []
        for i in range(len(self.op_names)):
            self._lib.qdsl_graph_entry(self._handle, 2, i, info, name, 4100)
            lo, hi = int(info[2]), int(info[3])
            entry: dict[str, Any] = {"name": name.value.decode("utf-8", "replace"),
                                     "input_range": (lo, hi) if -128 <= lo <= hi <= 255 else None}
            if info[5] >= 0:
                entry["no_overflow"] = bool(info[5])
            if info[4] >= 0:
                entry["maddubs_steps"] = int(info[4])
            if info[6] >= 0:
                entry["implicit_gemm"] = bool(info[6])
                if info[6] > 0:
                    entry["implicit_gemm_int16"] = info[6] == 2
                    entry["implicit_gemm_vnni"] = info[6] == 3
                    entry["fused_add_stage"] = bool(info[1] & 1)
                    entry["fused_add_registers"] = bool(info[1] & 4)
                    entry["implicit_gemm_rows"] = bool(info[1] & 2)
            if info[8] >= 0:
                entry["fused_gemm"] = bool(info[8])
            if info[9] >= 0:
                entry["register_stage"] = bool(info[9])
                entry["depthwise_maddubs"] = info[9] == 2
            entry["nhwc_output"] = bool(info[7])
            entry["images_per_pass"] = int(info[10])
            if info[5] >= 0:
                entry["row_band"] = {1: "computed", 2: "producer"}.get(int(info[11]))
            out.append(entry)
        return out

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.qdsl_graph_free(handle)
            self._handle = None

    def _check(self, spec: _IO, x: Any, check_finite: bool = False) -> np.ndarray:
        if (type(x) is np.ndarray and x.dtype == spec.np and spec.dtype != _BIN and x.flags.c_contiguous
                and x.shape[1:] == spec.dims[1:] and x.ndim == len(spec.dims)
                and (spec.dims[0] == -1 or x.shape[0] == spec.dims[0])):
            # the common call: already the container type (in range by its dtype) and laid out
            # as the runtime reads it, so it is passed as it is (the runtime copies it in)
            if check_finite and spec.dtype == _F32:
                from qdsl.graph.reference import require_finite

                require_finite(x, spec.name)
            return x
        from qdsl.graph.reference import GraphInputError, as_array, require_finite

        x = as_array(x)
        want = spec.dims
        if x.ndim != len(want) or tuple(x.shape[1:]) != want[1:] or (want[0] != -1 and x.shape[0] != want[0]):
            raise GraphInputError(f"input {spec.name!r} expects shape {want} (-1 = any batch), got {tuple(x.shape)}")
        if spec.dtype == _F32:
            if not np.issubdtype(x.dtype, np.floating):
                raise GraphInputError(f"input {spec.name!r} expects float32 values, got {x.dtype}")
            x = np.ascontiguousarray(x, dtype=np.float32)
            if check_finite:
                require_finite(x, spec.name)
            return x
        if x.dtype == np.bool_:  # a bool mask: 0/1
            x = x.astype(np.int32)
        if not np.issubdtype(x.dtype, np.integer):
            raise GraphInputError(f"input {spec.name!r} expects integers, got {x.dtype}")
        lo, hi = _RANGE[spec.dtype]
        if x.size and (x.min() < lo or x.max() > hi):
            raise GraphInputError(f"input {spec.name!r} values must be in [{lo}, {hi}]")
        return np.ascontiguousarray(x, dtype=_NP[spec.dtype])

    def run(self, *xs: Any, path: str = "auto", check_finite: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
        """Run on one array per graph input (positional, a tuple/list, or a dict by input
        name); one array back for a single-output graph, else a tuple, and a dict by output
        name when the inputs came as a dict.  The outputs are new arrays on every call (never
        a view of the runtime's buffers: a later run does not change them); the inputs are
        only read.

        A batch of 0 gives empty outputs.  ``check_finite``: a NaN/inf in a float input
        raises ``NonFiniteError`` instead of following the QUANTIZE policy."""
        # The per-call work outside the C++ run is kept to checks and pointers: names,
        # pointer-array types and the error buffer are made once (__init__), and the
        # overflow counts are read from the runtime only when asked for (overflow_counts).
        if len(xs) == 1 and type(xs[0]) is np.ndarray and len(self.inputs) == 1:
            values, keyed = xs, False
        else:
            from qdsl.graph.reference import bind_inputs

            values, keyed = bind_inputs(self._in_names, xs[0] if len(xs) == 1 else tuple(xs))
        code_path = PATHS.get(path) if isinstance(path, str) else None
        if code_path is None:
            raise RuntimeError_(f"unknown kernel path {path!r}; known: {', '.join(PATHS)}")
        arrays = [self._check(spec, x, check_finite) for spec, x in zip(self.inputs, values)]
        # an input declared with a static first dim (an attention mask (L, S)) is not batched
        batched = [a.shape[0] for spec, a in zip(self.inputs, arrays) if spec.dims[0] == -1]
        batch = batched[0] if batched else arrays[0].shape[0]
        if len(batched) > 1 and any(b != batch for b in batched):
            from qdsl.graph.reference import GraphInputError

            raise GraphInputError("all graph inputs must have the same batch size")
        outs = [np.empty((batch,) + tail, dtype=dt) for tail, dt in self._out_alloc]
        if batch == 0:  # nothing to compute (the reference executor agrees); nothing overflowed
            with self._lock:
                self._ran = "empty"
            return self._shape(outs, keyed)
        in_ptrs = self._in_ptr_type(*[a.ctypes.data for a in arrays])
        out_ptrs = self._out_ptr_type(*[o.ctypes.data for o in outs])
        with self._lock:
            err = self._err
            code = self._lib.qdsl_graph_run(self._handle, batch, in_ptrs, out_ptrs, code_path, err, 1024)
            if code != 0:
                msg = err.value.decode("utf-8", "replace")
            self._ran = "ok" if code == 0 else None  # (a run that failed left no counts to report)
        if code != 0:
            raise RuntimeError_(msg, STATUS_NAMES.get(code, str(code)))
        return self._shape(outs, keyed)

    def _shape(self, outs: list[np.ndarray], keyed: bool) -> Any:
        if keyed:
            return dict(zip(self._out_names, outs))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def overflow_counts(self) -> dict[str, int]:
        """Accumulator overflows per op name in the last ``run`` (all ops, zeros included;
        an empty dict before the first run and after a run that raised).  Read from the
        runtime here, not on every run: it holds the counts of its last run until the next."""
        with self._lock:
            if self._ran is None:
                return {}
            if self._ran == "empty":
                return {n: 0 for n in self.op_names}
            counts = (ctypes.c_int64 * max(1, len(self.op_names)))()
            self._lib.qdsl_graph_overflow(self._handle, counts, len(self.op_names))
        return {n: int(c) for n, c in zip(self.op_names, counts)}
