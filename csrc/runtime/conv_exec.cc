// Execution of CONV1D/CONV2D/LINEAR and BCONV1D/BCONV2D/BLINEAR (docs/qgraph.md §4.3-4.4).
//
// Int ops: im2col per group (padding reads in_zp, so it contributes 0), then the packed
// GEMM into int32 (exact by the bound checked in prepare_conv.cc), or exact int64 loops
// when that bound fails or the reference path is forced.  Binary ops: im2col of +-1
// values with padding +1, bit-packing, popcount GEMM, then for windows that touch the
// padding the padded taps' contribution (+1 * w) is subtracted again, so padding taps are
// skipped exactly as the reference does.  Then bias (int64), acc_bits wrap/saturate with
// overflow counting, and the output stage or the sign for BIN outputs.
#include <cstdlib>
#include <cstring>

#include "dispatch.h"
#include "ref/ref.h"
#include "runtime/ops.h"
#include "runtime/thread_pool.h"

#include <algorithm>

namespace qdsl {
namespace {

struct Geometry {
  int64_t n, C, H, W, O, OH, OW, cg, og, kdim;
};

Geometry Geo(const Graph* g, const GraphOp& op, int64_t batch) {
  const PreparedOp& p = *op.prepared;
  const std::vector<int64_t> xs = ShapeFor(g->tensors[op.inputs[0]], batch);
  const std::vector<int64_t> ys = ShapeFor(g->tensors[op.outputs[0]], batch);
  Geometry e;
  e.n = xs[0];
  e.C = xs[1];
  e.H = p.spatial == 2 ? xs[2] : 1;
  e.W = p.spatial >= 1 ? xs.back() : 1;
  e.O = ys[1];
  e.OH = p.spatial == 2 ? ys[2] : 1;
  e.OW = p.spatial >= 1 ? ys.back() : 1;
  e.cg = e.C / p.groups;
  e.og = e.O / p.groups;
  e.kdim = e.cg * p.kh * p.kw;
  return e;
}

// Input position of tap (ky, kx) for output (oy, ox); false when it lies in the padding.
inline bool Tap(const PreparedOp& p, const Geometry& e, int64_t oy, int64_t ox, int64_t ky, int64_t kx, int64_t* iy,
                int64_t* ix) {
  *iy = oy * p.sh - p.ph + ky * p.dh;
  *ix = ox * p.sw - p.pw + kx * p.dw;
  return *iy >= 0 && *iy < e.H && *ix >= 0 && *ix < e.W;
}

// rows [n*OH*OW][kdim] of group gi; out-of-bounds taps take `pad`.
void Im2col(const uint8_t* x, const PreparedOp& p, const Geometry& e, int64_t gi, uint8_t pad, uint8_t* rows) {
  int64_t r = 0;
  for (int64_t b = 0; b < e.n; ++b)
    for (int64_t oy = 0; oy < e.OH; ++oy)
      for (int64_t ox = 0; ox < e.OW; ++ox, ++r) {
        uint8_t* dst = rows + r * e.kdim;
        for (int64_t c = 0; c < e.cg; ++c) {
          const uint8_t* plane = x + ((b * e.C + gi * e.cg + c) * e.H) * e.W;
          for (int64_t ky = 0; ky < p.kh; ++ky)
            for (int64_t kx = 0; kx < p.kw; ++kx) {
              int64_t iy, ix;
              *dst++ = Tap(p, e, oy, ox, ky, kx, &iy, &ix) ? plane[iy * e.W + ix] : pad;
            }
        }
      }
}

int64_t FinishAcc(int64_t s, const PreparedOp& p, int64_t* overflow) {
  const int64_t half = int64_t{1} << (p.acc_bits - 1);
  if (s < -half || s >= half) {
    ++*overflow;
    if (p.overflow_mode == 1) return s < 0 ? -half : half - 1;
    const uint64_t mask = (p.acc_bits == 64) ? ~uint64_t{0} : ((uint64_t{1} << p.acc_bits) - 1);
    return static_cast<int64_t>((static_cast<uint64_t>(s) + static_cast<uint64_t>(half)) & mask) - half;
  }
  return s;
}

inline void Emit(int64_t s, const PreparedOp& p, int64_t oc, uint8_t* y, bool wide, int64_t idx, int64_t* overflow) {
  if (!p.bias.empty()) s += p.bias[oc];
  s = FinishAcc(s, p, overflow);
  if (wide) {  // I32 output: the stage clamps to the int32 range
    const int32_t v = ApplyStage(s, p.out.stage, oc);
    std::memcpy(y + 4 * idx, &v, 4);
  } else {
    y[idx] = static_cast<uint8_t>(p.bin_out ? (s < 0 ? -1 : 1) : ApplyStage(s, p.out.stage, oc));
  }
}


// Valid output columns [lo, hi) for kernel column kx: 0 <= ox*sw - pw + kx*dw < W.
inline void ValidRange(const PreparedOp& p, const Geometry& e, int64_t kx, int64_t* off, int64_t* lo, int64_t* hi) {
  *off = kx * p.dw - p.pw;
  int64_t l = *off >= 0 ? 0 : (-*off + p.sw - 1) / p.sw;
  int64_t h = (e.W - 1 - *off) < 0 ? 0 : (e.W - 1 - *off) / p.sw + 1;
  l = std::min(l, e.OW);
  *lo = l;
  *hi = std::min(std::max(h, l), e.OW);
}

// Transposed im2col of images [b0, b0 + nb), group gi: row k = (c, ky, kx) holds, at
// column bi * P + oy * OW + ox, the tap of image b0 + bi.  T is int16 (x - zp, padding 0)
// or uint8 (the VNNI code x ^ flip, padding the zero point's code `pad`).
template <typename T>
void Im2colT(const uint8_t* x, const PreparedOp& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
             int xdtype, T pad, int64_t P, int64_t Pp, T* cols) {
  const uint8_t flip = xdtype == kI8 ? 0x80 : 0;
  const int32_t zp = p.in_zp;
  const int64_t sw = p.sw;  // locals: byte stores may alias anything, which would force reloads
  int64_t k = 0;
  for (int64_t c = 0; c < e.cg; ++c) {
    for (int64_t ky = 0; ky < p.kh; ++ky) {
      for (int64_t kx = 0; kx < p.kw; ++kx, ++k) {
        T* row = cols + k * Pp;
        int64_t off, lo, hi;
        ValidRange(p, e, kx, &off, &lo, &hi);
        for (int64_t i = 0; i < nb * P; ++i) row[i] = pad;
        for (int64_t bi = 0; bi < nb; ++bi) {
          const uint8_t* plane = x + (((b0 + bi) * e.C + gi * e.cg + c) * e.H) * e.W;
          for (int64_t oy = 0; oy < e.OH; ++oy) {
            const int64_t iy = oy * p.sh - p.ph + ky * p.dh;
            if (iy < 0 || iy >= e.H) continue;
            const uint8_t* src = plane + iy * e.W;
            T* dst = row + bi * P + oy * e.OW;
            if (sizeof(T) == 1) {
              if (sw == 1 && hi - lo >= 64) {  // long rows: libc copy, then the sign flip
                std::memcpy(dst + lo, src + lo + off, static_cast<size_t>(hi - lo));
                if (flip)
                  for (int64_t ox = lo; ox < hi; ++ox) dst[ox] = static_cast<T>(dst[ox] ^ 0x80);
              } else if (sw == 1) {  // short rows (small images): 8 bytes per move, no call
                const uint8_t* s1 = src + off;
                const uint64_t flip8 = flip ? 0x8080808080808080ull : 0;
                int64_t ox = lo;
                for (; ox + 8 <= hi; ox += 8) {
                  uint64_t v;
                  std::memcpy(&v, s1 + ox, 8);
                  v ^= flip8;
                  std::memcpy(dst + ox, &v, 8);
                }
                for (; ox < hi; ++ox) dst[ox] = static_cast<T>(s1[ox] ^ flip);
              } else {
                for (int64_t ox = lo; ox < hi; ++ox) dst[ox] = static_cast<T>(src[ox * sw + off] ^ flip);
              }
            } else if (xdtype == kU8) {
              for (int64_t ox = lo; ox < hi; ++ox) dst[ox] = static_cast<T>(src[ox * sw + off] - zp);
            } else {
              for (int64_t ox = lo; ox < hi; ++ox) dst[ox] = static_cast<T>(static_cast<int8_t>(src[ox * sw + off]) - zp);
            }
          }
        }
      }
    }
  }
}

// Int conv with the weights as the broadcast operand: acc[o][col] = W'[o][:] . X'[:, col],
// with the columns of several small images side by side (>= ~512 per GEMM), so the GEMM
// output rows are NCHW planes.  Two forms: VNNI (u8 codes, zero point via row sums:
// acc = sum x_u w' - z_u rowsum, mod 2^32 like the reference) and int16 vpmaddwd.  The
// stage runs vectorized per channel row when no overflow is possible (fast_acc), else
// element by element with the exact acc_bits rules.
Status IntConvFast(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow) {
  const PreparedOp& p = *op.prepared;
  const Geometry e = Geo(g, op, batch);
  const GraphTensor& xt = g->tensors[op.inputs[0]];
  const int out_dtype = g->tensors[op.outputs[0]].dtype;
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const int64_t P = e.OH * e.OW;
  const int64_t per_task = std::max<int64_t>(1, std::min<int64_t>(e.n, (512 + P - 1) / P));
  const int64_t chunks = (e.n + per_task - 1) / per_task;
  const int64_t kpairs = p.kp / 2, kquads = p.kp / 4;
  const IntMicroKernel kernel = SelectIntMicroKernel(PanelFormat::kI16, path);
  const VnniMicroKernel vnni = p.w8.empty() ? nullptr : SelectVnniMicroKernel(false, path);
  const RequantKernel requant = SelectRequantKernel(path);
  const StageI32Kernel stage_i32 = SelectStageI32Kernel(path);
  const int tasks = static_cast<int>(chunks * p.groups);
  std::vector<int64_t> counts(static_cast<size_t>(tasks), 0);
  ParallelFor(tasks, [&](int t) {
    const int64_t chunk = t / p.groups, gi = t % p.groups;
    const int64_t b0 = chunk * per_task, nb = std::min(per_task, e.n - b0);
    const int64_t cols_n = nb * P, Pp = (cols_n + 15) / 16 * 16, npanels = Pp / 16;
    thread_local std::vector<int32_t> acc;
    acc.resize(static_cast<size_t>(e.og * Pp));
    if (vnni) {
      thread_local std::vector<uint8_t> cols8, panels8;
      const int32_t zu = p.in_zp + (xt.dtype == kI8 ? 128 : 0);
      cols8.assign(static_cast<size_t>(p.kp * Pp), 0);
      panels8.resize(static_cast<size_t>(npanels * kquads * 64));
      Im2colT<uint8_t>(x, p, e, b0, nb, gi, xt.dtype, static_cast<uint8_t>(zu), P, Pp, cols8.data());
      PackU8QuadPanels(cols8.data(), Pp, kquads, npanels, panels8.data());
      const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w8[gi].data());
      for (int64_t q = 0; q < npanels; ++q)
        for (int64_t o0 = 0; o0 < e.og; o0 += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, e.og - o0));
          vnni(rows, w + o0 * p.kp, p.kp, panels8.data() + q * kquads * 64, kquads, acc.data() + o0 * Pp + q * 16, Pp,
               false);
        }
      for (int64_t o = 0; o < e.og; ++o) {
        const uint32_t corr = static_cast<uint32_t>(zu) * static_cast<uint32_t>(p.rowsum[gi * e.og + o]);
        int32_t* row = acc.data() + o * Pp;
        for (int64_t i = 0; i < cols_n; ++i) row[i] = static_cast<int32_t>(static_cast<uint32_t>(row[i]) - corr);
      }
    } else {
      thread_local std::vector<int16_t> cols, panels;
      cols.assign(static_cast<size_t>(p.kp * Pp), 0);
      panels.resize(static_cast<size_t>(npanels * kpairs * 32));
      Im2colT<int16_t>(x, p, e, b0, nb, gi, xt.dtype, 0, P, Pp, cols.data());
      for (int64_t q = 0; q < npanels; ++q)
        for (int64_t j = 0; j < kpairs; ++j) {
          int16_t* dst = panels.data() + (q * kpairs + j) * 32;
          const int16_t* r0 = cols.data() + (2 * j) * Pp + q * 16;
          const int16_t* r1 = r0 + Pp;
          for (int i = 0; i < 8; ++i) {
            dst[2 * i] = r0[i];
            dst[2 * i + 1] = r1[i];
            dst[16 + 2 * i] = r0[8 + i];
            dst[16 + 2 * i + 1] = r1[8 + i];
          }
        }
      const int16_t* w = p.w16[gi].data();
      for (int64_t q = 0; q < npanels; ++q) {
        const uint8_t* panel = reinterpret_cast<const uint8_t*>(panels.data() + q * kpairs * 32);
        for (int64_t o0 = 0; o0 < e.og; o0 += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, e.og - o0));
          kernel(rows, w + o0 * p.kp, p.kp, panel, kpairs, acc.data() + o0 * Pp + q * 16, Pp, false);
        }
      }
    }
    const int64_t esize = out_dtype == kI32 ? 4 : 1;
    for (int64_t o = 0; o < e.og; ++o) {
      const int64_t oc = gi * e.og + o;
      int32_t* row = acc.data() + o * Pp;
      if (p.fast_acc) {
        if (!p.bias.empty())
          for (int64_t i = 0; i < cols_n; ++i) row[i] += p.bias[oc];
        const Rescale& r = p.out.stage.rescale;
        OutputStage one = p.out.stage;
        const int64_t ch = r.channels == 1 ? 0 : oc;
        one.rescale.multiplier = r.multiplier + ch;
        one.rescale.shift = r.shift + ch;
        one.rescale.channels = 1;
        for (int64_t bi = 0; bi < nb; ++bi) {
          uint8_t* out = y + ((b0 + bi) * e.O + oc) * P * esize;
          if (out_dtype == kI32) {
            stage_i32(row + bi * P, P, one, reinterpret_cast<int32_t*>(out));
          } else {
            requant(row + bi * P, 1, P, P, one, 0, out, P, out_dtype == kI8);
          }
        }
      } else {
        for (int64_t bi = 0; bi < nb; ++bi)
          for (int64_t i = 0; i < P; ++i)
            Emit(row[bi * P + i], p, oc, y, out_dtype == kI32, ((b0 + bi) * e.O + oc) * P + i, &counts[t]);
      }
    }
  }, /*work=*/e.n * P * p.cout * p.kp);
  for (int64_t c : counts) *overflow += c;
  return Status::Ok();
}

}  // namespace

Status RunConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow) {
  const PreparedOp& p = *op.prepared;
  if (p.spatial > 0 && !p.w16.empty() && path != kPathRef) return IntConvFast(g, op, batch, path, overflow);
  const Geometry e = Geo(g, op, batch);
  const GraphTensor& xt = g->tensors[op.inputs[0]];
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const int64_t sp = e.OH * e.OW, M = e.n * sp;
  const bool binary = xt.dtype == kBin;
  const bool is_linear = p.spatial == 0;
  const bool wide = g->tensors[op.outputs[0]].dtype == kI32;
  std::vector<uint8_t> rows;
  std::vector<int32_t> acc(static_cast<size_t>(M * e.og));
  for (int64_t gi = 0; gi < p.groups; ++gi) {
    const uint8_t* a = x;
    if (!is_linear) {
      rows.resize(static_cast<size_t>(M * e.kdim));
      Im2col(x, p, e, gi, binary ? 1 : static_cast<uint8_t>(p.in_zp), rows.data());
      a = rows.data();
    }
    if (binary) {
      const int64_t kwords = (e.kdim + 63) / 64;
      std::vector<uint64_t> bits(static_cast<size_t>(M * kwords + 4));
      QDSL_RETURN_IF_ERROR(BitpackSigns(reinterpret_cast<const int8_t*>(a), M, e.kdim, e.kdim, bits.data(), kwords));
      GemmOutput o;
      o.data = acc.data();
      o.ld = e.og;
      QDSL_RETURN_IF_ERROR(BinaryGemm(bits.data(), M, kwords, p.packed[gi], nullptr, o, path));
    } else if (p.int32_exact && path != kPathRef) {
      ActView av;
      av.data = a;
      av.dtype = xt.dtype == kU8 ? DType::kUInt8 : DType::kInt8;
      av.rows = M;
      av.cols = e.kdim;
      av.ld = e.kdim;
      av.zero_point = p.in_zp;
      GemmOutput o;
      o.data = acc.data();
      o.ld = e.og;
      QDSL_RETURN_IF_ERROR(Gemm(av, p.packed[gi], nullptr, o, path));
    }
    const bool exact64 = !binary && !(p.int32_exact && path != kPathRef);
    const std::vector<int32_t>& wv = exact64 ? p.w_int[gi] : std::vector<int32_t>();
    for (int64_t m = 0; m < M; ++m) {
      const int64_t b = m / sp, s_ = m % sp, oy = s_ / e.OW, ox = s_ % e.OW;
      bool border = false;
      if (binary && !is_linear) {
        for (int64_t ky = 0; ky < p.kh && !border; ++ky)
          for (int64_t kx = 0; kx < p.kw && !border; ++kx) {
            int64_t iy, ix;
            border = !Tap(p, e, oy, ox, ky, kx, &iy, &ix);
          }
      }
      for (int64_t o = 0; o < e.og; ++o) {
        const int64_t oc = gi * e.og + o;
        int64_t s;
        if (exact64) {  // exact int64 dot product over the im2col row
          s = 0;
          const uint8_t* row = a + m * e.kdim;
          const int32_t* wr = wv.data() + o * e.kdim;
          for (int64_t k = 0; k < e.kdim; ++k) {
            const int32_t xv = xt.dtype == kU8 ? row[k] : static_cast<int8_t>(row[k]);
            s += static_cast<int64_t>(xv - p.in_zp) * wr[k];
          }
        } else {
          s = acc[m * e.og + o];
        }
        if (border) {  // remove the padded taps' (+1 * w) contribution
          const int8_t* wr_bits = nullptr;
          (void)wr_bits;
          const PackedWeights& pw = p.packed[gi];
          int64_t k = 0;
          for (int64_t c = 0; c < e.cg; ++c)
            for (int64_t ky = 0; ky < p.kh; ++ky)
              for (int64_t kx = 0; kx < p.kw; ++kx, ++k) {
                int64_t iy, ix;
                if (!Tap(p, e, oy, ox, ky, kx, &iy, &ix)) {
                  const bool neg = (pw.bits_rows[o * pw.kwords + (k >> 6)] >> (k & 63)) & 1;
                  s -= neg ? -1 : 1;
                }
              }
        }
        const int64_t idx = is_linear ? b * e.O + oc : (b * e.O + oc) * sp + s_;
        Emit(s, p, oc, y, wide, idx, overflow);
      }
    }
  }
  return Status::Ok();
}

}  // namespace qdsl
