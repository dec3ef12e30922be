// Transposes of the conv epilogues and the NCHW -> zero-point padded NHWC rows the AMX
// implicit conv reads (conv.h).
#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#include <tmmintrin.h>
#endif

#include "runtime/ops/conv.h"

namespace qdsl {
namespace conv {

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

#if defined(__x86_64__) || defined(__i386__)
namespace {

// out[3 i + c] = src_c[i] for i < n (three NCHW plane rows to NHWC pixels, an RGB image's):
// 16 pixels per step, each 16 output bytes one pshufb of every plane's 16 bytes, or'ed.  (The
// byte loop of TransposeBytes was ~15 % of a 7 x 7 x 3 stem's implicit-GEMM conv.)
__attribute__((target("ssse3"))) void Interleave3(const uint8_t* s0, const uint8_t* s1, const uint8_t* s2, int64_t n,
                                                 uint8_t* out) {
  alignas(16) int8_t mask[3][3][16];  // [output vector][plane][byte]
  for (int v = 0; v < 3; ++v)
    for (int i = 0; i < 16; ++i)
      for (int c = 0; c < 3; ++c) mask[v][c][i] = (16 * v + i) % 3 == c ? static_cast<int8_t>((16 * v + i) / 3) : -128;
  __m128i m[3][3];
  for (int v = 0; v < 3; ++v)
    for (int c = 0; c < 3; ++c) m[v][c] = _mm_load_si128(reinterpret_cast<const __m128i*>(mask[v][c]));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s0 + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s1 + i));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s2 + i));
    for (int v = 0; v < 3; ++v) {
      const __m128i o = _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(a, m[v][0]), _mm_shuffle_epi8(b, m[v][1])),
                                     _mm_shuffle_epi8(c, m[v][2]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 3 * i + 16 * v), o);
    }
  }
  for (; i < n; ++i) {
    out[3 * i] = s0[i];
    out[3 * i + 1] = s1[i];
    out[3 * i + 2] = s2[i];
  }
}

bool HasSsse3() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("ssse3") != 0;
  }();
  return has;
}

}  // namespace
#endif

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
#if defined(__x86_64__) || defined(__i386__)
    } else if (C == 3 && HasSsse3()) {
      Interleave3(x + h * W, x + (H + h) * W, x + (2 * H + h) * W, W, mid);
#endif
    } else {
      TransposeBytes(x + h * W, H * W, C, W, mid, C);
    }
    if (flip)
      for (int64_t i = 0; i < W * C; ++i) mid[i] = static_cast<uint8_t>(mid[i] ^ 0x80);
  }
}

}  // namespace conv
}  // namespace qdsl
