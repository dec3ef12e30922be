// Portable optimized kernels: the same panel algorithm as the AVX2 kernels in plain
// C++ (the compiler vectorizes what it can).  The fallback on CPUs without AVX2 and a
// second, independent implementation of the packed layouts for the tests.
#include <cstdint>
#include <cstring>

#include "kernels/portable/portable_kernels.h"
#include "ref/ref.h"

namespace qdsl {
namespace portable {
namespace {

// Field f (0..) of width `bits` from a byte, sign-extended.
inline int32_t Field(uint8_t byte, int bits, int f) {
  const int v = (byte >> (bits * f)) & ((1 << bits) - 1);
  return v >= (1 << (bits - 1)) ? v - (1 << bits) : v;
}

// Panel slot value for k-pair j, half h (0: columns 0..7, 1: 8..15), slot i.
inline int32_t Slot(PanelFormat f, const uint8_t* panel, int64_t j, int h, int i) {
  switch (f) {
    case PanelFormat::kI16: {
      int16_t v;
      std::memcpy(&v, panel + j * 64 + h * 32 + 2 * i, 2);
      return v;
    }
    case PanelFormat::kI4: return Field(panel[j * 16 + i], 4, h);
    default: return Field(panel[(j / 2) * 16 + i], 2, (j % 2) * 2 + h);
  }
}

template <PanelFormat F>
void Kernel(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
            bool accumulate) {
  for (int r = 0; r < rows; ++r) {
    uint32_t acc[16];
    for (int col = 0; col < 16; ++col) acc[col] = accumulate ? static_cast<uint32_t>(c[r * ldc + col]) : 0u;
    for (int64_t j = 0; j < kpairs; ++j) {
      const int32_t a0 = a[r * lda + 2 * j], a1 = a[r * lda + 2 * j + 1];
      for (int h = 0; h < 2; ++h) {
        for (int col = 0; col < 8; ++col) {
          const int32_t sum = a0 * Slot(F, panel, j, h, 2 * col) + a1 * Slot(F, panel, j, h, 2 * col + 1);
          acc[h * 8 + col] += static_cast<uint32_t>(sum);
        }
      }
    }
    for (int col = 0; col < 16; ++col) c[r * ldc + col] = static_cast<int32_t>(acc[col]);
  }
}

}  // namespace

void GemmI16(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
             bool accumulate) {
  Kernel<PanelFormat::kI16>(rows, a, lda, panel, kpairs, c, ldc, accumulate);
}
void GemmI4(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
            bool accumulate) {
  Kernel<PanelFormat::kI4>(rows, a, lda, panel, kpairs, c, ldc, accumulate);
}
void GemmI2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
            bool accumulate) {
  Kernel<PanelFormat::kI2>(rows, a, lda, panel, kpairs, c, ldc, accumulate);
}

void BinaryPopcount(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                    int64_t kwords, int32_t* pc, int64_t ldc) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t col = 0; col < n; ++col) {
      int64_t total = 0;
      for (int64_t j = 0; j < kwords; ++j) total += __builtin_popcountll(a[r * lda + j] ^ w[col * ldw + j]);
      pc[r * ldc + col] = static_cast<int32_t>(total);
    }
  }
}

void Requant(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
             void* out, int64_t ldo, bool out_signed) {
  ref::Requant(acc, rows, cols, lda, stage, c0, out, ldo, out_signed);
}

}  // namespace portable
}  // namespace qdsl
