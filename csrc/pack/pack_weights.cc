// Weight packing for the optimized int paths, and sign bit-packing for binary GEMM.
//
// Panel layout (16 output columns, K padded with zeros to a multiple of 4; padding
// multiplies activation padding that is also 0, so it never changes a sum):
// for k-pair j the micro-kernel needs two int16 vectors
//   B0 slot i (i < 16): column i/2,     k = 2j + i%2
//   B1 slot i (i < 16): column 8 + i/2, k = 2j + i%2
// so that vpmaddwd(broadcast(A[m][2j], A[m][2j+1]), B0) gives columns 0..7.
//   kI16: B0 then B1 as int16 (W - w_zp): 64 bytes per k-pair.  Any zero point.
//   kI4 : byte i = B0[i] & 15 | B1[i] << 4: 16 bytes per k-pair (symmetric int4).
//   kI2 : byte i = B0_j[i] & 3 | B1_j[i] << 2 | B0_j+1[i] << 4 | B1_j+1[i] << 6:
//         16 bytes per two k-pairs (symmetric int2).
// The micro-kernels sign-extend bytes and use arithmetic shifts to recover the fields.
#include <algorithm>
#include <cstring>

#include "qdsl/gemm.h"

namespace qdsl {
namespace {

int16_t Slot(const PackedWeights& w, int64_t panel, int64_t j, int half, int i) {
  const int64_t col = panel * kPanelCols + half * 8 + i / 2;
  const int64_t k = 2 * j + i % 2;
  if (col >= w.n || k >= w.k) return 0;
  return w.raw[col * w.k + k];
}

template <typename T>
int PairBoundT(const T* w, int64_t rows, int64_t k, int64_t ld) {
  int worst = 0;  // max over pairs of max(positive part, -negative part)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = w + r * ld;
    for (int64_t c = 0; c < k; c += 2) {
      const int w0 = row[c], w1 = c + 1 < k ? static_cast<int>(row[c + 1]) : 0;
      const int pos = (w0 > 0 ? w0 : 0) + (w1 > 0 ? w1 : 0), neg = -((w0 < 0 ? w0 : 0) + (w1 < 0 ? w1 : 0));
      worst = std::max(worst, std::max(pos, neg));
    }
  }
  return worst;
}

}  // namespace

int MaddubsStepsFor(int pair_bound, int max_code) {
  if (pair_bound <= 0 || max_code <= 0) return 8;
  return static_cast<int>(std::min<int64_t>(8, 32767 / (int64_t{max_code} * pair_bound)));
}
int MaddubsPairBound(const int16_t* w, int64_t rows, int64_t k, int64_t ld) { return PairBoundT(w, rows, k, ld); }
int MaddubsPairBound(const int8_t* w, int64_t rows, int64_t k, int64_t ld) { return PairBoundT(w, rows, k, ld); }

Status PackWeights(const int16_t* wp, int64_t n, int64_t k, int64_t ldw, PackedWeights* out) {
  QDSL_CHECK_ARG(wp != nullptr && out != nullptr, "null weight pointer");
  QDSL_CHECK_ARG(n > 0 && k > 0 && ldw >= k, "bad weight shape n=%lld k=%lld ld=%lld", (long long)n, (long long)k,
                 (long long)ldw);
  QDSL_CHECK_ARG(n <= (int64_t{1} << 31) && k <= (int64_t{1} << 31), "weight matrix too large");
  PackedWeights& w = *out;
  w = PackedWeights();
  w.n = n;
  w.k = k;
  w.bits = 16;
  w.raw.resize(static_cast<size_t>(n * k));
  int lo = 0, hi = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const int v = wp[r * ldw + c];
      QDSL_CHECK_ARG(v >= -512 && v <= 511, "weight [%lld][%lld] = %d outside [-512, 511]", (long long)r,
                     (long long)c, v);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
      w.raw[r * k + c] = static_cast<int16_t>(v);
    }
  }
  w.kp = (k + 3) / 4 * 4;
  w.panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t kpairs = w.kp / 2;
  w.format = (lo >= -2 && hi <= 1) ? PanelFormat::kI2 : ((lo >= -8 && hi <= 7) ? PanelFormat::kI4 : PanelFormat::kI16);
  w.panel_bytes = w.format == PanelFormat::kI16 ? kpairs * 64 : (w.format == PanelFormat::kI4 ? kpairs * 16 : kpairs * 8);
  w.packed.assign(static_cast<size_t>(w.panels * w.panel_bytes + 64), 0);  // +64: vector over-read slack
  for (int64_t p = 0; p < w.panels; ++p) {
    uint8_t* dst = w.packed.data() + p * w.panel_bytes;
    for (int64_t j = 0; j < kpairs; ++j) {
      for (int i = 0; i < 16; ++i) {
        const int16_t b0 = Slot(w, p, j, 0, i), b1 = Slot(w, p, j, 1, i);
        if (w.format == PanelFormat::kI16) {
          std::memcpy(dst + j * 64 + 2 * i, &b0, 2);
          std::memcpy(dst + j * 64 + 32 + 2 * i, &b1, 2);
        } else if (w.format == PanelFormat::kI4) {
          dst[j * 16 + i] = static_cast<uint8_t>((b0 & 15) | ((b1 & 15) << 4));
        } else {
          const int shift = (j % 2) * 4;
          dst[(j / 2) * 16 + i] |= static_cast<uint8_t>(((b0 & 3) | ((b1 & 3) << 2)) << shift);
        }
      }
    }
  }
  if (lo >= -128 && hi <= 127) {
    // int8 weights get a VNNI panel; int4/int2 panels are converted to it block by block
    // at run time (csrc/gemm.cc), so they keep their 4x / 8x smaller footprint.
    const int64_t kquads = w.kp / 4;
    const bool keep = w.format == PanelFormat::kI16;
    // +1 KiB: the AMX tiles read up to 15 quads past the last panel's K (times zero activations)
    if (keep) w.vnni.assign(static_cast<size_t>(w.panels * kquads * 64 + 1024), 0);
    w.colsum.assign(static_cast<size_t>(w.panels * kPanelCols), 0);
    for (int64_t col = 0; col < n; ++col) {
      const int64_t p = col / kPanelCols, h = (col % kPanelCols) / 8, i = col % 8;
      int32_t sum = 0;
      for (int64_t k = 0; k < w.k; ++k) {
        const int16_t v = w.raw[col * w.k + k];
        sum += v;
        if (keep)
          w.vnni[static_cast<size_t>(((p * kquads + k / 4) * 64) + h * 32 + i * 4 + k % 4)] =
              static_cast<uint8_t>(static_cast<int8_t>(v));
      }
      w.colsum[col] = sum;
    }
    w.maddubs_pair = MaddubsPairBound(w.raw.data(), n, k, k);
    w.maddubs_steps = MaddubsStepsFor(w.maddubs_pair, 255);
  }
  return Status::Ok();
}

void SplitNibbles(const uint64_t* src, int64_t words, uint64_t* dst) {
  constexpr uint64_t kLow = 0x0F0F0F0F0F0F0F0Full;
  for (int64_t g = 0; g < words; g += 4)
    for (int i = 0; i < 4; ++i) {
      dst[2 * g + i] = src[g + i] & kLow;
      dst[2 * g + 4 + i] = (src[g + i] >> 4) & kLow;
    }
}

Status BitpackSigns(const int8_t* a, int64_t m, int64_t k, int64_t lda, uint64_t* out, int64_t kwords) {
  QDSL_CHECK_ARG(a != nullptr && out != nullptr && m >= 0 && k > 0 && lda >= k, "bad bitpack arguments");
  QDSL_CHECK_ARG(kwords * 64 >= k, "kwords=%lld too small for k=%lld", (long long)kwords, (long long)k);
  for (int64_t r = 0; r < m; ++r) {
    uint64_t* row = out + r * kwords;
    std::memset(row, 0, static_cast<size_t>(kwords) * 8);
    for (int64_t c = 0; c < k; ++c) {
      const int v = a[r * lda + c];
      QDSL_CHECK_ARG(v == 1 || v == -1, "binary value [%lld][%lld] = %d is not +1 or -1", (long long)r,
                     (long long)c, v);
      if (v < 0) row[c >> 6] |= uint64_t{1} << (c & 63);
    }
  }
  return Status::Ok();
}

Status PackBinaryWeights(const int8_t* wp, int64_t n, int64_t k, int64_t ldw, PackedWeights* out) {
  QDSL_CHECK_ARG(wp != nullptr && out != nullptr && n > 0 && k > 0 && ldw >= k, "bad binary weight shape");
  PackedWeights& w = *out;
  w = PackedWeights();
  w.n = n;
  w.k = k;
  w.bits = 1;
  w.kwords = (k + 63) / 64;
  w.bits_rows.assign(static_cast<size_t>(n * w.kwords + 4), 0);  // +4: vector over-read slack
  QDSL_RETURN_IF_ERROR(BitpackSigns(wp, n, k, ldw, w.bits_rows.data(), w.kwords));
  if (w.kwords % 4 == 0) {
    w.bits_split.assign(static_cast<size_t>(2 * n * w.kwords), 0);
    for (int64_t c = 0; c < n; ++c)
      SplitNibbles(w.bits_rows.data() + c * w.kwords, w.kwords, w.bits_split.data() + 2 * c * w.kwords);
  }
  w.ncols_pad = (n + 7) / 8 * 8;
  w.bits_cols.assign(static_cast<size_t>(w.kwords * w.ncols_pad + 8), 0);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t j = 0; j < w.kwords; ++j) w.bits_cols[j * w.ncols_pad + c] = w.bits_rows[c * w.kwords + j];
  return Status::Ok();
}

}  // namespace qdsl
