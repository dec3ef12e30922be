// Execution of CONV1D/CONV2D/LINEAR and BCONV1D/BCONV2D/BLINEAR (docs/qgraph.md §4.3-4.4).
//
// Int ops: im2col per group (padding reads in_zp, so it contributes 0), then the packed
// GEMM into int32 (exact by the bound checked in prepare_conv.cc), or exact int64 loops
// when that bound fails or the reference path is forced.  Binary ops: im2col of +-1
// values with padding +1, bit-packing, popcount GEMM, then for windows that touch the
// padding the padded taps' contribution (+1 * w) is subtracted again, so padding taps are
// skipped exactly as the reference does.  Then bias (int64), acc_bits wrap/saturate with
// overflow counting, and the output stage (the wide rescale when acc_bits > 32) or the sign
// for BIN outputs.
#include <cstdlib>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif
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
  if (p.acc_bits >= 64) return s;  // the exact sum is an int64 (like the reference's)
  const int64_t half = int64_t{1} << (p.acc_bits - 1);
  if (s < -half || s >= half) {
    ++*overflow;
    if (p.overflow_mode == 1) return s < 0 ? -half : half - 1;
    const uint64_t mask = (uint64_t{1} << p.acc_bits) - 1;
    return static_cast<int64_t>((static_cast<uint64_t>(s) + static_cast<uint64_t>(half)) & mask) - half;
  }
  return s;
}

inline void Emit(int64_t s, const PreparedOp& p, int64_t oc, uint8_t* y, bool wide, int64_t idx, int64_t* overflow) {
  if (!p.bias.empty()) s += p.bias[oc];
  s = FinishAcc(s, p, overflow);
  if (wide) {  // I32 output: the stage clamps to the int32 range
    const int32_t v = ApplyStage(s, p.out.stage, oc, p.acc_bits > 32);
    std::memcpy(y + 4 * idx, &v, 4);
  } else {
    y[idx] = static_cast<uint8_t>(p.bin_out ? (s < 0 ? -1 : 1) : ApplyStage(s, p.out.stage, oc, p.acc_bits > 32));
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

// Im2colGenericU8 when the output rows have the input's pitch (stride 1 and
// OW == W, e.g. "same" 3x3 convs): each (c, ky, kx) row of an image is then one shifted
// copy of the input plane, plus the padding code in the rows and the few columns whose
// taps fall outside.  About 30x fewer calls than a copy per output row on 32x32 images.
void Im2colSamePitchU8(const uint8_t* x, const PreparedOp& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
                       uint8_t flip, uint8_t pad, int64_t P, int64_t Pp, uint8_t* cols) {
  const int64_t W = e.W, H = e.H, OH = e.OH;
  int64_t k = 0;
  for (int64_t c = 0; c < e.cg; ++c) {
    for (int64_t ky = 0; ky < p.kh; ++ky) {
      const int64_t dy = ky * p.dh - p.ph;
      const int64_t oy_lo = std::min(OH, std::max<int64_t>(0, -dy)), oy_hi = std::max(oy_lo, std::min(OH, H - dy));
      for (int64_t kx = 0; kx < p.kw; ++kx, ++k) {
        int64_t dx, lo, hi;
        ValidRange(p, e, kx, &dx, &lo, &hi);
        for (int64_t bi = 0; bi < nb; ++bi) {
          const uint8_t* plane = x + (((b0 + bi) * e.C + gi * e.cg + c) * H) * W;
          uint8_t* dst = cols + k * Pp + bi * P;
          std::memset(dst, pad, static_cast<size_t>(oy_lo * W));
          std::memset(dst + oy_hi * W, pad, static_cast<size_t>((OH - oy_hi) * W));
          if (oy_hi > oy_lo && hi > lo) {
            // elements [oy_lo * W + lo, (oy_hi - 1) * W + hi) map to plane + index + dy * W + dx,
            // all inside the plane; the columns outside [lo, hi) in between are fixed below
            const int64_t first = oy_lo * W + lo, last = (oy_hi - 1) * W + hi;
            const uint8_t* src = plane + first + dy * W + dx;
            uint8_t* d = dst + first;
            const int64_t len = last - first;
            if (flip) {
              for (int64_t i = 0; i < len; ++i) d[i] = static_cast<uint8_t>(src[i] ^ 0x80);
            } else {
              std::memcpy(d, src, static_cast<size_t>(len));
            }
            for (int64_t oy = oy_lo; oy < oy_hi; ++oy) {
              uint8_t* row = dst + oy * W;
              for (int64_t ox = 0; ox < lo; ++ox) row[ox] = pad;
              for (int64_t ox = hi; ox < W; ++ox) row[ox] = pad;
            }
          } else {
            std::memset(dst + oy_lo * W, pad, static_cast<size_t>((oy_hi - oy_lo) * W));
          }
        }
      }
    }
  }
}

// d[i] = s[i] ^ flip for i < n, 8 bytes per move (short runs: no call; a byte loop of 8
// was mostly loop overhead).
void CopyCodes(const uint8_t* s, uint8_t* d, int64_t n, uint8_t flip) {
  const uint64_t flip8 = flip ? 0x8080808080808080ull : 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, s + i, 8);
    v ^= flip8;
    std::memcpy(d + i, &v, 8);
  }
  for (; i < n; ++i) d[i] = static_cast<uint8_t>(s[i] ^ flip);
}

// Transposed im2col of images [b0, b0 + nb), group gi: row k = (c, ky, kx) holds, at
// column bi * P + oy * OW + ox, the u8 code (x ^ flip) of image b0 + bi's tap, padding the
// zero point's code `pad`.
void Im2colGenericU8(const uint8_t* x, const PreparedOp& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
                     int xdtype, uint8_t pad, int64_t P, int64_t Pp, uint8_t* cols) {
  const uint8_t flip = xdtype == kI8 ? 0x80 : 0;
  const int64_t sw = p.sw;  // locals: byte stores may alias anything, which would force reloads
  int64_t k = 0;
  for (int64_t c = 0; c < e.cg; ++c) {
    for (int64_t ky = 0; ky < p.kh; ++ky) {
      for (int64_t kx = 0; kx < p.kw; ++kx, ++k) {
        uint8_t* row = cols + k * Pp;
        int64_t off, lo, hi;
        ValidRange(p, e, kx, &off, &lo, &hi);
        for (int64_t i = 0; i < nb * P; ++i) row[i] = pad;
        for (int64_t bi = 0; bi < nb; ++bi) {
          const uint8_t* plane = x + (((b0 + bi) * e.C + gi * e.cg + c) * e.H) * e.W;
          for (int64_t oy = 0; oy < e.OH; ++oy) {
            const int64_t iy = oy * p.sh - p.ph + ky * p.dh;
            if (iy < 0 || iy >= e.H) continue;
            const uint8_t* src = plane + iy * e.W;
            uint8_t* dst = row + bi * P + oy * e.OW;
            if (sw == 1 && hi - lo >= 64) {  // long rows: libc copy, then the sign flip
              std::memcpy(dst + lo, src + lo + off, static_cast<size_t>(hi - lo));
              if (flip)
                for (int64_t ox = lo; ox < hi; ++ox) dst[ox] = static_cast<uint8_t>(dst[ox] ^ 0x80);
            } else if (sw == 1) {  // short rows (small images)
              CopyCodes(src + off + lo, dst + lo, hi - lo, flip);
            } else {
              for (int64_t ox = lo; ox < hi; ++ox) dst[ox] = static_cast<uint8_t>(src[ox * sw + off] ^ flip);
            }
          }
        }
      }
    }
  }
}

// A task's images as padded (phase-split when strided) u8 code planes, and the offsets
// that address them: tap row k of output position t is base[tap[k] + pos(t)], with
// pos(t) = image * img + oy * Wq + ox.
struct PaddedImages {
  const uint8_t* base = nullptr;
  int64_t Wq = 0, img = 0;
  std::vector<int64_t> tap;  // [kp]: rows past kdim point at offset 0 (their weights are 0)
  // pos[t] for output positions t < nb * OH * OW, then 0 up to Pp (padding positions read
  // image 0's first taps: their products are dropped)
  std::vector<int64_t> pos;

  void FillPositions(int64_t nb, int64_t OH, int64_t OW, int64_t Pp) {
    pos.assign(static_cast<size_t>(Pp), 0);
    for (int64_t t = 0, bi = 0; bi < nb; ++bi)
      for (int64_t oy = 0; oy < OH; ++oy)
        for (int64_t ox = 0; ox < OW; ++ox, ++t) pos[t] = bi * img + oy * Wq + ox;
  }
};

// Rows of the weight strip starting at row o0 of `og`: the strips of at most kMaxRows are
// balanced (32 rows: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2: the 2-row kernel reloads the panel
// for few multiplies and cost 6% of a ResNet's time for 6% of its MACs at 1.7x the cost).
int64_t StripRows(int64_t og, int64_t o0) {
  const int64_t strips = (og + kMaxRows - 1) / kMaxRows, base = og / strips, extra = og % strips;
  // the first `extra` strips have base + 1 rows
  return o0 < extra * (base + 1) ? base + 1 : base;
}

// Padded planes with the padding code around; strided convs get them split into sh x sw
// phase planes (space-to-depth: phase (py, px) holds padded[py::sh][px::sw]), so that tap
// (ky, kx) reads phase (ky*dh % sh, kx*dw % sw) at offset (ky*dh / sh, kx*dw / sw) with
// unit stride as well.
PaddedImages PadImagesU8(const uint8_t* x, const PreparedOp& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
                         uint8_t flip, uint8_t pad, int64_t kp) {
  const int64_t H = e.H, W = e.W, Hp = H + 2 * p.ph, Wp = W + 2 * p.pw, cg = e.cg;
  const int64_t sh = p.sh, sw = p.sw;
  const int64_t Hq = (Hp + sh - 1) / sh, Wq = (Wp + sw - 1) / sw;  // one phase plane
  const int64_t phase = Hq * Wq, chan = sh * sw * phase, img = cg * chan;
  thread_local std::vector<uint8_t> padded;
  padded.assign(static_cast<size_t>(nb * img + 16), pad);
  for (int64_t bi = 0; bi < nb; ++bi)
    for (int64_t c = 0; c < cg; ++c) {
      const uint8_t* src = x + (((b0 + bi) * e.C + gi * cg + c) * H) * W;
      uint8_t* dst = padded.data() + bi * img + c * chan;
      int64_t py = p.ph % sh, qy = p.ph / sh;  // phase row of input row y (counters: idiv is slow)
      for (int64_t y = 0; y < H; ++y, (++py == sh ? (py = 0, ++qy) : 0)) {
        const uint8_t* s = src + y * W;
        if (sw == 1) {
          CopyCodes(s, dst + py * phase + qy * Wq + p.pw, W, flip);
          continue;
        }
        for (int64_t i0 = 0; i0 < sw && i0 < W; ++i0) {  // input columns i0, i0 + sw, ... share a phase
          const int64_t xp = i0 + p.pw;
          uint8_t* d = dst + (py * sw + xp % sw) * phase + qy * Wq + xp / sw;
          for (int64_t i = i0; i < W; i += sw) *d++ = static_cast<uint8_t>(s[i] ^ flip);
        }
      }
    }
  PaddedImages r;
  r.base = padded.data();
  r.Wq = Wq;
  r.img = img;
  r.tap.assign(static_cast<size_t>(kp), 0);
  int64_t k = 0;
  for (int64_t c = 0; c < cg; ++c)
    for (int64_t ky = 0; ky < p.kh; ++ky)
      for (int64_t kx = 0; kx < p.kw; ++kx, ++k) {
        const int64_t y0 = ky * p.dh, x0 = kx * p.dw;
        r.tap[k] = c * chan + ((y0 % sh) * sw + x0 % sw) * phase + (y0 / sh) * Wq + x0 / sw;
      }
  return r;
}

// Im2colGenericU8 through PadImagesU8: every tap row of every output row is one plain
// run of OW bytes: no bounds, no per-row calls, no byte gathers for strided convs (on 8 x 8
// images the same-pitch copy spent a call and two memsets per 64-byte row).
void Im2colPaddedU8(const uint8_t* x, const PreparedOp& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
                    uint8_t flip, uint8_t pad, int64_t P, int64_t Pp, uint8_t* cols) {
  const PaddedImages pi = PadImagesU8(x, p, e, b0, nb, gi, flip, pad, e.kdim);
  const int64_t OH = e.OH, OW = e.OW, Wq = pi.Wq, img = pi.img;
  for (int64_t k = 0; k < e.kdim; ++k) {
    const uint8_t* src0 = pi.base + pi.tap[k];
    uint8_t* dst0 = cols + k * Pp;
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* src = src0 + bi * img;
      uint8_t* dst = dst0 + bi * P;
      if (OW == 8) {  // small images: one move per output row
        for (int64_t oy = 0; oy < OH; ++oy) std::memcpy(dst + oy * 8, src + oy * Wq, 8);
      } else if (OW == 4) {
        for (int64_t oy = 0; oy < OH; ++oy) std::memcpy(dst + oy * 4, src + oy * Wq, 4);
      } else {
        for (int64_t oy = 0; oy < OH; ++oy) {
          const uint8_t* s = src + oy * Wq;
          uint8_t* d = dst + oy * OW;
          int64_t i = 0;
          for (; i + 8 <= OW; i += 8) std::memcpy(d + i, s + i, 8);
          for (; i < OW; ++i) d[i] = s[i];
        }
      }
    }
  }
}

void Im2colU8(const uint8_t* x, const PreparedOp& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
              int xdtype, uint8_t pad, int64_t P, int64_t Pp, uint8_t* cols) {
  if (e.W < 32 || p.sw > 1 || p.sh > 1) {
    Im2colPaddedU8(x, p, e, b0, nb, gi, xdtype == kI8 ? 0x80 : 0, pad, P, Pp, cols);
  } else if (p.sw == 1 && p.sh == 1 && e.OW == e.W) {
    Im2colSamePitchU8(x, p, e, b0, nb, gi, xdtype == kI8 ? 0x80 : 0, pad, P, Pp, cols);
  } else {
    Im2colGenericU8(x, p, e, b0, nb, gi, xdtype, pad, P, Pp, cols);
  }
}

#if defined(__x86_64__) || defined(__i386__)
// 16 x 16 byte transpose (SSE2): out row j = byte j of every input row; four rounds of
// unpacks (8-, 16-, 32-, 64-bit), each doubling the run of one column's bytes.
inline void Transpose16x16(const uint8_t* in, int64_t ldi, uint8_t* out, int64_t ldo) {
  __m128i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * ldi));
  // stage 1: t[i] = rows 2i, 2i+1 interleaved, columns 0..7; t[8+i]: columns 8..15
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    t[8 + i] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  // stage 2: rows 4k..4k+3; r[h*8 + k] columns h*8 + 0..3, r[h*8 + 4 + k] columns h*8 + 4..7
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      r[h * 8 + k] = _mm_unpacklo_epi16(t[h * 8 + 2 * k], t[h * 8 + 2 * k + 1]);
      r[h * 8 + 4 + k] = _mm_unpackhi_epi16(t[h * 8 + 2 * k], t[h * 8 + 2 * k + 1]);
    }
  // stage 3: rows 8m..8m+7; for column group g (4 columns: r[g*4 + k], k = row quad)
  //   t[g*4 + 2m] columns 4g + 0..1, t[g*4 + 2m + 1] columns 4g + 2..3
  for (int g = 0; g < 4; ++g)
    for (int m = 0; m < 2; ++m) {
      t[g * 4 + 2 * m] = _mm_unpacklo_epi32(r[g * 4 + 2 * m], r[g * 4 + 2 * m + 1]);
      t[g * 4 + 2 * m + 1] = _mm_unpackhi_epi32(r[g * 4 + 2 * m], r[g * 4 + 2 * m + 1]);
    }
  // stage 4: all 16 rows; column pair (4g + 2s .. +1) from t[g*4 + s] (rows 0..7) and t[g*4 + 2 + s] (rows 8..15)
  for (int g = 0; g < 4; ++g)
    for (int s = 0; s < 2; ++s) {
      r[4 * g + 2 * s] = _mm_unpacklo_epi64(t[g * 4 + s], t[g * 4 + 2 + s]);
      r[4 * g + 2 * s + 1] = _mm_unpackhi_epi64(t[g * 4 + s], t[g * 4 + 2 + s]);
    }
  for (int j = 0; j < 16; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j * ldo), r[j]);
}
#endif

// out[j][i] = in[i][j] for an R x S byte block (the SSE2 path above for full 16 x 16 tiles).
void TransposeBytes(const uint8_t* in, int64_t ldi, int64_t R, int64_t S, uint8_t* out, int64_t ldo) {
  for (int64_t i0 = 0; i0 < R; i0 += 16)
    for (int64_t j0 = 0; j0 < S; j0 += 16) {
#if defined(__x86_64__) || defined(__i386__)
      if (i0 + 16 <= R && j0 + 16 <= S) {
        Transpose16x16(in + i0 * ldi + j0, ldi, out + j0 * ldo + i0, ldo);
        continue;
      }
#endif
      for (int64_t j = j0; j < std::min(S, j0 + 16); ++j)
        for (int64_t i = i0; i < std::min(R, i0 + 16); ++i) out[j * ldo + i] = in[i * ldi + j];
    }
}

// out[j][i] = in[i][j] for an R x S int32 block (4 x 4 SSE2 transposes, scalar edges).
void TransposeI32(const int32_t* in, int64_t ldi, int64_t R, int64_t S, int32_t* out, int64_t ldo) {
  for (int64_t i0 = 0; i0 < R; i0 += 4)
    for (int64_t j0 = 0; j0 < S; j0 += 4) {
#if defined(__x86_64__) || defined(__i386__)
      if (i0 + 4 <= R && j0 + 4 <= S) {
        const int32_t* a = in + i0 * ldi + j0;
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + ldi));
        const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 2 * ldi));
        const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 3 * ldi));
        const __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3);
        const __m128i t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);
        int32_t* o = out + j0 * ldo + i0;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi64(t0, t1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + ldo), _mm_unpackhi_epi64(t0, t1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * ldo), _mm_unpacklo_epi64(t2, t3));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 3 * ldo), _mm_unpackhi_epi64(t2, t3));
        continue;
      }
#endif
      for (int64_t j = j0; j < std::min(S, j0 + 4); ++j)
        for (int64_t i = i0; i < std::min(R, i0 + 4); ++i) out[j * ldo + i] = in[i * ldi + j];
    }
}

// Rows [r0, r1) of one image's zero-point padded NHWC form [H + 2 ph][Wp][C] (u8 codes:
// s8 flipped by 0x80) from its NCHW planes (or NHWC rows): padded row r is input row r - ph.
void ToPaddedNhwcRows(const uint8_t* x, bool x_nhwc, int64_t C, int64_t H, int64_t W, int64_t ph, int64_t pw,
                      int64_t Wp, int64_t r0, int64_t r1, uint8_t flip, uint8_t pad, uint8_t* xp) {
  for (int64_t r = r0; r < r1; ++r) {
    uint8_t* row = xp + (r - r0) * Wp * C;
    const int64_t h = r - ph;
    if (h < 0 || h >= H) {
      std::memset(row, pad, static_cast<size_t>(Wp * C));
      continue;
    }
    std::memset(row, pad, static_cast<size_t>(pw * C));
    std::memset(row + (pw + W) * C, pad, static_cast<size_t>((Wp - pw - W) * C));
    // row h of every channel ([C][W], planes H * W apart) transposed to [W][C], or copied
    // when the image is already NHWC (Graph::nhwc)
    uint8_t* mid = row + pw * C;
    if (x_nhwc) {
      std::memcpy(mid, x + h * W * C, static_cast<size_t>(W * C));
    } else {
      TransposeBytes(x + h * W, H * W, C, W, mid, C);
    }
    if (flip)
      for (int64_t i = 0; i < W * C; ++i) mid[i] = static_cast<uint8_t>(mid[i] ^ 0x80);
  }
}

// AMX implicit-GEMM conv (PreparedOp::amx_conv; needs fast_acc: no overflow possible, an
// I8/U8/I32 output).  A task takes a block of output rows of one image (the whole image
// when the batch feeds the threads), copies the padded input rows it needs to a
// thread-local NHWC buffer (so its tiles read data in its own core's cache: sharing one
// buffer between cores cost more in cache-line transfers than it saved), and runs row
// tiles of 16 positions along an output row over it in place (A rows sw * C bytes apart).
// C starts at bias - z_u * rowsum per output channel; the requantized [positions]
// [channels] block is transposed into the NCHW output.
Status AmxConvImplicit(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, AmxGatherKernel amx) {
  const PreparedOp& p = *op.prepared;
  const Geometry e = Geo(g, op, batch);
  const GraphTensor& xt = g->tensors[op.inputs[0]];
  const bool out_signed = g->tensors[op.outputs[0]].dtype == kI8;
  const bool out_i32 = g->tensors[op.outputs[0]].dtype == kI32;
  const StageI32RowsKernel stage_rows = SelectStageI32RowsKernel(path);
  // fused residual ADD (PreparedOp::fused_add): computed here, skipped by the executor
  const GraphOp* add = (p.fused_add >= 0 && out_i32) ? &g->ops[p.fused_add] : nullptr;
  const uint8_t* add_other = nullptr;
  uint8_t* add_y = nullptr;
  int add_other_dtype = 0;
  int64_t add_other_size = 1;
  bool add_signed = false;
  if (add != nullptr) {
    const uint32_t other = add->inputs[1 - p.fused_slot];
    add_other = g->buffers[other].data();
    add_other_dtype = g->tensors[other].dtype;
    add_other_size = add_other_dtype == kI32 ? 4 : 1;
    add_y = g->buffers[add->outputs[0]].data();
    add_signed = g->tensors[add->outputs[0]].dtype == kI8;
    g->fused_done[p.fused_add] = 1;
  }
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const bool in_nhwc = g->nhwc[op.inputs[0]] != 0, out_nhwc = g->nhwc[op.outputs[0]] != 0;
  const int64_t C = e.C, Wp = p.amx_wp;
  const int32_t zu = p.in_zp + (xt.dtype == kI8 ? 128 : 0);
  const uint8_t flip = xt.dtype == kI8 ? 0x80 : 0;
  thread_local AlignedVector<int32_t> cinit;
  const int64_t ncols = p.amx_panels * 16;
  cinit.resize(static_cast<size_t>(ncols));
  for (int64_t oc = 0; oc < ncols; ++oc) {
    uint32_t v = 0;
    if (oc < e.O)
      v = (p.bias.empty() ? 0u : static_cast<uint32_t>(p.bias[oc])) -
          static_cast<uint32_t>(zu) * static_cast<uint32_t>(p.rowsum[oc]);
    cinit[oc] = static_cast<int32_t>(v);
  }
  const int32_t* ci = cinit.data();
  const int64_t tr = (e.OW + 15) / 16;  // row tiles per output row
  const int threads = ThreadsFor(e.n * e.OH * e.OW * p.cout * (p.kp + 64));
  const int64_t per_image = e.n >= 2 * threads ? 1 : std::min<int64_t>(e.OH, (2 * threads + e.n - 1) / e.n);
  const int64_t block_rows = (e.OH + per_image - 1) / per_image;
  const int64_t blocks = (e.OH + block_rows - 1) / block_rows;
  const int64_t sub_rows = std::max<int64_t>(1, std::min<int64_t>(block_rows, 16 / tr));  // <= 16 row tiles at once
  const RequantKernel requant = SelectRequantKernel(path);
  const int64_t P = e.OH * e.OW;
  ParallelFor(static_cast<int>(e.n * blocks), [&](int t) {
    const int64_t b = t / blocks, by0 = (t % blocks) * block_rows, by1 = std::min(e.OH, by0 + block_rows);
    // padded input rows this block reads
    const int64_t pr0 = by0 * p.sh, pr1 = (by1 - 1) * p.sh + (p.kh - 1) * p.dh + 1;
    thread_local AlignedVector<uint8_t> xp;
    // tiles read up to 15 positions past a row's end and 63 bytes past a segment's end
    xp.resize(static_cast<size_t>((pr1 - pr0) * Wp * C + (16 * p.sw + Wp) * C + 1024));
    ToPaddedNhwcRows(x + b * C * e.H * e.W, in_nhwc, C, e.H, e.W, p.ph, p.pw, Wp, pr0, pr1, flip,
                     static_cast<uint8_t>(zu), xp.data());
    for (int64_t oy0 = by0; oy0 < by1; oy0 += sub_rows) {
      const int64_t oy1 = std::min(by1, oy0 + sub_rows);
      const int64_t mtiles = (oy1 - oy0) * tr;
      thread_local std::vector<int64_t> aoff;
      thread_local AlignedVector<int32_t> acc;
      thread_local std::vector<uint8_t> out8;
      aoff.resize(static_cast<size_t>(mtiles));
      for (int64_t i = 0; i < mtiles; ++i) {
        const int64_t oy = oy0 + i / tr, ox0 = (i % tr) * 16;
        aoff[i] = ((oy * p.sh - pr0) * Wp + ox0 * p.sw) * C;
      }
      acc.resize(static_cast<size_t>(mtiles * 16 * ncols));
      amx(xp.data(), p.sw * C, aoff.data(), p.amx_koff.data(), mtiles, p.amx_w.data(), p.amx_kblocks * 1024,
          p.amx_panels, p.amx_kblocks, acc.data(), ncols, AmxInit::kCols, ci);
      const int64_t rows = mtiles * 16;
      // Stage [positions][channels] into NCHW plane order (the valid rows of each tile,
      // back to back: output positions oy0 * OW ...), then one transpose straight into the
      // output planes.  With whole-row tiles that is a single call over all rows.
      const int64_t npos = (oy1 - oy0) * e.OW;
      const bool whole = e.OW == tr * 16;
      const int64_t first = b * P + oy0 * e.OW;  // NHWC: the block's first position
      if (out_i32) {
        thread_local AlignedVector<int32_t> staged, planes32;
        // NHWC without a fused ADD: staged straight into the output
        int32_t* dst = (out_nhwc && add == nullptr) ? reinterpret_cast<int32_t*>(y) + first * e.O
                                                    : (staged.resize(static_cast<size_t>(npos * e.O)), staged.data());
        if (whole) {
          stage_rows(acc.data(), rows, e.O, ncols, p.out.stage, 0, dst, e.O);
        } else {
          for (int64_t i = 0; i < mtiles; ++i) {
            const int64_t ox0 = (i % tr) * 16, pos = (i / tr) * e.OW + ox0;
            stage_rows(acc.data() + i * 16 * ncols, std::min<int64_t>(16, e.OW - ox0), e.O, ncols, p.out.stage, 0,
                       dst + pos * e.O, e.O);
          }
        }
        if (add == nullptr) {
          if (!out_nhwc)
            TransposeI32(staged.data(), e.O, npos, e.O, reinterpret_cast<int32_t*>(y) + b * e.O * P + oy0 * e.OW, P);
          continue;
        }
        const uint8_t* mine = reinterpret_cast<const uint8_t*>(dst);
        if (out_nhwc) {  // the ADD's tensors are NHWC too (PlanNhwc): one elementwise run
          const uint8_t* theirs = add_other + first * e.O * add_other_size;
          if (p.fused_slot == 0) {
            AddRange(*add, mine, kI32, theirs, add_other_dtype, npos * e.O, add_y + first * e.O, add_signed, path);
          } else {
            AddRange(*add, theirs, add_other_dtype, mine, kI32, npos * e.O, add_y + first * e.O, add_signed, path);
          }
          continue;
        }
        // fused residual ADD: this block's I32 planes against the other input, straight to
        // the ADD's output (same NCHW offsets: the ADD is elementwise on equal shapes)
        planes32.resize(static_cast<size_t>(e.O * npos));
        TransposeI32(staged.data(), e.O, npos, e.O, planes32.data(), npos);
        for (int64_t oc = 0; oc < e.O; ++oc) {
          const int64_t off = (b * e.O + oc) * P + oy0 * e.OW;
          const uint8_t* plane = reinterpret_cast<const uint8_t*>(planes32.data() + oc * npos);
          const uint8_t* theirs = add_other + off * add_other_size;
          if (p.fused_slot == 0) {
            AddRange(*add, plane, kI32, theirs, add_other_dtype, npos, add_y + off, add_signed, path);
          } else {
            AddRange(*add, theirs, add_other_dtype, plane, kI32, npos, add_y + off, add_signed, path);
          }
        }
        continue;
      }
      uint8_t* dst8 = out_nhwc ? y + first * e.O : (out8.resize(static_cast<size_t>(npos * e.O)), out8.data());
      if (whole) {
        requant(acc.data(), rows, e.O, ncols, p.out.stage, 0, dst8, e.O, out_signed);
      } else {
        for (int64_t i = 0; i < mtiles; ++i) {
          const int64_t ox0 = (i % tr) * 16, pos = (i / tr) * e.OW + ox0;
          requant(acc.data() + i * 16 * ncols, std::min<int64_t>(16, e.OW - ox0), e.O, ncols, p.out.stage, 0,
                  dst8 + pos * e.O, e.O, out_signed);
        }
      }
      if (!out_nhwc) TransposeBytes(out8.data(), e.O, npos, e.O, y + b * e.O * P + oy0 * e.OW, P);
    }
  }, /*work=*/e.n * P * p.cout * (p.kp + 64));  // + the output stage and transposes per output
  return Status::Ok();
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
  // >= ~512 columns per GEMM, but at least two tasks per thread when the batch allows
  // (one task of 32 small images kept the second core idle)
  // work: the MACs plus ~64 per output and output stage (twins add theirs, see below)
  const int64_t stages = 1 + (p.fast_acc ? static_cast<int64_t>(p.twins.size()) : 0);
  const int64_t work = e.n * P * p.cout * (p.kp + 64 * stages);
  const int64_t want = 2 * ThreadsFor(work);
  const int64_t per_task =
      std::max<int64_t>(1, std::min<int64_t>({e.n, (512 + P - 1) / P, (e.n + want - 1) / want}));
  const int64_t chunks = (e.n + per_task - 1) / per_task;
  const int64_t kpairs = p.kp / 2, kquads = p.kp / 4;
  const IntMicroKernel kernel = SelectIntMicroKernel(PanelFormat::kI16, path);
  const VnniMicroKernel vnni = p.w8.empty() ? nullptr : SelectQuadMicroKernel(false, p.maddubs_steps, path);
  const AmxKernel amx = p.w8.empty() ? nullptr : SelectAmxKernel(path);
  const RequantKernel requant = SelectRequantKernel(path);
  const StageI32Kernel stage_i32 = SelectStageI32Kernel(path);
  const StageI32StridedKernel stage_i32_rows = SelectStageI32StridedKernel(path);
  const int tasks = static_cast<int>(chunks * p.groups);
  std::vector<int64_t> counts(static_cast<size_t>(tasks), 0);
  // twin convs (PreparedOp::twins) whose stages this run applies too: (op, output dtype)
  std::vector<std::pair<const GraphOp*, int>> twins;
  if (p.fast_acc)
    for (int32_t j : p.twins) {
      twins.emplace_back(&g->ops[j], g->tensors[g->ops[j].outputs[0]].dtype);
      g->fused_done[j] = 1;
    }
  ParallelFor(tasks, [&](int t) {
    const int64_t chunk = t / p.groups, gi = t % p.groups;
    const int64_t b0 = chunk * per_task, nb = std::min(per_task, e.n - b0);
    const int64_t cols_n = nb * P, Pp = (cols_n + 15) / 16 * 16, npanels = Pp / 16;
    thread_local AlignedVector<int32_t> acc;
    const int64_t og16 = (e.og + 15) / 16 * 16;
    acc.resize(static_cast<size_t>(og16 * Pp));
    bool bias_done = false;
    const int32_t zu = p.in_zp + (xt.dtype == kI8 ? 128 : 0);
    PaddedImages pi;
    if (!amx) {  // both gathered forms below read padded images at these offsets
      pi = PadImagesU8(x, p, e, b0, nb, gi, xt.dtype == kI8 ? 0x80 : 0, static_cast<uint8_t>(zu), p.kp);
      pi.FillPositions(nb, e.OH, e.OW, Pp);
    }
    if (amx) {
      // AMX: s8 weight rows (A tiles) x u8 activation panels (B tiles, 16 quads per K
      // block, zero past K).  C starts at -z_u * rowsum (+ bias when no overflow is
      // possible), one 16 x 16 tile per 16 channels, so no pass over C remains.
      thread_local AlignedVector<uint8_t> cols8, panels8;
      thread_local AlignedVector<int32_t> cinit;
      const int64_t kblocks = p.kp64 / kAmxKBlock, kq16 = kblocks * 16;
      cols8.assign(static_cast<size_t>(p.kp * Pp), 0);
      panels8.resize(static_cast<size_t>(npanels * kq16 * 64));
      Im2colU8(x, p, e, b0, nb, gi, xt.dtype, static_cast<uint8_t>(zu), P, Pp, cols8.data());
      PackU8QuadPanels(cols8.data(), Pp, kquads, npanels, kq16, panels8.data());
      cinit.resize(static_cast<size_t>(og16 * 16));
      bias_done = p.fast_acc && !p.bias.empty();
      for (int64_t o = 0; o < og16; ++o) {
        const int64_t oc = gi * e.og + o;
        uint32_t v = 0;
        if (o < e.og) {
          v = (bias_done ? static_cast<uint32_t>(p.bias[oc]) : 0u) -
              static_cast<uint32_t>(zu) * static_cast<uint32_t>(p.rowsum[oc]);
        }
        for (int i = 0; i < 16; ++i) cinit[o * 16 + i] = static_cast<int32_t>(v);
      }
      amx(true, reinterpret_cast<const uint8_t*>(p.w8[gi].data()), p.kp64, og16 / 16, panels8.data(), kq16 * 64,
          npanels, kblocks, acc.data(), Pp, AmxInit::kRows, cinit.data());
    } else if (vnni) {
      // u8 quad panels gathered from padded images one panel at a time (as the int16 path
      // below; no im2col matrix).  K rows past kdim read offset 0 (their weights are 0).
      thread_local std::vector<uint8_t> panels8;
      panels8.resize(static_cast<size_t>(kquads * 64));
      const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w8[gi].data());
      for (int64_t q = 0; q < npanels; ++q) {
        PackU8QuadPanelsGather(pi.base, pi.tap.data(), kquads, pi.pos.data() + 16 * q, 1, panels8.data());
        for (int64_t o0 = 0, rows = 0; o0 < e.og; o0 += rows) {
          rows = StripRows(e.og, o0);
          vnni(static_cast<int>(rows), w + o0 * p.kp64, p.kp64, panels8.data(), kquads, acc.data() + o0 * Pp + q * 16,
               Pp, false);
        }
      }
      // one pass for the zero-point offset and (when no overflow is possible) the bias;
      // none when both are 0 (e.g. ReLU outputs with zero point 0 and no bias)
      bias_done = p.fast_acc && !p.bias.empty();
      for (int64_t o = 0; o < e.og; ++o) {
        const int64_t oc = gi * e.og + o;
        const uint32_t corr = static_cast<uint32_t>(zu) * static_cast<uint32_t>(p.rowsum[oc]) -
                              (bias_done ? static_cast<uint32_t>(p.bias[oc]) : 0u);
        if (corr == 0) continue;
        int32_t* row = acc.data() + o * Pp;
        for (int64_t i = 0; i < cols_n; ++i) row[i] = static_cast<int32_t>(static_cast<uint32_t>(row[i]) - corr);
      }
    } else {
      // int16 pair panels (code - zu) gathered straight from the padded images: no im2col
      // matrix (its row copies cost more than the GEMM on small images).  Positions past
      // cols_n and K rows past kdim read offset 0: their products are dropped / times 0.
      thread_local std::vector<int16_t> panels;
      // one panel at a time, packed right before its row strips read it (from L1; packing
      // all panels first left them in L2 for the kernel)
      panels.resize(static_cast<size_t>(kpairs * 32));
      const int16_t* w = p.w16[gi].data();
      for (int64_t q = 0; q < npanels; ++q) {
        PackI16PanelsGather(pi.base, pi.tap.data(), kpairs, pi.pos.data() + 16 * q, 1, static_cast<uint8_t>(zu),
                            panels.data(), path);
        const uint8_t* panel = reinterpret_cast<const uint8_t*>(panels.data());
        for (int64_t o0 = 0, rows = 0; o0 < e.og; o0 += rows) {
          rows = StripRows(e.og, o0);
          kernel(static_cast<int>(rows), w + o0 * p.kp, p.kp, panel, kpairs, acc.data() + o0 * Pp + q * 16, Pp, false);
        }
      }
    }
    for (int64_t o = 0; o < e.og; ++o) {
      const int64_t oc = gi * e.og + o;
      int32_t* row = acc.data() + o * Pp;
      if (p.fast_acc) {
        if (!p.bias.empty() && !bias_done)
          for (int64_t i = 0; i < cols_n; ++i) row[i] += p.bias[oc];
        // this op's stage, then each twin's on the same accumulators
        for (size_t tw = 0; tw <= twins.size(); ++tw) {
          const StageData& sd = tw == 0 ? p.out : twins[tw - 1].first->prepared->out;
          const int dt = tw == 0 ? out_dtype : twins[tw - 1].second;
          uint8_t* dst = tw == 0 ? y : g->buffers[twins[tw - 1].first->outputs[0]].data();
          const Rescale& r = sd.stage.rescale;
          OutputStage one = sd.stage;
          const int64_t ch = r.channels == 1 ? 0 : oc;
          one.rescale.multiplier = r.multiplier + ch;
          one.rescale.shift = r.shift + ch;
          one.rescale.channels = 1;
          if (dt != kI32) {  // all nb images in one call: rows = images, output stride O * P
            requant(row, nb, P, P, one, 0, dst + (b0 * e.O + oc) * P, e.O * P, dt == kI8);
            continue;
          }
          int32_t* dst32 = reinterpret_cast<int32_t*>(dst) + (b0 * e.O + oc) * P;
          if (stage_i32_rows != nullptr) {  // all nb images in one call, like requant above
            stage_i32_rows(row, nb, P, P, one, dst32, e.O * P);
          } else {
            for (int64_t bi = 0; bi < nb; ++bi) stage_i32(row + bi * P, P, one, dst32 + bi * e.O * P);
          }
        }
      } else {
        for (int64_t bi = 0; bi < nb; ++bi)
          for (int64_t i = 0; i < P; ++i)
            Emit(row[bi * P + i], p, oc, y, out_dtype == kI32, ((b0 + bi) * e.O + oc) * P + i, &counts[t]);
      }
    }
  }, /*work=*/work);
  for (int64_t c : counts) *overflow += c;
  return Status::Ok();
}

}  // namespace

Status RunConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow) {
  const PreparedOp& p = *op.prepared;
  if (p.spatial > 0 && p.amx_conv && p.fast_acc) {
    if (const AmxGatherKernel amx = SelectAmxGatherKernel(path)) return AmxConvImplicit(g, op, batch, path, amx);
  }
  if (p.spatial > 0 && !p.w16.empty() && path != kPathRef) return IntConvFast(g, op, batch, path, overflow);
  const Geometry e = Geo(g, op, batch);
  const int out_dtype = g->tensors[op.outputs[0]].dtype;
  if (p.spatial == 0 && p.groups == 1 && p.fast_stage && p.int32_exact && path != kPathRef && !p.bin_out &&
      g->tensors[op.inputs[0]].dtype != kBin && (out_dtype == kI8 || out_dtype == kU8)) {
    // LINEAR with no overflow possible: bias and output stage inside the GEMM, vectorized on
    // the task's block while it is in cache (the per-element path below cost 3x the GEMM on
    // wide layers)
    ActView av;
    av.data = g->buffers[op.inputs[0]].data();
    av.dtype = g->tensors[op.inputs[0]].dtype == kU8 ? DType::kUInt8 : DType::kInt8;
    av.rows = e.n;
    av.cols = e.kdim;
    av.ld = e.kdim;
    av.zero_point = p.in_zp;
    av.max_code = p.in_max_code;
    GemmOutput o;
    o.data = g->buffers[op.outputs[0]].data();
    o.dtype = out_dtype == kI8 ? DType::kInt8 : DType::kUInt8;
    o.ld = e.og;
    o.stage = &p.out.stage;
    return Gemm(av, p.packed[0], p.bias.empty() ? nullptr : p.bias.data(), o, path);
  }
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
      av.max_code = p.in_max_code;
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
