// C++ self-test (no gtest): every compiled path of the GEMM, binary GEMM and output
// stage equals the scalar reference, and the .qgraph loader rejects garbage without
// crashing.  Built and run under ASan/UBSan by run_sanitizers.sh.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "dispatch.h"
#include "qdsl/gemm.h"
#include "qdsl/graph.h"
#include "tests/expect.h"
#include "threads/thread_pool.h"
#include "tests/solo_policy_test.h"

namespace {

int failures = 0;

void TestGemm(std::mt19937& rng) {
  const int sizes[] = {1, 2, 5, 6, 7, 16, 17, 33, 64, 65};
  for (int m : sizes)
    for (int k : {1, 3, 4, 31, 64, 513})
      for (int n : {1, 15, 16, 17, 40})
        for (int bits : {8, 4, 2}) {
          (void)m;
          const int lo = -(1 << (bits - 1)), hi = (1 << (bits - 1)) - 1;
          std::vector<int16_t> w(static_cast<size_t>(n) * k);
          for (auto& v : w) v = static_cast<int16_t>(lo + static_cast<int>(rng() % (hi - lo + 1)));
          std::vector<uint8_t> a(static_cast<size_t>(m) * k);
          for (auto& v : a) v = static_cast<uint8_t>(rng());
          qdsl::PackedWeights pw;
          EXPECT(qdsl::PackWeights(w.data(), n, k, k, &pw).ok(), "pack");
          qdsl::ActView av;
          av.data = a.data();
          av.rows = m;
          av.cols = k;
          av.ld = k;
          av.zero_point = 200;
          std::vector<int32_t> want(static_cast<size_t>(m) * n), got(want.size());
          qdsl::GemmOutput o;
          o.ld = n;
          o.data = want.data();
          EXPECT(qdsl::Gemm(av, pw, nullptr, o, qdsl::kPathRef).ok(), "ref gemm");
          for (uint32_t path : {uint32_t{qdsl::kPathPortable}, uint32_t{qdsl::kPathAvx2}, uint32_t{qdsl::kPathAvxVnni},
                                 uint32_t{qdsl::kPathAvx512}, uint32_t{qdsl::kPathAmx}}) {
            if (!(qdsl::CpuPaths() & path)) continue;
            o.data = got.data();
            EXPECT(qdsl::Gemm(av, pw, nullptr, o, path).ok(), "gemm path %u", path);
            EXPECT(got == want, "gemm path %u m=%d k=%d n=%d bits=%d differs from ref", path, m, k, n, bits);
          }
        }
}

void TestBinary(std::mt19937& rng) {
  for (int m : {1, 2, 3, 9})
    for (int k : {1, 64, 65, 300, 4000})
      for (int n : {1, 3, 4, 5, 70}) {
        std::vector<int8_t> a(static_cast<size_t>(m) * k), w(static_cast<size_t>(n) * k);
        for (auto& v : a) v = (rng() & 1) ? 1 : -1;
        for (auto& v : w) v = (rng() & 1) ? 1 : -1;
        qdsl::PackedWeights pw;
        EXPECT(qdsl::PackBinaryWeights(w.data(), n, k, k, &pw).ok(), "pack binary");
        const int64_t kw = (k + 63) / 64;
        std::vector<uint64_t> bits(static_cast<size_t>(m * kw + 4));
        EXPECT(qdsl::BitpackSigns(a.data(), m, k, k, bits.data(), kw).ok(), "bitpack");
        std::vector<int32_t> want(static_cast<size_t>(m) * n), got(want.size());
        qdsl::GemmOutput o;
        o.ld = n;
        o.data = want.data();
        EXPECT(qdsl::BinaryGemm(bits.data(), m, kw, pw, nullptr, o, qdsl::kPathRef).ok(), "ref binary");
        for (int i = 0; i < m; ++i)
          for (int j = 0; j < n; ++j) {
            int dot = 0;
            for (int c = 0; c < k; ++c) dot += a[i * k + c] * w[j * k + c];
            EXPECT(want[i * n + j] == dot, "binary ref dot");
          }
        for (uint32_t path : {uint32_t{qdsl::kPathPortable}, uint32_t{qdsl::kPathAvx2}, uint32_t{qdsl::kPathAvxVnni},
                                 uint32_t{qdsl::kPathAvx512}, uint32_t{qdsl::kPathAmx}}) {
          if (!(qdsl::CpuPaths() & path)) continue;
          o.data = got.data();
          EXPECT(qdsl::BinaryGemm(bits.data(), m, kw, pw, nullptr, o, path).ok(), "binary path");
          EXPECT(got == want, "binary path %u m=%d k=%d n=%d differs", path, m, k, n);
        }
      }
}

void TestRequant(std::mt19937& rng) {
  for (int kind = 0; kind < 3; ++kind)
    for (int rounding = 0; rounding < (kind ? 4 : 1); ++rounding) {
      const int ch = 11, rows = 5;
      std::vector<int32_t> mult(ch), shift(ch), acc(rows * ch);
      for (int c = 0; c < ch; ++c) {
        mult[c] = kind == 1 ? 1 : static_cast<int32_t>((1u << 30) + rng() % (1u << 30));
        shift[c] = kind == 1 ? static_cast<int32_t>(rng() % 20) : static_cast<int32_t>(rng() % 63) - 31;
      }
      for (auto& v : acc) v = static_cast<int32_t>(rng());
      acc[0] = INT32_MIN;
      acc[1] = INT32_MAX;
      qdsl::OutputStage st;
      st.rescale = {static_cast<qdsl::RescaleKind>(kind), mult.data(), shift.data(), ch,
                    static_cast<qdsl::Rounding>(rounding)};
      st.zero_point = 3;
      std::vector<int8_t> want(acc.size()), got(acc.size());
      EXPECT(qdsl::Requantize(acc.data(), rows, ch, st, want.data(), qdsl::DType::kInt8, qdsl::kPathRef).ok(), "req");
      for (uint32_t path : {uint32_t{qdsl::kPathPortable}, uint32_t{qdsl::kPathAvx2}, uint32_t{qdsl::kPathAvxVnni},
                                 uint32_t{qdsl::kPathAvx512}}) {
        if (!(qdsl::CpuPaths() & path)) continue;
        EXPECT(qdsl::Requantize(acc.data(), rows, ch, st, got.data(), qdsl::DType::kInt8, path).ok(), "req path");
        EXPECT(got == want, "requant path %u kind %d rounding %d differs", path, kind, rounding);
      }
    }
}

// Corner accumulators (0, +-1, INT32_MIN/MAX, +-2^k +- {0, 1}) x extreme multipliers and
// shifts, every kind and rounding, int8/uint8 outputs over column counts 1..40 (vector
// blocks plus masked / scalar tails), and the int32 stages, on every path vs ApplyStage.
void TestRequantCorners(std::mt19937& rng) {
  std::vector<int32_t> accs = {0, 1, -1, INT32_MAX, INT32_MIN, INT32_MIN + 1, INT32_MAX - 1};
  for (int k = 1; k <= 30; ++k)
    for (int d = -1; d <= 1; ++d) {
      accs.push_back(static_cast<int32_t>((int64_t{1} << k) + d));
      accs.push_back(static_cast<int32_t>(-(int64_t{1} << k) + d));
    }
  const int32_t mults[] = {0, 1, 3, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, INT32_MAX - 1, INT32_MAX};
  const int32_t fixed_shifts[] = {-31, -30, -1, 0, 1, 2, 15, 30, 31};
  const int32_t pot_shifts[] = {-31, -1, 0, 1, 2, 30, 31, 32, 62};
  const uint32_t paths[] = {qdsl::kPathPortable, qdsl::kPathAvx2, qdsl::kPathAvxVnni, qdsl::kPathAvx512,
                            qdsl::kPathAmx};
  for (int kind = 0; kind < 3; ++kind)
    for (int rounding = 0; rounding < (kind ? 4 : 1); ++rounding)
      for (int32_t m : mults)
        for (int32_t s : kind == 1 ? pot_shifts : fixed_shifts) {
          if (kind == 1 && m != 1) continue;
          int32_t mult = m, shift = s;
          qdsl::OutputStage st;
          st.rescale = {static_cast<qdsl::RescaleKind>(kind), &mult, &shift, 1, static_cast<qdsl::Rounding>(rounding)};
          const int cols = 1 + static_cast<int>(rng() % 40);
          const int rows = static_cast<int>((accs.size() + cols - 1) / cols);
          std::vector<int32_t> acc(static_cast<size_t>(rows) * cols);
          const size_t rot = rng() % accs.size();
          for (size_t i = 0; i < acc.size(); ++i) acc[i] = accs[(i + rot) % accs.size()];
          for (bool sgn : {true, false}) {
            st.zero_point = sgn ? -3 : 7;
            st.qmin = sgn ? -128 : 0;
            st.qmax = sgn ? 127 : 255;
            const qdsl::DType dt = sgn ? qdsl::DType::kInt8 : qdsl::DType::kUInt8;
            std::vector<uint8_t> want(acc.size()), got(acc.size());
            for (size_t i = 0; i < acc.size(); ++i) want[i] = static_cast<uint8_t>(qdsl::ApplyStage(acc[i], st, 0));
            for (uint32_t path : paths) {
              if (!(qdsl::CpuPaths() & path)) continue;
              std::fill(got.begin(), got.end(), uint8_t{0xAB});
              EXPECT(qdsl::Requantize(acc.data(), rows, cols, st, got.data(), dt, path).ok(), "req corners");
              EXPECT(got == want, "requant corners path %u kind %d rounding %d m %d s %d cols %d signed %d", path, kind,
                     rounding, m, s, cols, sgn);
            }
          }
          // int32 stages (zero point 0), full and narrowed clamps, n = cols past a sentinel
          for (int clamp = 0; clamp < 2; ++clamp) {
            st.zero_point = 0;
            st.qmin = clamp ? -1000 : INT32_MIN;
            st.qmax = clamp ? 123456 : INT32_MAX;
            const int64_t n = static_cast<int64_t>(acc.size());
            std::vector<int32_t> want(acc.size());
            for (size_t i = 0; i < acc.size(); ++i) want[i] = qdsl::ApplyStage(acc[i], st, 0);
            for (uint32_t path : paths) {
              if (!(qdsl::CpuPaths() & path)) continue;
              std::vector<int32_t> got(acc.size() + 1, 0x5A5A5A5A);
              qdsl::SelectStageI32Kernel(path)(acc.data(), n, st, got.data());
              EXPECT(std::equal(want.begin(), want.end(), got.begin()) && got[acc.size()] == 0x5A5A5A5A,
                     "i32 stage path %u kind %d rounding %d m %d s %d n %lld", path, kind, rounding, m, s, (long long)n);
              std::vector<int32_t> got2(acc.size(), 0x5A5A5A5A);
              qdsl::SelectStageI32RowsKernel(path)(acc.data(), rows, cols, cols, st, 0, got2.data(), cols);
              EXPECT(std::equal(want.begin(), want.end(), got2.begin()), "i32 rows path %u kind %d m %d s %d cols %d",
                     path, kind, m, s, cols);
            }
          }
        }
}

void TestLoaderGarbage(std::mt19937& rng) {
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> blob(static_cast<size_t>(rng() % 400));
    for (auto& b : blob) b = static_cast<uint8_t>(rng());
    if (blob.size() >= 8 && (trial & 1)) std::copy_n("QDSLGRPH", 8, blob.begin());
    std::unique_ptr<qdsl::Graph> g;
    EXPECT(!qdsl::LoadGraph(blob.data(), static_cast<int64_t>(blob.size()), &g).ok(), "garbage accepted");
  }
}

// RescaleOneWide (accumulators wider than 32 bits) equals RescaleOne on int32 values, and on
// wide values it rescales without saturating first; run under UBSan, it also checks that no
// shift or 128-bit product overflows for |x| up to 2^63.
void TestWideRescale() {
  if (!qdsl::kHasWideRescale) return;
  std::vector<int64_t> xs = {0, 1, -1, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN + 1};
  for (int k = 1; k <= 62; ++k)
    for (int d = -1; d <= 1; ++d) {
      xs.push_back((int64_t{1} << k) + d);
      xs.push_back(-(int64_t{1} << k) + d);
    }
  const int32_t mults[] = {0, 1, (1 << 30) - 1, 1 << 30, INT32_MAX};
  for (int kind = 0; kind < 3; ++kind)
    for (int rounding = 0; rounding < 4; ++rounding)
      for (int32_t m : mults)
        for (int32_t s = -31; s <= (kind == 1 ? 62 : 31); ++s) {
          const auto kd = static_cast<qdsl::RescaleKind>(kind);
          const auto rd = static_cast<qdsl::Rounding>(kind == 0 ? 0 : rounding);
          const int32_t mm = kind == 1 ? 1 : m;
          for (int64_t x : xs) {
            const int64_t wide = qdsl::RescaleOneWide(x, kd, mm, s, rd);
            EXPECT(wide >= INT32_MIN && wide <= INT32_MAX, "wide rescale out of int32: kind %d", kind);
            if (x >= INT32_MIN && x <= INT32_MAX)
              EXPECT(wide == qdsl::RescaleOne(x, kd, mm, s, rd), "wide != int32 rescale: kind %d m %d s %d x %lld",
                     kind, mm, s, static_cast<long long>(x));
          }
        }
  // 2^40 >> 24 = 2^16 exactly (the int32 form would saturate 2^40 to 2^31 - 1 first: 128)
  EXPECT(qdsl::RescaleOneWide(int64_t{1} << 40, qdsl::RescaleKind::kPot, 1, 24, qdsl::Rounding::kHalfAway) == 65536,
         "POT wide");
  // factor 2^30 * 2^-(31+10) = 2^-11: 2^40 -> 2^29, both FIXED forms
  for (int kind : {0, 2})
    EXPECT(qdsl::RescaleOneWide(int64_t{1} << 40, static_cast<qdsl::RescaleKind>(kind), 1 << 30, 10,
                                qdsl::Rounding::kHalfAway) == (1 << 29), "FIXED wide kind %d", kind);
}

// The pool under many tiny jobs: every task runs exactly once at 1-4 threads, with thread
// counts changing between jobs, nested ParallelFor, ParallelRanges, and two threads posting
// jobs at once (the second runs its tasks itself while the pool is busy).
void TestThreadPool(std::mt19937& rng) {
  auto job = [](int n, int64_t work) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    for (auto& h : hits) h.store(0);
    qdsl::ParallelFor(n, [&](int i) { hits[i].fetch_add(1); }, work);
    int bad = 0;
    for (auto& h : hits) bad += h.load() != 1;
    return bad;
  };
  for (int round = 0; round < 3000; ++round) {
    const int threads = 1 + static_cast<int>(rng() % 4);
    if (round % 50 == 0) qdsl::SetNumThreads(threads);
    const int n = 1 + static_cast<int>(rng() % 40);
    EXPECT(job(n, qdsl::kMinParallelWork) == 0, "ParallelFor(%d) at %d threads ran a task not exactly once", n,
           qdsl::NumThreads());
  }
  qdsl::SetNumThreads(3);
  std::atomic<int> inner{0};
  qdsl::ParallelFor(7, [&](int) {
    qdsl::ParallelFor(5, [&](int) { inner.fetch_add(1); }, qdsl::kMinParallelWork);
  }, qdsl::kMinParallelWork);
  EXPECT(inner.load() == 35, "nested ParallelFor ran %d of 35 tasks", inner.load());
  std::vector<int> covered(100003, 0);
  qdsl::ParallelRanges(static_cast<int64_t>(covered.size()), 1000, qdsl::kMinParallelWork,
                       [&](int64_t i0, int64_t i1) {
                         for (int64_t i = i0; i < i1; ++i) ++covered[i];
                       });
  EXPECT(std::count(covered.begin(), covered.end(), 1) == static_cast<long>(covered.size()),
         "ParallelRanges did not cover [0, n) exactly once");
  std::atomic<int> bad{0};
  auto poster = [&](unsigned seed) {
    std::mt19937 r(seed);
    for (int i = 0; i < 2000; ++i) bad.fetch_add(job(1 + static_cast<int>(r() % 20), qdsl::kMinParallelWork));
  };
  std::thread other(poster, 1u);
  poster(2u);
  other.join();
  EXPECT(bad.load() == 0, "%d tasks ran not exactly once with two threads posting jobs", bad.load());
  qdsl::SetNumThreads(0);
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  TestGemm(rng);
  TestBinary(rng);
  TestRequant(rng);
  TestRequantCorners(rng);
  TestWideRescale();
  TestLoaderGarbage(rng);
  TestThreadPool(rng);
  failures += qdsl_test::SoloPolicyFailures();
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
