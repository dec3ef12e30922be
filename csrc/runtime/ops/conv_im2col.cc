// im2col forms of the conv input (conv.h): the plain one of the generic / reference path,
// and the transposed u8 code forms (same-pitch copies, generic, padded and phase-split
// images) the gathered-panel and AMX convs read.
#include <algorithm>
#include <cstring>

#include "runtime/ops/conv.h"

namespace qdsl {
namespace conv {

Geometry Geo(const Graph* g, const GraphOp& op, int64_t batch) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
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
  if (p.spatial == 0) {  // LINEAR: (N, ..., K) rows of K features, channels last
    e.C = xs.back();
    e.n = Numel(xs) / std::max<int64_t>(e.C, 1);
    e.O = ys.back();
    e.cg = e.C / p.groups;
    e.og = e.O / p.groups;
  }
  e.kdim = e.cg * p.kh * p.kw;
  return e;
}

// rows [n*OH*OW][kdim] of group gi; out-of-bounds taps take `pad`.
void Im2col(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t gi, uint8_t pad, uint8_t* rows) {
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

namespace {

// Im2colGenericU8 when the output rows have the input's pitch (stride 1 and
// OW == W, e.g. "same" 3x3 convs): each (c, ky, kx) row of an image is then one shifted
// copy of the input plane, plus the padding code in the rows and the few columns whose
// taps fall outside.  About 30x fewer calls than a copy per output row on 32x32 images.
void Im2colSamePitchU8(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
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
void Im2colGenericU8(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
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

}  // namespace

// Padded planes with the padding code around; strided convs get them split into sh x sw
// phase planes (space-to-depth: phase (py, px) holds padded[py::sh][px::sw]), so that tap
// (ky, kx) reads phase (ky*dh % sh, kx*dw % sw) at offset (ky*dh / sh, kx*dw / sw) with
// unit stride as well.
PaddedImages PadImagesU8(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
                         uint8_t flip, uint8_t pad, int64_t kp, std::vector<uint8_t>* storage) {
  const int64_t H = e.H, W = e.W, Hp = H + 2 * p.ph, Wp = W + 2 * p.pw, cg = e.cg;
  const int64_t sh = p.sh, sw = p.sw;
  const int64_t Hq = (Hp + sh - 1) / sh, Wq = (Wp + sw - 1) / sw;  // one phase plane
  const int64_t phase = Hq * Wq, chan = sh * sw * phase, img = cg * chan;
  // stride 1, no padding, one group and codes as they are (U8): the padded layout is the
  // input's own (planes H * W apart, images C * H * W), so readers use the input in place
  // (a copy and a fill of every 1x1 conv's input otherwise)
  const bool in_place = sh == 1 && sw == 1 && p.ph == 0 && p.pw == 0 && flip == 0 && cg == e.C;
  thread_local std::vector<uint8_t> local;
  std::vector<uint8_t>& padded = storage != nullptr ? *storage : local;
  if (!in_place) padded.assign(static_cast<size_t>(nb * img + 16), pad);
  for (int64_t bi = 0; bi < nb && !in_place; ++bi)
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
  r.base = in_place ? x + b0 * img : padded.data();
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

namespace {

// Im2colGenericU8 through PadImagesU8: every tap row of every output row is one plain
// run of OW bytes: no bounds, no per-row calls, no byte gathers for strided convs (on 8 x 8
// images the same-pitch copy spent a call and two memsets per 64-byte row).
void Im2colPaddedU8(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
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

}  // namespace

void Im2colU8(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
              int xdtype, uint8_t pad, int64_t P, int64_t Pp, uint8_t* cols) {
  if (e.W < 32 || p.sw > 1 || p.sh > 1) {
    Im2colPaddedU8(x, p, e, b0, nb, gi, xdtype == kI8 ? 0x80 : 0, pad, P, Pp, cols);
  } else if (p.sw == 1 && p.sh == 1 && e.OW == e.W) {
    Im2colSamePitchU8(x, p, e, b0, nb, gi, xdtype == kI8 ? 0x80 : 0, pad, P, Pp, cols);
  } else {
    Im2colGenericU8(x, p, e, b0, nb, gi, xdtype, pad, P, Pp, cols);
  }
}

}  // namespace conv
}  // namespace qdsl
