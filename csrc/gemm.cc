// GEMM front doors: validate once, pick the path, pack activations, block and thread.
//
// Blocking (optimized paths): each task takes a block of 96 activation rows, converts
// them to int16 (A - a_zp, K padded to weights.kp with zeros) in a thread-local buffer,
// and for each K block of kKcPairs k-pairs walks its weight panels and, per panel, all
// its 6-row strips: one panel block (<= 16 KiB) stays in L1 while the row block (<= 96 KiB)
// stays in L2.  Bias and the output stage run on the task's block right after its last
// K block, while it is still in cache.
#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "qdsl/gemm.h"
#include "ref/ref.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

constexpr int64_t kKcPairs = 256;
constexpr int64_t kRowBlock = 16 * kMaxRows;  // 96 rows of int16 activations per task
constexpr int64_t kPrefetchWeightBytes = 512 * 1024;  // int16 panels past this: prefetch (see below)

Status ValidateOutput(const GemmOutput& out, int64_t m, int64_t n) {
  QDSL_CHECK_ARG(out.data != nullptr || m == 0, "null output pointer");
  QDSL_CHECK_ARG(out.ld >= n, "output row stride %lld < n=%lld", (long long)out.ld, (long long)n);
  if (out.stage == nullptr) {
    QDSL_CHECK_ARG(out.dtype == DType::kInt32, "an output without an output stage must be int32");
    return Status::Ok();
  }
  const OutputStage& s = *out.stage;
  QDSL_CHECK_ARG(out.dtype == DType::kInt8 || out.dtype == DType::kUInt8 || out.dtype == DType::kInt32,
                 "an output stage must write int8/uint8/int32");
  if (out.dtype == DType::kInt32) {  // a rescaled int32 output (e.g. a wide residual)
    QDSL_CHECK_ARG(s.qmin <= s.qmax, "clamp [%d, %d] is empty", s.qmin, s.qmax);
    return ValidateRescale(s.rescale, n);
  }
  const int32_t lo = out.dtype == DType::kInt8 ? -128 : 0, hi = out.dtype == DType::kInt8 ? 127 : 255;
  QDSL_CHECK_ARG(s.qmin >= lo && s.qmax <= hi && s.qmin <= s.qmax, "clamp [%d, %d] outside the output dtype range",
                 s.qmin, s.qmax);
  QDSL_CHECK_ARG(s.zero_point >= -(1 << 16) && s.zero_point <= (1 << 16), "output zero point %d out of range",
                 s.zero_point);
  return ValidateRescale(s.rescale, n);
}

}  // namespace

Status ValidateRescale(const Rescale& r, int64_t channels) {
  QDSL_CHECK_ARG(r.multiplier != nullptr && r.shift != nullptr, "rescale without multiplier/shift arrays");
  QDSL_CHECK_ARG(r.channels == 1 || r.channels == channels, "rescale has %lld channels, tensor has %lld",
                 (long long)r.channels, (long long)channels);
  QDSL_CHECK_ARG(r.kind == RescaleKind::kFixed || r.kind == RescaleKind::kPot || r.kind == RescaleKind::kFixedSingle,
                 "unknown rescale kind %d", static_cast<int>(r.kind));
  const int rnd = static_cast<int>(r.rounding);
  QDSL_CHECK_ARG(rnd >= 0 && rnd <= 3, "unknown rounding code %d", rnd);
  QDSL_CHECK_ARG(r.kind != RescaleKind::kFixed || rnd == 0, "a FIXED rescale must use rounding 0 (half away)");
  for (int64_t c = 0; c < r.channels; ++c) {
    if (r.kind != RescaleKind::kPot) {
      QDSL_CHECK_ARG(r.multiplier[c] >= 0, "FIXED multiplier %d is negative", r.multiplier[c]);
      QDSL_CHECK_ARG(r.shift[c] >= -31 && r.shift[c] <= 31, "FIXED shift %d outside [-31, 31]", r.shift[c]);
    } else {
      QDSL_CHECK_ARG(r.multiplier[c] == 1, "POT multiplier must be 1, got %d", r.multiplier[c]);
      QDSL_CHECK_ARG(r.shift[c] >= -31 && r.shift[c] <= 62, "POT shift %d outside [-31, 62]", r.shift[c]);
    }
  }
  return Status::Ok();
}

namespace {

// Adds bias, then requantizes (or copies) a block of accumulators: acc[i][c] (row stride
// ldacc) is output element (m0 + i, n0 + c), for i < rows and c < cols.
void Finish(int32_t* acc, int64_t ldacc, int64_t m0, int64_t rows, int64_t n0, int64_t cols, const int32_t* bias,
            const GemmOutput& out, uint32_t path) {
  if (rows <= 0 || cols <= 0) return;
  if (bias) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        acc[r * ldacc + c] =
            static_cast<int32_t>(static_cast<uint32_t>(acc[r * ldacc + c]) + static_cast<uint32_t>(bias[n0 + c]));
  }
  if (out.stage && out.dtype == DType::kInt32) {
    int32_t* dst = static_cast<int32_t*>(out.data) + m0 * out.ld + n0;
    SelectStageI32RowsKernel(path)(acc, rows, cols, ldacc, *out.stage, n0, dst, out.ld);
  } else if (out.stage) {
    uint8_t* dst = static_cast<uint8_t*>(out.data) + m0 * out.ld + n0;
    SelectRequantKernel(path)(acc, rows, cols, ldacc, *out.stage, n0, dst, out.ld, out.dtype == DType::kInt8);
  } else {
    int32_t* dst = static_cast<int32_t*>(out.data) + m0 * out.ld + n0;
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * out.ld, acc + r * ldacc, static_cast<size_t>(cols) * 4);
  }
}

// Splits [0, total) into `parts` nearly equal ranges aligned to `align`.
void Split(int64_t total, int parts, int part, int64_t align, int64_t* b, int64_t* e) {
  const int64_t units = (total + align - 1) / align;
  const int64_t lo = units * part / parts, hi = units * (part + 1) / parts;
  *b = std::min(total, lo * align);
  *e = std::min(total, hi * align);
}

// Rows [m0, m0 + rows) of `a` as u8 codes (s8 shifted by +128) into dst (row stride ld,
// which the caller zeroed past K).  Locals only: a byte store may alias anything, so a
// loop bound read through a reference would be reloaded per byte and never vectorized.
void CopyRowsU8(const ActView& a, int64_t m0, int64_t rows, uint8_t* dst, int64_t ld) {
  const uint8_t flip = a.dtype == DType::kInt8 ? 0x80 : 0;
  const int64_t k = a.cols, lda = a.ld;
  const uint8_t* src = static_cast<const uint8_t*>(a.data) + m0 * lda;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * lda;
    uint8_t* d = dst + r * ld;
    if (flip) {
      for (int64_t i = 0; i < k; ++i) d[i] = static_cast<uint8_t>(s[i] ^ 0x80);
    } else {
      std::memcpy(d, s, static_cast<size_t>(k));
    }
  }
}

// The largest activation code of `a` as the u8 kernels see it (int8: value + 128).
int32_t MaxCode(const ActView& a) {
  const uint8_t flip = a.dtype == DType::kInt8 ? 0x80 : 0;
  uint8_t hi = 0;
  for (int64_t r = 0; r < a.rows; ++r) {
    const uint8_t* s = static_cast<const uint8_t*>(a.data) + r * a.ld;
    for (int64_t i = 0; i < a.cols; ++i) hi = std::max<uint8_t>(hi, static_cast<uint8_t>(s[i] ^ flip));
  }
  return hi;
}

// Rows of the strip starting at row r of `total`, strips of at most kMaxRows balanced
// (32 rows: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2: a 2-row strip loads the panel for few
// multiplies), as conv::StripRows.
int64_t BalancedRows(int64_t total, int64_t r) {
  const int64_t strips = (total + kMaxRows - 1) / kMaxRows, base = total / strips, extra = total % strips;
  const int64_t big = extra * (base + 1);  // the first `extra` strips have base + 1 rows
  return r < big ? base + 1 : base;
}

// Tasks for `threads` threads: enough to balance (kClaimsPerThread each, so a thread that
// another process preempts holds little of the op), none when one thread runs them all
// (each task packs its own rows, so extra tasks would repeat that work).
int64_t WantTasks(int threads) { return threads > 1 ? int64_t{kClaimsPerThread} * threads : 1; }

// AMX driver (int8-range weights, m >= kAmxMinRows).  Tasks are (row block, panel group)
// pairs as in the VNNI driver.  A task writes its rows as u8 codes into an aligned buffer
// whose rows are padded with zeros to a multiple of 16 and K to a multiple of 64 (so the
// tile reads past K multiply zeros, whatever the weight panels hold there), then runs the
// tile kernel over all of K: panel pairs outer, so a pair's panels (32 bytes per K) stay
// in L1/L2 while the row tiles stream through, and each C tile is initialised once (bias
// and zero-point offset) and stored once.  Splitting K into blocks with C reloaded per
// block measured slower (C traffic) on every benchmark shape.
constexpr int64_t kAmxMinRows = 8;
constexpr int64_t kAmxRowBlock = 128;
constexpr int64_t kAmxRowBlockSubByte = 512;  // int4/int2: fewer row blocks, fewer widenings

void GemmAmxDriver(const ActView& a, const PackedWeights& w, const int32_t* bias, const GemmOutput& out,
                   uint32_t chosen, AmxKernel amx) {
  const int64_t m = a.rows, n = w.n;
  const int64_t kquads = w.kp / 4, kblocks = (w.kp + kAmxKBlock - 1) / kAmxKBlock, kp64 = kblocks * kAmxKBlock;
  const int sub_bits = w.format == PanelFormat::kI4 ? 4 : (w.format == PanelFormat::kI2 ? 2 : 0);
  const int threads = ThreadsFor(m * n * w.k);
  // Threads split the rows first: a task packs its own rows and its tiles read them from
  // its own core's L2, while the weights are only ever read, so both cores keep copies.
  // (Splitting a row block by panels made the other core pull the packed rows over and
  // the owner re-own them on the next call: 2 threads ran (256,1152,128) at 0.5x of one.)
  // Panel groups split the weights only when there are fewer 16-row tiles than threads,
  // and always for int4/int2 weights, which each task widens: split by rows, every thread
  // would widen all of them (each task packs its own copy of the rows instead).
  int64_t row_block = sub_bits ? kAmxRowBlockSubByte : kAmxRowBlock;
  if (threads > 1 && !sub_bits)
    row_block = std::max<int64_t>(16, std::min(row_block, ((m + threads - 1) / threads + 15) / 16 * 16));
  const int64_t mblocks = (m + row_block - 1) / row_block;
  const int64_t pairs = (w.panels + 1) / 2;
  const int64_t groups = mblocks >= threads ? 1 : std::min<int64_t>(pairs, (threads + mblocks - 1) / mblocks);
  const int tasks = static_cast<int>(mblocks * groups);
  const uint32_t zu = static_cast<uint32_t>(a.zero_point + (a.dtype == DType::kInt8 ? 128 : 0));
  // Packs rows [m0, m0 + rows) (padded to whole tiles) into dst.
  auto pack_rows = [&](int64_t m0, int64_t rows, uint8_t* dst) {
    const int64_t padded = (rows + 15) / 16 * 16;
    CopyRowsU8(a, m0, rows, dst, kp64);
    for (int64_t r = 0; r < rows; ++r)  // zeros past K and in the padding rows
      std::memset(dst + r * kp64 + w.k, 0, static_cast<size_t>(kp64 - w.k));
    std::memset(dst + rows * kp64, 0, static_cast<size_t>((padded - rows) * kp64));
  };
  ParallelFor(tasks, [&](int t) {
    const int64_t mb = t / groups, pg = t % groups;
    const int64_t m0 = mb * row_block, rows_total = std::min<int64_t>(row_block, m - m0);
    const int64_t mtiles = (rows_total + 15) / 16;
    int64_t p0 = 0, p1 = 0;
    Split(pairs, static_cast<int>(groups), static_cast<int>(pg), 1, &p0, &p1);
    p0 *= 2;
    p1 = std::min(w.panels, p1 * 2);
    if (p1 <= p0) return;
    thread_local AlignedVector<uint8_t> a8, wide;
    thread_local AlignedVector<int32_t> acc, cinit;
    const int64_t n0 = p0 * kPanelCols, n1 = std::min(n, p1 * kPanelCols);
    const int64_t ldacc = (p1 - p0) * kPanelCols;
    // C starts at bias - z_u * colsum (mod 2^32): sum (a_u - z_u) w' = sum a_u w' - z_u colsum
    cinit.resize(static_cast<size_t>(ldacc));
    for (int64_t c = 0; c < ldacc; ++c) {
      const int64_t col = n0 + c;
      const uint32_t b = (bias != nullptr && col < n) ? static_cast<uint32_t>(bias[col]) : 0u;
      cinit[c] = static_cast<int32_t>(b - zu * static_cast<uint32_t>(w.colsum[col]));
    }
    // int32 output of whole tiles: the tiles are stored straight into it
    const bool direct = out.stage == nullptr && rows_total % 16 == 0 && n1 - n0 == ldacc &&
                        reinterpret_cast<uintptr_t>(out.data) % 64 == 0 && out.ld % 16 == 0;
    int32_t* c_base;
    int64_t ldc;
    if (direct) {
      c_base = static_cast<int32_t*>(out.data) + m0 * out.ld + n0;
      ldc = out.ld;
    } else {
      acc.resize(static_cast<size_t>(mtiles * 16 * ldacc));
      c_base = acc.data();
      ldc = ldacc;
    }
    a8.resize(static_cast<size_t>(mtiles * 16 * kp64));
    pack_rows(m0, rows_total, a8.data());
    const uint8_t* a_rows = a8.data();
    if (sub_bits) {
      // int4/int2: widen one panel pair (all of K, <= 2 x 16 KiB per 256 bytes of K) at a
      // time, then run every row tile over it while it is in L1/L2.
      const int64_t ldb = kblocks * 1024;
      wide.resize(static_cast<size_t>(2 * ldb));
      for (int64_t p = p0; p < p1; p += 2) {
        const int64_t np = std::min<int64_t>(2, p1 - p);
        for (int64_t j = 0; j < np; ++j) {
          uint8_t* dst = wide.data() + j * ldb;
          UnpackPanelToVnni(sub_bits, w.packed.data() + (p + j) * w.panel_bytes, kquads, dst, chosen);
          std::memset(dst + kquads * 64, 0, static_cast<size_t>(ldb - kquads * 64));
        }
        amx(false, a_rows, kp64, mtiles, wide.data(), ldb, np, kblocks, c_base + (p - p0) * kPanelCols, ldc,
            AmxInit::kCols, cinit.data() + (p - p0) * kPanelCols);
      }
    } else {  // past K the tiles read on into the next panel: A is zero there
      amx(false, a_rows, kp64, mtiles, w.vnni.data() + p0 * kquads * 64, kquads * 64, p1 - p0, kblocks, c_base,
          ldc, AmxInit::kCols, cinit.data());
    }
    if (!direct) Finish(acc.data(), ldacc, m0, rows_total, n0, n1 - n0, nullptr, out, chosen);
  }, /*work=*/m * n * w.k);
}


// The u8 x s8 vpdpbusd driver (int8-range weights where the path has an init kernel:
// SelectQuadInitKernel).  Tasks as in Gemm's loop below; per task:
//  - its rows as u8 codes (row stride kp, zeros past K);
//  - the columns in chunks whose int32 block (rows x chunk) stays in L2 (kChunkBytes), each
//    chunk over K blocks of at most kQuadKc k-quads (a panel block <= 16 KiB stays in L1
//    while the 6-row strips stream past it);
//  - the first K block starts every row from init = bias - z_u * colsum (mod 2^32: sum
//    (a_u - z_u) w' = sum a_u w' - z_u colsum, as the reference wraps), so no correction
//    pass runs after the sums;
//  - a plain int32 output is accumulated in place (whole panels; the last partial panel in
//    a small buffer), else the chunk's block goes through Finish while it is in L2.
// (Before: K blocks of 128 quads, an int32 block of all the task's columns, then a
// correction pass and a copy or stage pass over it.)
constexpr int64_t kQuadKc = 256;               // k-quads per K block: 16 KiB panel blocks
constexpr int64_t kChunkBytes = 256 * 1024;    // int32 block of a column chunk

void GemmQuadDriver(const ActView& a, const PackedWeights& w, const int32_t* bias, const GemmOutput& out,
                    uint32_t chosen, VnniInitKernel kernel) {
  const int64_t m = a.rows, n = w.n, kp = w.kp, kquads = kp / 4;
  const int64_t work = (m + 8) * n * w.k;
  const int threads = ThreadsFor(work);
  const int64_t mblocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t want = WantTasks(threads);
  const int64_t groups = mblocks >= want ? 1 : std::min<int64_t>(w.panels, (want + mblocks - 1) / mblocks);
  const int tasks = static_cast<int>(mblocks * groups);
  const uint32_t zu = static_cast<uint32_t>(a.zero_point + (a.dtype == DType::kInt8 ? 128 : 0));
  const int64_t kblocks = (kquads + kQuadKc - 1) / kQuadKc;
  const int64_t kc = (kquads + kblocks - 1) / kblocks;  // equal K blocks
  const int64_t panel_bytes = kquads * 64;
  const bool direct = out.stage == nullptr;  // plain int32 (the bias is in init)
  ParallelFor(tasks, [&](int t) {
    const int64_t mb = t / groups, pg = t % groups;
    const int64_t m0 = mb * kRowBlock, rows_total = std::min<int64_t>(kRowBlock, m - m0);
    int64_t p0 = 0, p1 = 0;
    Split(w.panels, static_cast<int>(groups), static_cast<int>(pg), 1, &p0, &p1);
    if (p1 <= p0) return;
    thread_local std::vector<uint8_t> a8;
    thread_local std::vector<int32_t> acc, init, tail;
    a8.resize(static_cast<size_t>(rows_total * kp + 8));
    CopyRowsU8(a, m0, rows_total, a8.data(), kp);
    if (kp > w.k)
      for (int64_t r = 0; r < rows_total; ++r) std::memset(a8.data() + r * kp + w.k, 0, static_cast<size_t>(kp - w.k));
    init.resize(static_cast<size_t>((p1 - p0) * kPanelCols));
    for (int64_t c = 0; c < (p1 - p0) * kPanelCols; ++c) {
      const int64_t col = p0 * kPanelCols + c;
      init[c] = col < n ? static_cast<int32_t>((bias ? static_cast<uint32_t>(bias[col]) : 0u) -
                                               zu * static_cast<uint32_t>(w.colsum[col]))
                        : 0;
    }
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (rows_total * kPanelCols * 4));
    const int64_t nstrips = (rows_total + kMaxRows - 1) / kMaxRows;
    for (int64_t c0 = p0; c0 < p1; c0 += chunk) {
      const int64_t c1 = std::min(p1, c0 + chunk);
      const int64_t n0 = c0 * kPanelCols, cols = std::min(n, c1 * kPanelCols) - n0;
      const int64_t ldacc = (c1 - c0) * kPanelCols;
      if (!direct) acc.resize(static_cast<size_t>(rows_total * ldacc));
      // the chunk's weights past L2: each panel block's strips request a slice of the next
      // block into L2 (the hardware prefetcher starts each new panel stream late); not for
      // a few rows, whose one strip would issue a whole panel block of requests at once
      // (M = 1 at 768 x 768: 7% slower with them, the panels being one sequential stream)
      const bool prefetch = (c1 - c0) * panel_bytes > kPrefetchWeightBytes && nstrips >= 4;
      for (int64_t q0 = 0; q0 < kquads; q0 += kc) {
        const int64_t len = std::min(kc, kquads - q0);
        for (int64_t p = c0; p < c1; ++p) {
          const uint8_t* panel = w.vnni.data() + (p * kquads + q0) * 64;
          const uint8_t* next = nullptr;
          int64_t next_bytes = 0;
          if (prefetch && p + 1 < c1) {
            next = panel + panel_bytes;
            next_bytes = len * 64;
          } else if (prefetch && q0 + kc < kquads) {
            next = w.vnni.data() + (c0 * kquads + q0 + kc) * 64;
            next_bytes = std::min(kc, kquads - q0 - kc) * 64;
          }
          const int64_t lines = next_bytes / 64, per_strip = (lines + nstrips - 1) / nstrips;
          int64_t line = 0;
          int32_t* c;
          int64_t ldc;
          const bool partial = direct && (p + 1) * kPanelCols > n;
          if (partial) {  // the last partial panel of a plain output
            tail.resize(static_cast<size_t>(rows_total * kPanelCols));
            c = tail.data();
            ldc = kPanelCols;
          } else if (direct) {
            c = static_cast<int32_t*>(out.data) + m0 * out.ld + p * kPanelCols;
            ldc = out.ld;
          } else {
            c = acc.data() + (p - c0) * kPanelCols;
            ldc = ldacc;
          }
          const int32_t* in = init.data() + (p - p0) * kPanelCols;
          for (int64_t r = 0, rows = 0; r < rows_total; r += rows) {
            rows = BalancedRows(rows_total, r);
            for (const int64_t end = std::min(lines, line + per_strip); line < end; ++line)
              __builtin_prefetch(next + line * 64, 0, 2);
            kernel(static_cast<int>(rows), a8.data() + r * kp + 4 * q0, kp, panel, len, c + r * ldc, ldc, q0 > 0, in);
          }
          if (partial && q0 + kc >= kquads) {
            const int64_t keep = n - p * kPanelCols;
            for (int64_t r = 0; r < rows_total; ++r)
              std::memcpy(static_cast<int32_t*>(out.data) + (m0 + r) * out.ld + p * kPanelCols, c + r * kPanelCols,
                          static_cast<size_t>(keep) * 4);
          }
        }
      }
      if (!direct) Finish(acc.data(), ldacc, m0, rows_total, n0, cols, nullptr, out, chosen);
    }
  }, work);
}

}  // namespace

Status Gemm(const ActView& a, const PackedWeights& w, const int32_t* bias, const GemmOutput& out, uint32_t path) {
  QDSL_CHECK_ARG(w.bits == 16, "weights are not packed int weights (bits=%d)", w.bits);
  QDSL_CHECK_ARG(a.dtype == DType::kInt8 || a.dtype == DType::kUInt8, "activations must be int8 or uint8");
  QDSL_CHECK_ARG(a.cols == w.k, "activation K=%lld but weights K=%lld", (long long)a.cols, (long long)w.k);
  QDSL_CHECK_ARG(a.rows >= 0 && a.ld >= a.cols && (a.data != nullptr || a.rows == 0), "bad activation view");
  const int32_t zlo = a.dtype == DType::kInt8 ? -128 : 0, zhi = a.dtype == DType::kInt8 ? 127 : 255;
  QDSL_CHECK_ARG(a.zero_point >= zlo && a.zero_point <= zhi, "activation zero point %d outside [%d, %d]",
                 a.zero_point, zlo, zhi);
  QDSL_CHECK_ARG(a.max_code >= 0 && a.max_code <= 255, "activation code bound %d outside [0, 255]", a.max_code);
  QDSL_RETURN_IF_ERROR(ValidateOutput(out, a.rows, w.n));
  uint32_t chosen = 0;
  QDSL_RETURN_IF_ERROR(ResolvePath(path, &chosen));
  const int64_t m = a.rows, n = w.n;
  if (m == 0) return Status::Ok();

  if (chosen == kPathRef) {
    const int64_t ldc = n;
    std::vector<int32_t> acc(static_cast<size_t>(m * ldc));
    ref::Gemm(a, w, nullptr, acc.data(), ldc);
    Finish(acc.data(), ldc, 0, m, 0, n, bias, out, kPathRef);
    return Status::Ok();
  }
  if (m >= kAmxMinRows && !w.colsum.empty()) {
    if (const AmxKernel amx = SelectAmxKernel(chosen)) {
      GemmAmxDriver(a, w, bias, out, chosen, amx);
      return Status::Ok();
    }
  }
  const IntMicroKernel kernel = SelectIntMicroKernel(w.format, chosen);
  // int8-range weights use the exact u8 x s8 VNNI kernel where the CPU has it
  const int sub_bits = w.format == PanelFormat::kI4 ? 4 : (w.format == PanelFormat::kI2 ? 2 : 0);
  // int4/int2 widening only pays off when several row strips reuse a widened block; GEMV-like
  // calls keep the in-register unpacking of the int16 kernel (half the bytes streamed).
  const bool widen_ok = sub_bits == 0 || m > kMaxRows;
  // The quad kernel: VNNI (the VNNI paths, or EVEX vpdpbusd on the AVX2 path where the CPU
  // has it: EvexVnniUsable) is exact for any u8 codes, so the activations need no bound.
  // (AVX2 without VNNI: the vpmaddubsw kernel when the weights' pair bound makes it exact)
  // Bounded activation codes (e.g. 7-bit, as torch.ao's reduce_range) allow more int16
  // pair sums; the bound is checked here (one pass over A) before a kernel relies on it.
  const bool quad_ok = !w.colsum.empty() && widen_ok;
  if (quad_ok && sub_bits == 0) {
    if (const VnniInitKernel init_kernel = SelectQuadInitKernel(chosen)) {
      GemmQuadDriver(a, w, bias, out, chosen, init_kernel);
      return Status::Ok();
    }
  }
  VnniMicroKernel vnni = quad_ok ? SelectQuadMicroKernel(true, 0, chosen) : nullptr;
  if (quad_ok && vnni == nullptr) {
    int steps = w.maddubs_steps;
    if (a.max_code < 255) {
      const int bounded = MaddubsStepsFor(w.maddubs_pair, a.max_code);
      if (bounded > steps) {
        const int32_t seen = MaxCode(a);
        QDSL_CHECK_ARG(seen <= a.max_code, "an activation code is %d, above the stated bound max_code=%d", seen,
                       a.max_code);
        steps = bounded;
      }
    }
    vnni = SelectQuadMicroKernel(true, steps, chosen);
  }
  const int64_t kpairs = w.kp / 2;
  const int64_t bytes_per_pair = w.panel_bytes / kpairs;
  // work: the MACs, and the weights streamed once, which bound GEMV-like shapes (MobileNetV2's
  // classifier, m = 1: 0.2 ms for 1.3M MACs, serial at x1 with the MACs alone)
  const int64_t work = (m + 8) * n * w.k;
  const int threads = ThreadsFor(work);
  // Tasks are (row block, panel group) pairs.  Row blocks of kRowBlock rows keep their
  // int16 activations (packed by the task itself) in L1/L2 across all panels; panel
  // groups only split the weights when there are too few row blocks to feed the threads
  // (GEMV-like shapes), so each thread then reads only its share of the weights.
  const int64_t mblocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t want = WantTasks(threads);
  const int64_t groups = mblocks >= want ? 1 : std::min<int64_t>(w.panels, (want + mblocks - 1) / mblocks);
  const int tasks = static_cast<int>(mblocks * groups);
  ParallelFor(tasks, [&](int t) {
    const int64_t mb = t / groups, pg = t % groups;
    const int64_t m0 = mb * kRowBlock, rows_total = std::min<int64_t>(kRowBlock, m - m0);
    int64_t p0 = 0, p1 = 0;
    Split(w.panels, static_cast<int>(groups), static_cast<int>(pg), 1, &p0, &p1);
    if (p1 <= p0) return;
    thread_local std::vector<int16_t> a16;
    thread_local std::vector<uint8_t> a8;
    thread_local std::vector<int32_t> acc;
    const int64_t ldacc = (p1 - p0) * kPanelCols;
    acc.resize(static_cast<size_t>(rows_total * ldacc));
    const int64_t n0 = p0 * kPanelCols, n1 = std::min(n, p1 * kPanelCols);
    if (vnni) {
      // u8 codes (s8 shifted by +128), K padded with zeros (the weights' padding is 0)
      a8.assign(static_cast<size_t>(rows_total * w.kp + 8), 0);
      CopyRowsU8(a, m0, rows_total, a8.data(), w.kp);
      const int64_t kquads = w.kp / 4;
      for (int64_t q0 = 0; q0 < kquads; q0 += kKcPairs / 2) {
        const int64_t len = std::min(kKcPairs / 2, kquads - q0);
        for (int64_t p = p0; p < p1; ++p) {
          const uint8_t* panel;
          if (sub_bits) {  // int4/int2: widen this panel block once for all row strips
            thread_local std::vector<uint8_t> wide;
            wide.resize(static_cast<size_t>(len * 64));
            UnpackPanelToVnni(sub_bits, w.packed.data() + p * w.panel_bytes + q0 * (w.panel_bytes / kquads), len,
                              wide.data(), chosen);
            panel = wide.data();
          } else {
            panel = w.vnni.data() + (p * kquads + q0) * 64;
          }
          for (int64_t r = 0, rows = 0; r < rows_total; r += rows) {
            rows = BalancedRows(rows_total, r);
            vnni(static_cast<int>(rows), a8.data() + r * w.kp + 4 * q0, w.kp, panel, len,
                 acc.data() + r * ldacc + (p - p0) * kPanelCols, ldacc, q0 > 0);
          }
        }
      }
      // sum (a_u - z_u) w' = sum a_u w' - z_u * colsum, mod 2^32 like the reference; the bias
      // joins that correction (one pass over the block, not two: Finish gets no bias)
      const uint32_t zu = static_cast<uint32_t>(a.zero_point + (a.dtype == DType::kInt8 ? 128 : 0));
      thread_local std::vector<uint32_t> corr;
      const int64_t cols = n1 - n0;
      corr.resize(static_cast<size_t>(cols));
      for (int64_t c = 0; c < cols; ++c)
        corr[c] = (bias ? static_cast<uint32_t>(bias[n0 + c]) : 0u) - zu * static_cast<uint32_t>(w.colsum[n0 + c]);
      const uint32_t* cv = corr.data();
      for (int64_t r = 0; r < rows_total; ++r) {
        uint32_t* row = reinterpret_cast<uint32_t*>(acc.data() + r * ldacc);
        for (int64_t c = 0; c < cols; ++c) row[c] += cv[c];
      }
      Finish(acc.data(), ldacc, m0, rows_total, n0, cols, nullptr, out, chosen);
      return;
    }
    a16.resize(static_cast<size_t>(rows_total * w.kp + 8));
    for (int64_t r = 0; r < rows_total; ++r) {  // int16 rows: A - a_zp, K padded with zeros
      int16_t* row = a16.data() + r * w.kp;
      if (a.dtype == DType::kUInt8) {
        const uint8_t* src = static_cast<const uint8_t*>(a.data) + (m0 + r) * a.ld;
        for (int64_t k = 0; k < w.k; ++k) row[k] = static_cast<int16_t>(src[k] - a.zero_point);
      } else {
        const int8_t* src = static_cast<const int8_t*>(a.data) + (m0 + r) * a.ld;
        for (int64_t k = 0; k < w.k; ++k) row[k] = static_cast<int16_t>(src[k] - a.zero_point);
      }
      for (int64_t k = w.k; k < w.kp; ++k) row[k] = 0;
    }
    // Plain int32 output of whole panels: the kernels accumulate straight into it (no
    // block buffer and no copy pass; a partial last panel would write past the row).
    const bool direct = out.stage == nullptr && bias == nullptr && n1 - n0 == ldacc;
    int32_t* c_base = direct ? static_cast<int32_t*>(out.data) + m0 * out.ld + n0 : acc.data();
    const int64_t ldc = direct ? out.ld : ldacc;
    // Weights larger than L2 stream from L3 once per row block, a panel block at a time, and
    // each panel block starts a new stream the hardware prefetcher picks up late: while the
    // strips run over one panel block, each strip first requests a slice of the next block
    // into L2 (not L1, where the current block and the strips' rows are).  onnxruntime u8u8
    // time / ours, CPU time, 1 thread, load 11-13, medians of 5 runs of 7-21 rounds (Zen 4):
    // (128,3072,768) 0.69-0.89 -> 0.85-1.00 in every run, (1024,1024,1024) 0.80-1.01 ->
    // 0.92-1.07 in every run; (128,768,768) mixed (within the +-0.1 noise).
    const bool prefetch = (p1 - p0) * w.panel_bytes > kPrefetchWeightBytes;
    const int64_t nstrips = (rows_total + kMaxRows - 1) / kMaxRows;
    for (int64_t j0 = 0; j0 < kpairs; j0 += kKcPairs) {
      const int64_t len = std::min(kKcPairs, kpairs - j0);
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* panel = w.packed.data() + p * w.panel_bytes + j0 * bytes_per_pair;
        const uint8_t* next = nullptr;  // the panel block after this one
        int64_t next_bytes = 0;
        if (prefetch && p + 1 < p1) {
          next = panel + w.panel_bytes;
          next_bytes = len * bytes_per_pair;
        } else if (prefetch && j0 + kKcPairs < kpairs) {
          next = w.packed.data() + p0 * w.panel_bytes + (j0 + kKcPairs) * bytes_per_pair;
          next_bytes = std::min(kKcPairs, kpairs - j0 - kKcPairs) * bytes_per_pair;
        }
        const int64_t lines = (next_bytes + 63) / 64, per_strip = (lines + nstrips - 1) / nstrips;
        int64_t line = 0;
        for (int64_t r = 0, rows = 0; r < rows_total; r += rows) {
          rows = BalancedRows(rows_total, r);
          for (const int64_t end = std::min(lines, line + per_strip); line < end; ++line)
            __builtin_prefetch(next + line * 64, 0, 2);
          kernel(static_cast<int>(rows), a16.data() + r * w.kp + 2 * j0, w.kp, panel, len,
                 c_base + r * ldc + (p - p0) * kPanelCols, ldc, j0 > 0);
        }
      }
    }
    if (!direct) Finish(acc.data(), ldacc, m0, rows_total, n0, n1 - n0, bias, out, chosen);
  }, work);
  return Status::Ok();
}

Status BinaryGemm(const uint64_t* a, int64_t m, int64_t lda, const PackedWeights& w, const int32_t* bias,
                  const GemmOutput& out, uint32_t path) {
  QDSL_CHECK_ARG(w.bits == 1, "weights are not packed binary weights");
  QDSL_CHECK_ARG(m >= 0 && lda >= w.kwords && (a != nullptr || m == 0), "bad binary activation view");
  QDSL_RETURN_IF_ERROR(ValidateOutput(out, m, w.n));
  uint32_t chosen = 0;
  QDSL_RETURN_IF_ERROR(ResolvePath(path, &chosen));
  if (m == 0) return Status::Ok();
  const int64_t n = w.n;
  if (chosen == kPathRef) {
    std::vector<int32_t> acc(static_cast<size_t>(m * n));
    ref::BinaryGemm(a, m, lda, w, nullptr, acc.data(), n);
    Finish(acc.data(), n, 0, m, 0, n, bias, out, kPathRef);
    return Status::Ok();
  }
  const BinaryMicroKernel kernel = SelectBinaryMicroKernel(chosen);
  const BinaryMicroKernel cols_kernel = w.bits_cols.empty() ? nullptr : SelectBinaryColsKernel(chosen);
  // AVX2: nibble-split rows (weights split at pack time, each task splits its activation
  // rows once), one vpshufb per 256 bits instead of and/shift/and + two; K <= 7936 bits
  // (31 steps: the byte counters are widened once, at the end)
  const BinaryMicroKernel split_kernel =
      (cols_kernel || w.bits_split.empty() || w.kwords > 4 * 31) ? nullptr : SelectBinarySplitKernel(chosen);
  const int threads = ThreadsFor(m * n * w.kwords * 32);
  // Several tasks per thread (claimed dynamically) so a thread slowed by the other
  // process on its core does not hold the join: N blocks of >= 64 columns, else M blocks.
  const int want = threads > 1 ? 4 * threads : 1;
  const bool split_n = n >= 64 * threads || m < 2 * threads;
  const int tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, split_n ? (n + 63) / 64 : m / 2)));
  ParallelFor(tasks, [&](int t) {
    int64_t n0 = 0, n1 = n, m0 = 0, m1 = m;
    if (split_n) {
      Split(n, tasks, t, 8, &n0, &n1);
    } else {
      Split(m, tasks, t, 2, &m0, &m1);
    }
    if (n1 <= n0 || m1 <= m0) return;
    // Each task owns its block's accumulators (no shared m x n buffer to allocate and
    // zero serially on every call), 64 rows at a time so they stay in L1/L2 until the
    // output stage has read them.
    thread_local std::vector<int32_t> acc;
    const int64_t ldc = n1 - n0;
    constexpr int64_t kRowsPerStep = 64;
    acc.resize(static_cast<size_t>(std::min(kRowsPerStep, m1 - m0) * ldc));
    for (int64_t r0 = m0; r0 < m1; r0 += kRowsPerStep) {
      const int64_t rows = std::min(kRowsPerStep, m1 - r0);
      if (cols_kernel) {  // transposed weights: column blocks of 256 keep the words in L1/L2
        for (int64_t c = n0; c < n1; c += 256) {
          const int64_t ce = std::min(n1, c + 256);
          cols_kernel(a + r0 * lda, rows, lda, w.bits_cols.data() + c, ce - c, w.ncols_pad, w.kwords,
                      acc.data() + (c - n0), ldc);
        }
      }
      const bool use_split = split_kernel != nullptr && rows >= 2;  // one row: the plain 1 x 4 blocks
      if (use_split) {
        thread_local std::vector<uint64_t> as;
        as.resize(static_cast<size_t>(rows * 2 * w.kwords));
        for (int64_t r = 0; r < rows; ++r) SplitNibbles(a + (r0 + r) * lda, w.kwords, as.data() + r * 2 * w.kwords);
        for (int64_t c = n0; c < n1; c += 64) {
          const int64_t ce = std::min(n1, c + 64);
          split_kernel(as.data(), rows, 2 * w.kwords, w.bits_split.data() + c * 2 * w.kwords, ce - c, 2 * w.kwords,
                       w.kwords, acc.data() + (c - n0), ldc);
        }
      }
      // Column blocks of 64 weight rows keep the weight block in L1 across row pairs.
      for (int64_t c = n0; c < n1 && !cols_kernel && !use_split; c += 64) {
        const int64_t ce = std::min(n1, c + 64);
        kernel(a + r0 * lda, rows, lda, w.bits_rows.data() + c * w.kwords, ce - c, w.kwords, w.kwords,
               acc.data() + (c - n0), ldc);
      }
      const uint32_t kk = static_cast<uint32_t>(w.k);
      for (int64_t i = 0; i < rows * ldc; ++i) acc[i] = static_cast<int32_t>(kk - 2u * static_cast<uint32_t>(acc[i]));
      Finish(acc.data(), ldc, r0, rows, n0, n1 - n0, bias, out, chosen);
    }
  }, /*work=*/m * n * w.kwords * 32);  // a popcount word is ~64 MACs in ~2 instructions
  return Status::Ok();
}

Status Requantize(const int32_t* acc, int64_t rows, int64_t channels, const OutputStage& stage, void* out,
                  DType out_dtype, uint32_t path) {
  QDSL_CHECK_ARG(rows >= 0 && channels > 0 && (acc != nullptr || rows == 0), "bad requantize input");
  GemmOutput o;
  o.data = out;
  o.dtype = out_dtype;
  o.ld = channels;
  o.stage = &stage;
  QDSL_RETURN_IF_ERROR(ValidateOutput(o, rows, channels));
  uint32_t chosen = 0;
  QDSL_RETURN_IF_ERROR(ResolvePath(path, &chosen));
  const RequantKernel kernel = chosen == kPathRef ? ref::Requant : SelectRequantKernel(chosen);
  kernel(acc, rows, channels, channels, stage, 0, out, channels, out_dtype == DType::kInt8);
  return Status::Ok();
}

}  // namespace qdsl
