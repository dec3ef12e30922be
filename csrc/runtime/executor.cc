// Graph executor: one pass over the ops of a prepared Graph, with the semantics of
// qdsl/export/reference.py (docs/qgraph.md §4).  Activations are stored in their
// container type (int8 for I8 and BIN as +-1, uint8 for U8, float for F32) in buffers
// planned once per batch size.  Conv/linear run through the packed GEMM (im2col for
// convs, grouped) when the sum provably fits int32, otherwise through exact int64 loops.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "dispatch.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QDSL_EXEC_X86 1
#include "kernels/x86/x86_kernels.h"
#endif
#include "runtime/ops.h"
#include "runtime/thread_pool.h"

namespace qdsl {

Status RunConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow);  // conv_exec.cc

namespace {

inline int32_t Get(const uint8_t* b, int dtype, int64_t i) {
  if (dtype == kI32) {
    int32_t v;
    std::memcpy(&v, b + 4 * i, 4);
    return v;
  }
  return dtype == kU8 ? static_cast<int32_t>(b[i]) : static_cast<int32_t>(static_cast<int8_t>(b[i]));
}
inline int64_t Clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

double RoundF(double v, int64_t mode) {
  switch (mode) {
    case 1: return std::rint(v);  // half even (default FE_TONEAREST)
    case 0: return v < 0 ? -std::floor(-v + 0.5) : (v > 0 ? std::floor(v + 0.5) : v);
    case 3: return std::floor(v + 0.5);
    default: return std::floor(v);
  }
}

struct Ctx {
  Graph* g;
  int64_t batch;
  uint8_t* Buf(uint32_t t) { return g->buffers[t].data(); }
  std::vector<int64_t> Shape(uint32_t t) { return ShapeFor(g->tensors[t], batch); }
  int DType(uint32_t t) { return g->tensors[t].dtype; }
};

int64_t Attr1(const GraphOp& op, const char* k) { return op.attrs.at(k).i; }

}  // namespace

void AddRange(const GraphOp& add, const uint8_t* x0, int d0, const uint8_t* x1, int d1, int64_t n, uint8_t* y,
              bool y_signed, uint32_t path) {
  const PreparedOp& p = *add.prepared;
  const int64_t pre = Attr1(add, "pre_shift");
  if (const AddKernel vec = path == kPathRef ? nullptr : SelectAddKernel(path)) {
    const OutputStage in2[2] = {p.in[0].stage, p.in[1].stage};
    if (vec(x0, d0, x1, d1, n, in2, static_cast<int>(pre), p.out.stage, y, y_signed)) return;
    // the AVX2 kernel takes every ADD the format allows; paths above AVX2 have it too
    const AddKernel general = path > kPathAvx2 ? SelectAddKernel(kPathAvx2) : nullptr;
    if (general != nullptr && general != vec &&
        general(x0, d0, x1, d1, n, in2, static_cast<int>(pre), p.out.stage, y, y_signed)) {
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = 0;
    for (int k = 0; k < 2; ++k) {
      const Rescale& r = p.in[k].stage.rescale;
      const int64_t d = static_cast<int64_t>(k == 0 ? Get(x0, d0, i) : Get(x1, d1, i)) - p.in[k].stage.zero_point;
      // numpy's int64 '<<' wraps; so does a uint64 shift (only reachable with I32 operands)
      const int64_t v = static_cast<int64_t>(static_cast<uint64_t>(d) << pre);
      t += RescaleOne(v, r.kind, r.multiplier[0], r.shift[0], r.rounding);
    }
    y[i] = static_cast<uint8_t>(ApplyStage(Sat32(t), p.out.stage, 0));
  }
}

namespace {

// Spatial window iteration shared by the pools: calls f(out_index, taps...) per output.
void Pool(Ctx& c, const GraphOp& op, bool is_max) {
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi), ys = c.Shape(yi);
  const int rank = static_cast<int>(xs.size()) - 2;
  const auto& k = op.attrs.at("kernel").ints;
  const auto& s = op.attrs.at("stride").ints;
  const auto& p = op.attrs.at("padding").ints;
  const int64_t H = rank == 2 ? xs[2] : 1, W = xs.back(), OH = rank == 2 ? ys[2] : 1, OW = ys.back();
  const int64_t kh = rank == 2 ? k[0] : 1, kw = k.back(), sh = rank == 2 ? s[0] : 1, sw = s.back();
  const int64_t ph = rank == 2 ? p[0] : 0, pw = p.back();
  int64_t dh = 1, dw = 1;
  if (is_max) {
    const auto& d = op.attrs.at("dilation").ints;
    dh = rank == 2 ? d[0] : 1;
    dw = d.back();
  }
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int64_t planes = xs[0] * xs[1];
  const int32_t in_zp = is_max ? 0 : static_cast<int32_t>(Attr1(op, "in_zp"));
  const OutputStage* st = is_max ? nullptr : &op.prepared->out.stage;
  // the taps inside the input per output row / column, once per op (padding taps never
  // win a max and contribute 0 to a sum)
  auto ranges = [](int64_t outs, int64_t in, int64_t stride, int64_t pad, int64_t k, int64_t dil) {
    std::vector<int64_t> r(2 * outs);
    for (int64_t o = 0; o < outs; ++o) {
      int64_t lo = 0, hi = k;
      while (lo < k && o * stride - pad + lo * dil < 0) ++lo;
      while (hi > lo && o * stride - pad + (hi - 1) * dil >= in) --hi;
      r[2 * o] = lo;
      r[2 * o + 1] = hi;
    }
    return r;
  };
  const std::vector<int64_t> ry = ranges(OH, H, sh, ph, kh, dh), rx = ranges(OW, W, sw, pw, kw, dw);
  auto plane = [&](auto tag, int64_t pl) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(x) + pl * H * W;
    for (int64_t oy = 0; oy < OH; ++oy) {
      for (int64_t ox = 0; ox < OW; ++ox) {
        int64_t acc = is_max ? INT64_MIN : 0;
        for (int64_t ky = ry[2 * oy]; ky < ry[2 * oy + 1]; ++ky) {
          const T* row = src + (oy * sh - ph + ky * dh) * W + (ox * sw - pw);
          if (is_max) {
            int32_t m = INT32_MIN;
            for (int64_t kx = rx[2 * ox]; kx < rx[2 * ox + 1]; ++kx) m = std::max<int32_t>(m, row[kx * dw]);
            acc = std::max<int64_t>(acc, m);
          } else {
            int64_t sum = 0;
            for (int64_t kx = rx[2 * ox]; kx < rx[2 * ox + 1]; ++kx) sum += row[kx * dw] - in_zp;
            acc += sum;
          }
        }
        const int64_t o = (pl * OH + oy) * OW + ox;
        y[o] = static_cast<uint8_t>(is_max ? acc : ApplyStage(acc, *st, pl % xs[1]));
      }
    }
  };
  // blocks of planes per task (the claim of a task costs more than a small plane)
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(planes, 4096 / std::max<int64_t>(OH * OW * kh * kw, 1)));
  ParallelFor(static_cast<int>((planes + block - 1) / block), [&](int bi) {
    for (int64_t pl = bi * block, pe = std::min(planes, pl + block); pl < pe; ++pl) {
      if (xd == kU8) {
        plane(uint8_t{}, pl);
      } else if (xd == kI32) {
        plane(int32_t{}, pl);
      } else {
        plane(int8_t{}, pl);
      }
    }
  }, /*work=*/planes * OH * OW * kh * kw * 4);
}

// REQUANTIZE: y = stage(x - in_zp), per channel along axis 1.  Segments of one channel
// (a plane, or 16K-element chunks of a per-tensor stage) run over the pool; I8/U8 inputs
// (and I32 with in_zp 0) go through the vector output stage of the path on int32 rows.
void ElementwiseStage(Ctx& c, const GraphOp& op, uint32_t path) {
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int64_t n = Numel(xs);
  const int64_t C = xs.size() >= 2 ? xs[1] : 1, inner = xs.size() >= 2 ? n / (xs[0] * C) : 1;
  const int32_t in_zp = static_cast<int32_t>(Attr1(op, "in_zp"));
  const OutputStage& st = op.prepared->out.stage;
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int xd = c.DType(xi), yd = c.DType(yi);
  const bool per_tensor = st.rescale.channels == 1;
  const int64_t chunk = 16384;
  // segments: per tensor, chunks of the flat tensor; per channel, chunks of each plane
  const int64_t seg = per_tensor ? chunk : std::min(inner, chunk);
  const int64_t per_plane = per_tensor ? 0 : (inner + seg - 1) / seg;
  const int64_t segs = per_tensor ? (n + seg - 1) / seg : (n / inner) * per_plane;
  const RequantKernel vec = path == kPathRef ? nullptr : SelectRequantKernel(path);
  const bool vec_ok = vec != nullptr && (yd == kI8 || yd == kU8) && (xd != kI32 || in_zp == 0) && seg >= 16;
  ParallelFor(static_cast<int>(segs), [&](int si) {
    int64_t i0, len, ch = 0;
    if (per_tensor) {
      i0 = si * seg;
      len = std::min(seg, n - i0);
    } else {
      const int64_t plane = si / per_plane, part = si % per_plane;
      ch = plane % C;
      i0 = plane * inner + part * seg;
      len = std::min(seg, inner - part * seg);
    }
    if (!vec_ok) {
      for (int64_t i = i0; i < i0 + len; ++i) y[i] = static_cast<uint8_t>(ApplyStage(Get(x, xd, i) - in_zp, st, ch));
      return;
    }
    OutputStage one = st;  // this segment's channel as a per-tensor stage
    one.rescale.multiplier += ch;
    one.rescale.shift += ch;
    one.rescale.channels = 1;
    thread_local std::vector<int32_t> tmp;
    const int32_t* src;
    if (xd == kI32) {
      src = reinterpret_cast<const int32_t*>(x) + i0;
    } else {
      tmp.resize(static_cast<size_t>(len));
      if (xd == kU8) {
        for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(x[i0 + j]) - in_zp;
      } else {
        const int8_t* xs8 = reinterpret_cast<const int8_t*>(x);
        for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(xs8[i0 + j]) - in_zp;
      }
      src = tmp.data();
    }
    vec(src, 1, len, len, one, 0, y + i0, len, yd == kI8);
  }, /*work=*/n * 32);
}

}  // namespace

Status RunGraph(Graph* g, int64_t batch, const void* const* inputs, void* const* outputs, uint32_t path) {
  QDSL_CHECK_ARG(g != nullptr && batch >= 1 && batch <= (int64_t{1} << 24), "bad batch size %lld", (long long)batch);
  uint32_t chosen = 0;
  QDSL_RETURN_IF_ERROR(ResolvePath(path, &chosen));
  if (g->planned_batch != batch) {
    g->buffers.assign(g->tensors.size(), {});
    for (size_t t = 0; t < g->tensors.size(); ++t) {
      const GraphTensor& ts = g->tensors[t];
      if (ts.is_constant) continue;
      QDSL_CHECK_ARG(ts.dims[0] == -1 || ts.dims[0] == batch, "batch %lld does not match tensor '%s' (batch %lld)",
                     (long long)batch, ts.name.c_str(), (long long)ts.dims[0]);
      const int64_t n = Numel(ShapeFor(ts, batch));
      QDSL_CHECK(n <= (int64_t{1} << 34), StatusCode::kInvalidArgument, "tensor '%s' too large for batch %lld",
                 ts.name.c_str(), (long long)batch);
      g->buffers[t].assign(static_cast<size_t>(n * ((ts.dtype == kF32 || ts.dtype == kI32) ? 4 : 1)), 0);
    }
    g->planned_batch = batch;
  }
  Ctx c{g, batch};
  for (size_t i = 0; i < g->inputs.size(); ++i) {
    QDSL_CHECK_ARG(inputs[i] != nullptr, "null input %zu", i);
    std::memcpy(c.Buf(g->inputs[i]), inputs[i], g->buffers[g->inputs[i]].size());
  }
  std::fill(g->overflow.begin(), g->overflow.end(), 0);
  g->fused_done.assign(g->ops.size(), 0);
  // QDSL_PROFILE=1 prints each op's wall time to stderr (for finding slow ops).
  // The CPU time of the calling thread is printed too: on a loaded machine it is the
  // steadier figure (worker threads are not included).
  static const bool profile = [] {  // set and not "0" / empty
    const char* v = std::getenv("QDSL_PROFILE");
    return v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
  }();
  auto t0 = std::chrono::steady_clock::now();
  std::clock_t c0 = std::clock();
  for (size_t oi = 0; oi <= g->ops.size(); ++oi) {
    if (profile && oi > 0) {
      const auto t1 = std::chrono::steady_clock::now();
      const std::clock_t c1 = std::clock();
      std::fprintf(stderr, "qdsl op %3zu %-24s wall %9.3f ms  cpu %9.3f ms\n", oi - 1, g->ops[oi - 1].name.c_str(),
                   std::chrono::duration<double, std::milli>(t1 - t0).count(), 1e3 * double(c1 - c0) / CLOCKS_PER_SEC);
      t0 = std::chrono::steady_clock::now();  // after the print: its cost is no op's
      c0 = std::clock();
    }
    if (oi == g->ops.size()) break;
    const GraphOp& op = g->ops[oi];
    const uint32_t xi = op.inputs[0], yi = op.outputs[0];
    const int xd = c.DType(xi), yd = c.DType(yi);
    const int64_t n = Numel(c.Shape(xi));
    const uint8_t* x = c.Buf(xi);
    uint8_t* y = c.Buf(yi);
    switch (op.opcode) {
      case kQuantize: {
        const float inv = 1.0f / op.attrs.at("scale").f;
        const int64_t zp = Attr1(op, "zero_point"), lo = Attr1(op, "qmin"), hi = Attr1(op, "qmax");
        const int64_t mode = Attr1(op, "rounding");
        const float* xf = reinterpret_cast<const float*>(x);
        const int64_t chunk = 16384;
        ParallelFor(static_cast<int>((n + chunk - 1) / chunk), [&](int ci) {
#ifdef QDSL_EXEC_X86
          if (chosen >= kPathAvx2 && (yd == kI8 || yd == kU8)) {  // chosen >= AVX2: the CPU has AVX2
            const int64_t i0 = ci * chunk;
            x86::QuantizeF32Avx2(xf + i0, std::min(chunk, n - i0), inv, static_cast<int32_t>(zp),
                                 static_cast<int32_t>(lo), static_cast<int32_t>(hi), static_cast<int>(mode), y + i0,
                                 yd == kI8);
            return;
          }
#endif
          for (int64_t i = ci * chunk, e = std::min(n, i + chunk); i < e; ++i) {
            const float v = xf[i] * inv;  // binary32 multiply, as the reference
            int64_t q;
            if (std::isnan(v)) {
              q = Clamp(zp, lo, hi);
            } else {
              const double r = RoundF(static_cast<double>(v), mode) + static_cast<double>(zp);
              q = r < static_cast<double>(lo) ? lo : (r > static_cast<double>(hi) ? hi : static_cast<int64_t>(r));
            }
            y[i] = static_cast<uint8_t>(q);
          }
        }, /*work=*/(chosen >= kPathAvx2 ? n * 16 : n * 64));
        break;
      }
      case kDequantize: {
        const float scale = op.attrs.at("scale").f;
        const int64_t zp = Attr1(op, "zero_point");
        float* yf = reinterpret_cast<float*>(y);
        const int64_t chunk = 16384;
        ParallelFor(static_cast<int>((n + chunk - 1) / chunk), [&](int ci) {
          for (int64_t i = ci * chunk, e = std::min(n, i + chunk); i < e; ++i)
            yf[i] = static_cast<float>(static_cast<int64_t>(Get(x, xd, i)) - zp) * scale;
        }, /*work=*/n * 16);
        break;
      }
      case kBinarize: {
        const int64_t zp = Attr1(op, "zero_point");
        for (int64_t i = 0; i < n; ++i) {
          bool neg;
          if (xd == kF32) {
            const float v = reinterpret_cast<const float*>(x)[i];
            neg = v < static_cast<float>(zp);  // NaN compares false: +1
          } else {
            neg = Get(x, xd, i) < zp;
          }
          y[i] = static_cast<uint8_t>(static_cast<int8_t>(neg ? -1 : 1));
        }
        break;
      }
      case kRequantize: ElementwiseStage(c, op, chosen); break;
      case kConv1d: case kConv2d: case kLinear: case kBconv1d: case kBconv2d: case kBlinear:
        if (g->fused_done[oi]) break;  // a twin conv already wrote this output (PreparedOp::twins)
        QDSL_RETURN_IF_ERROR(RunConv(g, op, batch, chosen, &g->overflow[oi]));
        break;
      case kAdd: {
        if (g->fused_done[oi]) break;  // computed by the conv it was fused into
        const uint8_t* x1 = c.Buf(op.inputs[1]);
        const int xd1 = c.DType(op.inputs[1]);
        const int64_t e0 = xd == kI32 ? 4 : 1, e1 = xd1 == kI32 ? 4 : 1;
        // chunks of 8K elements over the pool: the op streams its inputs once.  A
        // FIXED_SINGLE rescale (64-bit products, rounded in 64-bit lanes on AVX2) costs
        // about three times a FIXED or POT one per element: weigh the work by it, so a
        // 32K-element ADD with one such input (0.08 ms alone) takes both cores.
        const PreparedOp& ap = *op.prepared;
        int64_t weight = 1;
        for (int k = 0; k < 2; ++k) weight += ap.in[k].stage.rescale.kind == RescaleKind::kFixedSingle ? 2 : 0;
        weight += ap.out.stage.rescale.kind == RescaleKind::kFixedSingle ? 2 : 0;
        const int64_t chunk = 8192, chunks = (n + chunk - 1) / chunk;
        ParallelFor(static_cast<int>(chunks), [&](int ci) {
          const int64_t i0 = ci * chunk, i1 = std::min(n, i0 + chunk);
          AddRange(op, x + i0 * e0, xd, x1 + i0 * e1, xd1, i1 - i0, y + i0, yd == kI8, chosen);
        }, /*work=*/n * 64 * weight);
        break;
      }
      case kConcat: {
        const PreparedOp& p = *op.prepared;
        const std::vector<int64_t> ys = c.Shape(yi);
        const int64_t axis = Attr1(op, "axis");
        int64_t outer = 1, inner = 1;
        for (int64_t d = 0; d < axis; ++d) outer *= ys[d];
        for (size_t d = axis + 1; d < ys.size(); ++d) inner *= ys[d];
        const int64_t zp = Attr1(op, "out_zp"), lo = Attr1(op, "out_min"), hi = Attr1(op, "out_max");
        // one task per (input, outer index) row; I8/U8 rows through the path's vector stage
        std::vector<int64_t> offsets(op.inputs.size() + 1, 0);
        for (size_t k = 0; k < op.inputs.size(); ++k) offsets[k + 1] = offsets[k] + c.Shape(op.inputs[k])[axis] * inner;
        const int64_t nin = static_cast<int64_t>(op.inputs.size());
        const RequantKernel vec = chosen == kPathRef ? nullptr : SelectRequantKernel(chosen);
        ParallelFor(static_cast<int>(nin * outer), [&](int task) {
          const int64_t k = task / outer, o = task % outer;
          const uint32_t ti = op.inputs[k];
          const int64_t len = offsets[k + 1] - offsets[k];
          const uint8_t* xs = c.Buf(ti);
          const int xdk = c.DType(ti);
          const Rescale& r = p.in[k].stage.rescale;
          const int32_t in_zp = p.in[k].stage.zero_point;
          uint8_t* dst = y + o * offsets[nin] + offsets[k];
          if (vec != nullptr && (xdk == kI8 || xdk == kU8) && (yd == kI8 || yd == kU8) && len >= 16) {
            OutputStage st;
            st.rescale = r;
            st.zero_point = static_cast<int32_t>(zp);
            st.qmin = static_cast<int32_t>(lo);
            st.qmax = static_cast<int32_t>(hi);
            thread_local std::vector<int32_t> tmp;
            tmp.resize(static_cast<size_t>(len));
            const uint8_t* src = xs + o * len;
            if (xdk == kU8) {
              for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(src[j]) - in_zp;
            } else {
              for (int64_t j = 0; j < len; ++j) tmp[j] = static_cast<int32_t>(static_cast<int8_t>(src[j])) - in_zp;
            }
            vec(tmp.data(), 1, len, len, st, 0, dst, len, yd == kI8);
            return;
          }
          for (int64_t j = 0; j < len; ++j) {
            const int64_t v = Get(xs, xdk, o * len + j) - in_zp;
            dst[j] = static_cast<uint8_t>(Clamp(RescaleOne(v, r.kind, r.multiplier[0], r.shift[0], r.rounding) + zp, lo, hi));
          }
        }, /*work=*/Numel(ys) * 32);
        break;
      }
      case kClamp: {
        const int64_t lo = Attr1(op, "out_min"), hi = Attr1(op, "out_max");
        const int64_t chunk = 16384;
        ParallelFor(static_cast<int>((n + chunk - 1) / chunk), [&](int ci) {
          const int64_t i0 = ci * chunk, i1 = std::min(n, i0 + chunk);
          if (xd == kU8) {  // per-dtype loops the compiler vectorizes
            const uint8_t l = static_cast<uint8_t>(Clamp(lo, 0, 255)), h = static_cast<uint8_t>(Clamp(hi, 0, 255));
            for (int64_t i = i0; i < i1; ++i) y[i] = std::min(std::max(x[i], l), h);
          } else if (xd == kI8) {
            const int8_t l = static_cast<int8_t>(Clamp(lo, -128, 127)), h = static_cast<int8_t>(Clamp(hi, -128, 127));
            const int8_t* s8 = reinterpret_cast<const int8_t*>(x);
            int8_t* d8 = reinterpret_cast<int8_t*>(y);
            for (int64_t i = i0; i < i1; ++i) d8[i] = std::min(std::max(s8[i], l), h);
          } else {
            for (int64_t i = i0; i < i1; ++i) y[i] = static_cast<uint8_t>(Clamp(Get(x, xd, i), lo, hi));
          }
        }, /*work=*/n * 8);
        break;
      }
      case kMaxpool1d: case kMaxpool2d: Pool(c, op, true); break;
      case kAvgpool1d: case kAvgpool2d: Pool(c, op, false); break;
      case kGlobalAvgpool: {
        const std::vector<int64_t> xs = c.Shape(xi);
        const int64_t planes = xs[0] * xs[1], sp = n / planes;
        const int64_t zp = Attr1(op, "in_zp");
        // blocks of planes per task: one task per plane made 2 threads slower than one
        // (2048 planes of 256 bytes: 0.24 vs 0.10 ms), the claim of a task costs more than its sum
        const int64_t block = std::max<int64_t>(1, std::min<int64_t>(planes, 16384 / std::max<int64_t>(sp, 1)));
        const bool small = sp <= (int64_t{1} << 23);  // byte sums fit int32 (|x| <= 255)
        ParallelFor(static_cast<int>((planes + block - 1) / block), [&](int bi) {
          for (int64_t pl = bi * block, pe = std::min(planes, pl + block); pl < pe; ++pl) {
            int64_t acc = 0;  // per-dtype loops: sums the compiler vectorizes
            if (xd == kU8 && small) {
              const uint8_t* src = x + pl * sp;
              int32_t a32 = 0;
              for (int64_t j = 0; j < sp; ++j) a32 += src[j];
              acc = a32;
            } else if (xd == kU8) {
              const uint8_t* src = x + pl * sp;
              for (int64_t j = 0; j < sp; ++j) acc += src[j];
            } else if (xd == kI32) {
              const int32_t* src = reinterpret_cast<const int32_t*>(x) + pl * sp;
              for (int64_t j = 0; j < sp; ++j) acc += src[j];
            } else if (small) {
              const int8_t* src = reinterpret_cast<const int8_t*>(x) + pl * sp;
              int32_t a32 = 0;
              for (int64_t j = 0; j < sp; ++j) a32 += src[j];
              acc = a32;
            } else {
              const int8_t* src = reinterpret_cast<const int8_t*>(x) + pl * sp;
              for (int64_t j = 0; j < sp; ++j) acc += src[j];
            }
            acc -= zp * sp;
            y[pl] = static_cast<uint8_t>(ApplyStage(acc, op.prepared->out.stage, pl % xs[1]));
          }
        }, /*work=*/n);  // a vectorized sum: serial below 4M elements (the input is often in the other core's cache)
        break;
      }
      case kReshape: std::memcpy(y, x, static_cast<size_t>(n) * ((xd == kF32 || xd == kI32) ? 4 : 1)); break;
      default: return MakeStatus(StatusCode::kUnsupported, "op '%s': unsupported opcode %d", op.name.c_str(), op.opcode);
    }
    (void)yd;
  }
  for (size_t i = 0; i < g->outputs.size(); ++i) {
    QDSL_CHECK_ARG(outputs[i] != nullptr, "null output %zu", i);
    std::memcpy(outputs[i], c.Buf(g->outputs[i]), g->buffers[g->outputs[i]].size());
  }
  return Status::Ok();
}

}  // namespace qdsl
