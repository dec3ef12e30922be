"""onnxruntime peers for the benchmarks (kernels.py, e2e.py), used only when ``onnx`` and
``onnxruntime`` are installed (``pip install .[bench]``).

Which of ORT's int8 paths compute exactly depends on the CPU: on AVX2 without VNNI its u8 x s8
kernels multiply with ``vpmaddubsw``, which adds two u8*s8 products into a saturating int16
(255*127*2 > 32767), so on full-range 8-bit activations their sums are wrong; u8 x u8 runs
on zero-extended int16 (``vpmaddwd``) and is exact.  ``exactness_report`` measures this on
the ops the benchmarks time instead of assuming it, so each table can say which columns
are exact.
"""

from __future__ import annotations

import numpy as np

__all__ = ["exactness_report", "matmul_integer", "modules", "qlinear_conv", "seven_bit_overrides", "session"]

# onnxruntime reads older IR versions than the newest onnx writes.
_IR_VERSION = 8


def modules():
    """``(onnxruntime, onnx)``, or None when either is missing."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError:
        return None
    ort.set_default_logger_severity(3)  # the QDQ graphs make it warn about every folded constant
    return ort, onnx


def session(model, threads: int, optimized_path: str | None = None):
    """A CPU session as a deployment would run it: ORT_ENABLE_ALL, ``threads`` intra-op
    threads, sequential execution.  ``model``: a path or serialized bytes."""
    ort, _ = modules()
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if optimized_path:
        so.optimized_model_filepath = optimized_path
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _model(onnx, nodes, inputs, outputs, inits, opset: int = 13) -> bytes:
    from onnx import helper

    graph = helper.make_graph(nodes, "peer", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = _IR_VERSION
    return model.SerializeToString()


def matmul_integer(a_shape, b: np.ndarray, a_zero_point: int, b_zero_point: int) -> bytes:
    """``Y = (A - a_zp) @ (B - b_zp)`` in int32 with B a constant ``[K, N]`` (uint8: the u8u8
    path; int8: u8s8), A a uint8 input named "A"."""
    _, onnx = modules()
    from onnx import TensorProto, helper, numpy_helper

    bt = TensorProto.UINT8 if b.dtype == np.uint8 else TensorProto.INT8
    inits = [numpy_helper.from_array(np.ascontiguousarray(b), "B"),
             numpy_helper.from_array(np.array(a_zero_point, dtype=np.uint8), "a_zp"),
             numpy_helper.from_array(np.array(b_zero_point, dtype=b.dtype), "b_zp")]
    node = helper.make_node("MatMulInteger", ["A", "B", "a_zp", "b_zp"], ["Y"])
    return _model(onnx, [node], [helper.make_tensor_value_info("A", TensorProto.UINT8, list(a_shape))],
                  [helper.make_tensor_value_info("Y", TensorProto.INT32, [a_shape[0], b.shape[1]])], inits)


def qlinear_conv(x_shape, w: np.ndarray, w_zp: np.ndarray, x_scale: float, x_zp: int, w_scale: np.ndarray,
                 y_scale: float, y_zp: int) -> bytes:
    """One ``QLinearConv`` (3x3, pad 1, per-channel weights, uint8 in and out): the op ORT
    fuses every QDQ Conv of the e2e models into."""
    _, onnx = modules()
    from onnx import TensorProto, helper, numpy_helper

    f32 = lambda v: np.asarray(v, dtype=np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(f32(x_scale), "xs"), numpy_helper.from_array(np.array(x_zp, np.uint8), "xz"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(f32(w_scale), "ws"),
             numpy_helper.from_array(w_zp.astype(w.dtype), "wz"), numpy_helper.from_array(f32(y_scale), "ys"),
             numpy_helper.from_array(np.array(y_zp, np.uint8), "yz")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"],
                            kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    y_shape = [x_shape[0], w.shape[0], x_shape[2], x_shape[3]]
    return _model(onnx, [node], [helper.make_tensor_value_info("x", TensorProto.UINT8, list(x_shape))],
                  [helper.make_tensor_value_info("y", TensorProto.UINT8, y_shape)], inits)


def _conv_mismatch(rng, signed_w: bool, x_max: int) -> float:
    """Fraction of one QLinearConv's uint8 outputs more than 1 step from the exactly computed
    result (float requantization may differ by 1 step at ties; saturation errs by many)."""
    n, c, h, o = 1, 64, 14, 64
    x = rng.integers(0, x_max + 1, (n, c, h, h)).astype(np.uint8)
    w8 = rng.integers(-127, 128, (o, c, 3, 3))
    w, wz = (w8.astype(np.int8), np.zeros(o, np.int64)) if signed_w else ((w8 + 128).astype(np.uint8),
                                                                          np.full(o, 128))
    xz = (x_max + 1) // 2
    xs, ws = 0.02, np.full(o, 0.01, np.float32)
    xp = np.pad(x.astype(np.int64) - xz, ((0, 0), (0, 0), (1, 1), (1, 1)))
    cols = np.stack([xp[:, :, i:i + h, j:j + h] for i in range(3) for j in range(3)], axis=2)  # n,c,9,h,h
    acc = np.einsum("ncthw,oct->nohw", cols, w8.reshape(o, c, 9))
    ys = float(xs * ws[0] * acc.std() / 40.0)  # about +-3 std over the uint8 range around 128
    ref = np.clip(np.rint(acc * (xs * 0.01 / ys)) + 128, 0, 255)
    sess = session(qlinear_conv(x.shape, w, wz, xs, xz, ws, ys, 128), threads=1)
    y = sess.run(None, {"x": x})[0].astype(np.int64)
    return float(np.mean(np.abs(y - ref) > 1))


def _matmul_mismatch(rng, signed_w: bool, a_max: int) -> float:
    m, k, n = 64, 768, 256
    a = rng.integers(0, a_max + 1, (m, k)).astype(np.uint8)
    w8 = rng.integers(-127, 128, (k, n))
    b, bz = (w8.astype(np.int8), 0) if signed_w else ((w8 + 128).astype(np.uint8), 128)
    az = (a_max + 1) // 2
    y = session(matmul_integer(a.shape, b, az, bz), threads=1).run(None, {"A": a})[0].astype(np.int64)
    return float(np.mean(y != (a.astype(np.int64) - az) @ w8))


def exactness_report(ops=("QLinearConv", "MatMulInteger")) -> dict[tuple[str, str], float]:
    """Mismatch fraction of ORT's u8u8 and u8s8 paths on 8-bit and 7-bit activations, per op,
    against an exact int64 reference; keys ``(op, "u8u8 a8")`` etc.  Prints the table."""
    rng = np.random.default_rng(0)
    out = {}
    for op in ops:
        check = _conv_mismatch if op == "QLinearConv" else _matmul_mismatch
        for label, signed_w, x_max in [("u8u8 a8", False, 255), ("u8s8 a8", True, 255), ("u8s8 a7", True, 127)]:
            out[(op, label)] = check(rng, signed_w, x_max)
    print("onnxruntime exactness on this CPU (fraction of outputs wrong vs an exact int64 reference"
          + ("; QLinearConv: more than 1 step off" if "QLinearConv" in ops else "") + "):")
    for op in ops:
        print(f"  {op:<13} " + "  ".join(f"{label}: {out[(op, label)]:7.3%}"
                                          for label in ("u8u8 a8", "u8s8 a8", "u8s8 a7")))
    return out


def seven_bit_overrides(qdq_path: str) -> dict:
    """``TensorQuantOverrides`` for ``quantize_static`` that move every uint8 activation of the
    calibrated QDQ model at ``qdq_path`` to 7 bits: scale * 255/127, zero point * 127/255, so
    values inside the calibrated range take codes 0..127 (the ``reduce_range`` activations of
    torch.ao's x86 qconfig; quantize_static's own ``reduce_range`` narrows only the weights).
    Quantizing again with them keeps each bias scale = input scale * weight scale, which ORT's
    QDQ fusion requires (editing the scales in place leaves every conv in float).  Values
    beyond the calibrated range can still take codes up to 255, as in torch.ao."""
    _, onnx = modules()
    from onnx import numpy_helper

    model = onnx.load(qdq_path)
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or len(node.input) < 3 or node.input[0] in out:
            continue
        scale, zp = inits.get(node.input[1]), inits.get(node.input[2])
        if scale is None or zp is None or zp.data_type != onnx.TensorProto.UINT8:
            continue
        s, z = numpy_helper.to_array(scale), numpy_helper.to_array(zp)
        out[node.input[0]] = [{"scale": np.asarray(s * (255.0 / 127.0), dtype=np.float32),
                               "zero_point": np.asarray(np.rint(float(z) * 127.0 / 255.0), dtype=np.uint8)}]
    return out
