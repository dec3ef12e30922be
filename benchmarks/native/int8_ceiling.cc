// Register-tile ceilings of u8 x s8 -> s32 dot products on AVX2 without VNNI.
//
// Built and run by benchmarks/int8_ceiling.py.  Each variant is a 4-row x 16-column
// micro-kernel over K = 256 with every operand in L1, so the figure is the instruction
// mix's own throughput, not memory's.  Variants:
//   saturating  vpmaddubsw + vpmaddwd(1) + vpaddd     the pattern of the onnxruntime and
//               fbgemm u8s8 kernels: 3 ops per 32 MACs, but a pair of u8*s8 products can
//               exceed int16 (255*128*2 > 32767) and vpmaddubsw then saturates.
//   int16       vpmaddwd + vpaddd on operands widened to int16 (qdsl's exact int8 path):
//               4 ops per 32 MACs.
//   sign        vpsignb + vpmaddubsw + vpmaddwd(1) + vpaddd on |a-128| and sign(a-128)*w:
//               exact for narrow-range weights (|w| <= 127), 4 ops per 32 MACs.
// Splitting an operand into nibbles makes vpmaddubsw exact too, but costs two of them
// per 32 MACs, as many multiplies as int16 and more adds, so it is not measured.
// Each variant's 4x16 outputs are checked against the exact integer product: the
// program prints how many differ, so the saturation of the first one is visible.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

constexpr int kQuads = 64;  // K = 256
constexpr int kK = kQuads * 4;
alignas(64) uint8_t a_u8[4][kK];      // activations, row-major
alignas(64) int8_t w_s8[kK][16];      // weights, K x 16
alignas(64) uint8_t a_quads[kQuads][4][4];       // [quad][row][4 bytes]
alignas(64) uint8_t a_abs[kQuads][4][4];         // |a - 128|
alignas(64) int8_t a_sgn[kQuads][4][4];          // a - 128 (its sign)
alignas(64) int8_t w_quads[kQuads][16][4];       // [quad][column][4 bytes]
alignas(64) int16_t a_pairs[kK / 2][4][2];       // [pair][row][2 x int16]
alignas(64) int16_t w_pairs[kK / 2][16][2];
int32_t exact[4][16];
int32_t col_sum[16];  // sum_k w[k][n], for the sign variant's offset

using Tile = int32_t[4][16];

// The loop bodies are inline asm with fixed registers, as in csrc's kernels: compiled
// from intrinsics, GCC adds register moves or spills that would measure the compiler.
// ymm0-7: the 4x16 int32 accumulators; ymm8/9: the two weight vectors of a K step;
// ymm10-14: temporaries; ymm15: the int16 ones.
#define QC_ZERO "vpxor %%ymm0, %%ymm0, %%ymm0\n\tvmovdqa %%ymm0, %%ymm1\n\tvmovdqa %%ymm0, %%ymm2\n\t" \
  "vmovdqa %%ymm0, %%ymm3\n\tvmovdqa %%ymm0, %%ymm4\n\tvmovdqa %%ymm0, %%ymm5\n\t"             \
  "vmovdqa %%ymm0, %%ymm6\n\tvmovdqa %%ymm0, %%ymm7\n\t"
#define QC_STORE "vmovdqu %%ymm0, (%[out])\n\tvmovdqu %%ymm1, 32(%[out])\n\t"      \
  "vmovdqu %%ymm2, 64(%[out])\n\tvmovdqu %%ymm3, 96(%[out])\n\t"                \
  "vmovdqu %%ymm4, 128(%[out])\n\tvmovdqu %%ymm5, 160(%[out])\n\t"              \
  "vmovdqu %%ymm6, 192(%[out])\n\tvmovdqu %%ymm7, 224(%[out])\n\t"
// The K loop around four row bodies: two weight vectors per step, 16 (or 8) bytes of
// activations per step for the four rows, then the store of the tile.
#define QC_ROWS(ROW) ROW(0, 0, 1) ROW(4, 2, 3) ROW(8, 4, 5) ROW(12, 6, 7)
#define QC_LOOP(BODY, ADVANCE_A)                                                     \
  "1:\n\tvmovdqa (%[w]), %%ymm8\n\tvmovdqa 32(%[w]), %%ymm9\n\t" QC_ROWS(BODY) ADVANCE_A \
  "add $64, %[w]\n\tdec %[n]\n\tjnz 1b\n\t" QC_STORE
#define QC_ONES "vmovdqu (%[one]), %%ymm15\n\t"
const int16_t kOnes[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
#define QC_CLOBBER                                                                      \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc"

// saturating: one row, u8 quad at OFF(%[a]) into accumulators C0, C1.
#define QC_SAT_ROW(OFF, C0, C1)                                                    \
  "vpbroadcastd " #OFF "(%[a]), %%ymm10\n\t"                                       \
  "vpmaddubsw %%ymm8, %%ymm10, %%ymm11\n\tvpmaddwd %%ymm15, %%ymm11, %%ymm11\n\t" \
  "vpaddd %%ymm11, %%ymm" #C0 ", %%ymm" #C0 "\n\t"                                 \
  "vpmaddubsw %%ymm9, %%ymm10, %%ymm12\n\tvpmaddwd %%ymm15, %%ymm12, %%ymm12\n\t"  \
  "vpaddd %%ymm12, %%ymm" #C1 ", %%ymm" #C1 "\n\t"

__attribute__((noinline)) void Saturating(Tile out) {
  const uint8_t* a = &a_quads[0][0][0];
  const int8_t* w = &w_quads[0][0][0];
  long steps = kQuads;
  asm volatile(QC_ZERO QC_ONES QC_LOOP(QC_SAT_ROW, "add $16, %[a]\n\t")
               : [a] "+r"(a), [w] "+r"(w), [n] "+r"(steps)
               : [out] "r"(&out[0][0]), [one] "r"(kOnes)
               : QC_CLOBBER);
}

// int16: one row, int16 pair at OFF(%[a]).
#define QC_I16_ROW(OFF, C0, C1)                                                                   \
  "vpbroadcastd " #OFF "(%[a]), %%ymm10\n\t"                                                      \
  "vpmaddwd %%ymm8, %%ymm10, %%ymm11\n\tvpaddd %%ymm11, %%ymm" #C0 ", %%ymm" #C0 "\n\t"          \
  "vpmaddwd %%ymm9, %%ymm10, %%ymm12\n\tvpaddd %%ymm12, %%ymm" #C1 ", %%ymm" #C1 "\n\t"

__attribute__((noinline)) void Int16(Tile out) {
  const int16_t* a = &a_pairs[0][0][0];
  const int16_t* w = &w_pairs[0][0][0];
  long steps = kK / 2;
  asm volatile(QC_ZERO QC_LOOP(QC_I16_ROW, "add $16, %[a]\n\t")
               : [a] "+r"(a), [w] "+r"(w), [n] "+r"(steps)
               : [out] "r"(&out[0][0])
               : QC_CLOBBER);
}

// sign: |a-128| quad at OFF(%[a]), a-128 quad at OFF(%[s]); maddubs(|a'|, w * sign(a')).
#define QC_SIGN_ROW(OFF, C0, C1)                                                              \
  "vpbroadcastd " #OFF "(%[a]), %%ymm10\n\tvpbroadcastd " #OFF "(%[s]), %%ymm13\n\t"          \
  "vpsignb %%ymm13, %%ymm8, %%ymm11\n\tvpmaddubsw %%ymm11, %%ymm10, %%ymm11\n\t"              \
  "vpmaddwd %%ymm15, %%ymm11, %%ymm11\n\tvpaddd %%ymm11, %%ymm" #C0 ", %%ymm" #C0 "\n\t"      \
  "vpsignb %%ymm13, %%ymm9, %%ymm12\n\tvpmaddubsw %%ymm12, %%ymm10, %%ymm12\n\t"              \
  "vpmaddwd %%ymm15, %%ymm12, %%ymm12\n\tvpaddd %%ymm12, %%ymm" #C1 ", %%ymm" #C1 "\n\t"

__attribute__((noinline)) void Sign(Tile out) {
  const uint8_t* a = &a_abs[0][0][0];
  const int8_t* s = &a_sgn[0][0][0];
  const int8_t* w = &w_quads[0][0][0];
  long steps = kQuads;
  asm volatile(QC_ZERO QC_ONES QC_LOOP(QC_SIGN_ROW, "add $16, %[a]\n\tadd $16, %[s]\n\t")
               : [a] "+r"(a), [s] "+r"(s), [w] "+r"(w), [n] "+r"(steps)
               : [out] "r"(&out[0][0]), [one] "r"(kOnes)
               : QC_CLOBBER);
  // sum (a - 128) w + 128 sum w
  for (int m = 0; m < 4; ++m)
    for (int n = 0; n < 16; ++n) out[m][n] += 128 * col_sum[n];
}

void Prepare(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> du(0, 255), dw(-127, 127);
  for (auto& row : a_u8)
    for (auto& v : row) v = static_cast<uint8_t>(du(rng));
  for (auto& row : w_s8)
    for (auto& v : row) v = static_cast<int8_t>(dw(rng));
  std::memset(col_sum, 0, sizeof col_sum);
  for (int k = 0; k < kK; ++k)
    for (int n = 0; n < 16; ++n) col_sum[n] += w_s8[k][n];
  for (int m = 0; m < 4; ++m)
    for (int n = 0; n < 16; ++n) {
      int32_t s = 0;
      for (int k = 0; k < kK; ++k) s += a_u8[m][k] * w_s8[k][n];
      exact[m][n] = s;
    }
  for (int q = 0; q < kQuads; ++q)
    for (int i = 0; i < 4; ++i) {
      const int k = q * 4 + i;
      for (int m = 0; m < 4; ++m) {
        const uint8_t a = a_u8[m][k];
        a_quads[q][m][i] = a;
        a_abs[q][m][i] = static_cast<uint8_t>(a >= 128 ? a - 128 : 128 - a);
        a_sgn[q][m][i] = static_cast<int8_t>(a - 128);
        a_pairs[k / 2][m][k % 2] = a;
      }
      for (int n = 0; n < 16; ++n) {
        w_quads[q][n][i] = w_s8[k][n];
        w_pairs[k / 2][n][k % 2] = w_s8[k][n];
      }
    }
}

int Wrong(void (*kernel)(Tile)) {
  Tile out;
  kernel(out);
  int wrong = 0;
  for (int m = 0; m < 4; ++m)
    for (int n = 0; n < 16; ++n) wrong += out[m][n] != exact[m][n];
  return wrong;
}

double GopPerS(void (*kernel)(Tile), double seconds) {
  Tile out;
  double best = 0;
  for (int trial = 0; trial < 5; ++trial) {
    long calls = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double dt = 0;
    do {
      for (int i = 0; i < 1000; ++i) kernel(out);
      calls += 1000;
      dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (dt < seconds / 5);
    const double g = 2.0 * 4 * 16 * kK * calls / dt / 1e9;
    if (g > best) best = g;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  Prepare(1);
  struct {
    const char* name;
    const char* ops;
    void (*kernel)(Tile);
  } variants[] = {
      {"saturating", "maddubs+maddwd+add (onnxruntime, fbgemm)", Saturating},
      {"int16", "maddwd+add on int16 (qdsl exact)", Int16},
      {"sign", "sign+maddubs+maddwd+add (exact, |w|<=127)", Sign},
  };
  double base = 0;
  std::printf("%-11s %-44s %7s %8s %s\n", "variant", "ops per 32 MACs", "GOP/s", "vs sat.", "wrong outputs of 64");
  for (const auto& v : variants) {
    const double g = GopPerS(v.kernel, seconds);
    if (base == 0) base = g;
    std::printf("%-11s %-44s %7.1f %7.2fx %d\n", v.name, v.ops, g, g / base, Wrong(v.kernel));
  }
  return 0;
}
