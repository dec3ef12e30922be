// AMX-INT8 GEMM: 2 x 2 tiles of 16 x 16 int32 accumulators, 64 bytes of K per step.
//
// One TDPBUSD/TDPBSUD multiplies a 16 x 64 byte A tile by a 16 x 64 byte B tile (16
// k-quads x 16 columns x 4 bytes, the same quad layout as the VNNI panels) into a
// 16 x 16 int32 C tile: 16 K of products per instruction, exact like vpdpbusd (four
// 8 x 8 bit products summed into int32 with no intermediate saturation; the int32 sum
// wraps).  With 8 tile registers the largest block is 2 A + 2 B + 4 C tiles, so each
// k-step loads 4 KiB and issues 4 tile products (64 K MACs).
//
// Contract (the callers in csrc/gemm.cc and csrc/runtime/ops/conv_fast.cc and conv_amx.cc pad for it):
//   - A has 16 * mtiles readable rows of lda bytes; row r's k-block kb is the 64 bytes at
//     a + r * lda + 64 * kb (bytes past K may hold anything if B is zero there).
//   - B panel j's k-block kb is 1 KiB at b + j * ldb + 1024 * kb (bytes past K may hold
//     anything if A is zero there), for kb < kblocks.
//   - C is [16 * mtiles][16 * npanels] int32 with row stride ldc elements.  It starts as
//     its old value (accumulate), as cinit (kInitCols: cinit[16 * npanels], one value per
//     column, loaded with row stride 0; kInitRows: cinit[16 * mtiles][16], a tile per 16
//     rows, e.g. a per-row value repeated 16 times), or as zero.  Zero-point offsets and
//     biases ride in cinit, so no pass over C is needed after the tiles are stored.
// GemmAmxGather is the implicit-GEMM form used by convs (u8 activations x s8 weights): row
// tile i's A starts at a + aoff[i] and its k-block kb at + koff[kb], rows lda bytes apart,
// so the tiles read a padded NHWC image in place (no im2col buffer).
// The tile configuration (palette 1, eight 16 x 64 byte tiles) is loaded per call and
// released at the end, so no tile state leaks into other code on the thread.  Linux needs
// the process to ask for the AMX state once (arch_prctl ARCH_REQ_XCOMP_PERM, done by
// dispatch.cc before it enables kPathAmx).
#pragma GCC target("amx-tile,amx-int8,avx512f")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: C 0..3 (c[m][n] = tile 2m + n), A 4..5, B 6..7.
// A k-block kb of row tile 0 is at a0 + koff(kb), of row tile 1 at a1 + koff(kb), where
// koff(kb) = koff ? koff[kb] : 64 * kb.
template <int MT, int NT, bool kSigned>
void Block(const uint8_t* a0, const uint8_t* a1, int64_t lda, const int64_t* koff, const uint8_t* b, int64_t ldb,
           int64_t kblocks, int32_t* c, int64_t ldc, AmxInit init, const int32_t* ci) {
  const int64_t cs = ldc * 4;
  int32_t* c10 = c + 16 * ldc;
  if (init == AmxInit::kAccumulate) {
    _tile_loadd(0, c, cs);
    if (NT == 2) _tile_loadd(1, c + 16, cs);
    if (MT == 2) _tile_loadd(2, c10, cs);
    if (MT == 2 && NT == 2) _tile_loadd(3, c10 + 16, cs);
  } else if (init == AmxInit::kCols) {  // ci: this block's first column value
    _tile_loadd(0, ci, 0);
    if (NT == 2) _tile_loadd(1, ci + 16, 0);
    if (MT == 2) _tile_loadd(2, ci, 0);
    if (MT == 2 && NT == 2) _tile_loadd(3, ci + 16, 0);
  } else if (init == AmxInit::kRows) {  // ci: this block's first row tile
    _tile_loadd(0, ci, 64);
    if (NT == 2) _tile_loadd(1, ci, 64);
    if (MT == 2) _tile_loadd(2, ci + 256, 64);
    if (MT == 2 && NT == 2) _tile_loadd(3, ci + 256, 64);
  } else {
    _tile_zero(0);
    if (NT == 2) _tile_zero(1);
    if (MT == 2) _tile_zero(2);
    if (MT == 2 && NT == 2) _tile_zero(3);
  }
  const uint8_t* b1 = b + ldb;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const int64_t ko = koff != nullptr ? koff[kb] : 64 * kb;
    _tile_loadd(4, a0 + ko, lda);
    _tile_loadd(6, b + 1024 * kb, 64);
    if (NT == 2) _tile_loadd(7, b1 + 1024 * kb, 64);
    if (MT == 2) _tile_loadd(5, a1 + ko, lda);
    if (kSigned) {
      _tile_dpbsud(0, 4, 6);
      if (NT == 2) _tile_dpbsud(1, 4, 7);
      if (MT == 2) _tile_dpbsud(2, 5, 6);
      if (MT == 2 && NT == 2) _tile_dpbsud(3, 5, 7);
    } else {
      _tile_dpbusd(0, 4, 6);
      if (NT == 2) _tile_dpbusd(1, 4, 7);
      if (MT == 2) _tile_dpbusd(2, 5, 6);
      if (MT == 2 && NT == 2) _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, c, cs);
  if (NT == 2) _tile_stored(1, c + 16, cs);
  if (MT == 2) _tile_stored(2, c10, cs);
  if (MT == 2 && NT == 2) _tile_stored(3, c10 + 16, cs);
}

// Row tile i's A starts at a + (aoff ? aoff[i] : 16 * i * lda).
template <bool kSigned>
void Run(const uint8_t* a, int64_t lda, const int64_t* aoff, const int64_t* koff, int64_t mtiles, const uint8_t* b,
         int64_t ldb, int64_t npanels, int64_t kblocks, int32_t* c, int64_t ldc, AmxInit init, const int32_t* cinit) {
  TileConfig cfg = {};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  // Panel pairs outer: a pair's K block (<= 2 x 16 KiB for 512 bytes of K) stays in L1
  // while the row tiles stream through it.
  for (int64_t j = 0; j < npanels; j += 2) {
    const bool two = j + 1 < npanels;
    const uint8_t* bj = b + j * ldb;
    for (int64_t i = 0; i < mtiles; i += 2) {
      const uint8_t* ai = a + (aoff != nullptr ? aoff[i] : 16 * i * lda);
      const uint8_t* ai1 = i + 1 < mtiles ? a + (aoff != nullptr ? aoff[i + 1] : 16 * (i + 1) * lda) : nullptr;
      int32_t* cij = c + 16 * i * ldc + 16 * j;
      const int32_t* ci = init == AmxInit::kCols ? cinit + 16 * j : (init == AmxInit::kRows ? cinit + 256 * i : nullptr);
      if (i + 1 < mtiles) {
        if (two) Block<2, 2, kSigned>(ai, ai1, lda, koff, bj, ldb, kblocks, cij, ldc, init, ci);
        else Block<2, 1, kSigned>(ai, ai1, lda, koff, bj, ldb, kblocks, cij, ldc, init, ci);
      } else {
        if (two) Block<1, 2, kSigned>(ai, ai1, lda, koff, bj, ldb, kblocks, cij, ldc, init, ci);
        else Block<1, 1, kSigned>(ai, ai1, lda, koff, bj, ldb, kblocks, cij, ldc, init, ci);
      }
    }
  }
  _tile_release();
}

}  // namespace

void GemmAmx(bool a_signed, const uint8_t* a, int64_t lda, int64_t mtiles, const uint8_t* b, int64_t ldb,
             int64_t npanels, int64_t kblocks, int32_t* c, int64_t ldc, AmxInit init, const int32_t* cinit) {
  if (a_signed) {
    Run<true>(a, lda, nullptr, nullptr, mtiles, b, ldb, npanels, kblocks, c, ldc, init, cinit);
  } else {
    Run<false>(a, lda, nullptr, nullptr, mtiles, b, ldb, npanels, kblocks, c, ldc, init, cinit);
  }
}

void GemmAmxGather(const uint8_t* a, int64_t lda, const int64_t* aoff, const int64_t* koff, int64_t mtiles,
                   const uint8_t* b, int64_t ldb, int64_t npanels, int64_t kblocks, int32_t* c, int64_t ldc,
                   AmxInit init, const int32_t* cinit) {
  Run<false>(a, lda, aoff, koff, mtiles, b, ldb, npanels, kblocks, c, ldc, init, cinit);
}

}  // namespace x86
}  // namespace qdsl
