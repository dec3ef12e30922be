// SoloPolicy checks (threads/thread_pool.h), header-only so that they run both in the C++
// self-test (test_main.cc) and alone (solo_policy_main.cc, which tests/runtime/
// test_solo_policy.py compiles and runs: the policy needs no other source).
#ifndef QDSL_TESTS_SOLO_POLICY_TEST_H_
#define QDSL_TESTS_SOLO_POLICY_TEST_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "tests/expect.h"
#include "threads/thread_pool.h"

namespace qdsl_test {

// SoloPolicy, with job times fed in (no clock): each shape runs once in parallel and once
// solo, then the faster mode, re-measuring the slower one at probes whose interval doubles
// (up to kMaxProbe) while they confirm the winner.  When the machine gets busy and parallel
// jobs slow past the measured solo time, the shape goes solo; when a probe finds parallel
// faster again, it goes back.  The blind spot of the old policy: a solo time measured
// directly under the same contention decides, not the caller's share of a parallel job.
// Shapes are independent.
inline int SoloPolicyFailures() {
  int failures = 0;
  using qdsl::SoloPolicy;
  auto policy = std::make_unique<SoloPolicy>();
  SoloPolicy& p = *policy;
  // runs `visits` jobs of `key` whose wall times are par_ns / solo_ns; returns how many ran solo
  auto visit = [&](uint64_t key, int visits, int64_t par_ns, int64_t solo_ns) {
    int solos = 0;
    for (int v = 0; v < visits; ++v) {
      const bool solo = p.Solo(key);
      solos += solo;
      p.Record(key, solo, solo ? solo_ns : par_ns);
    }
    return solos;
  };
  const uint64_t conv = SoloPolicy::Key(16, int64_t{1} << 30), pool = SoloPolicy::Key(64, int64_t{1} << 23);
  // a shape is forgotten (measured again: parallel first) once kWays other shapes of its set
  // were used after it, least recently used first
  {
    std::vector<uint64_t> same;  // other shapes of conv's set
    for (uint64_t k = conv + 1; static_cast<int>(same.size()) < SoloPolicy::kWays; ++k)
      if (SoloPolicy::SetOf(k) == SoloPolicy::SetOf(conv)) same.push_back(k);
    auto q = std::make_unique<SoloPolicy>();
    auto measure = [&](uint64_t k) {  // parallel 2, solo 1: k's next job runs solo
      q->Record(k, false, 2);
      q->Record(k, true, 1);
    };
    measure(conv);
    for (int i = 0; i + 1 < SoloPolicy::kWays; ++i) measure(same[i]);
    EXPECT(q->Solo(conv), "a shape was forgotten with its set not full");
    measure(same.back());  // evicts same[0], used least recently (conv was just looked up)
    EXPECT(q->Solo(conv) && !q->Solo(same[0]), "the least recently used shape was not the one forgotten");
    for (int i = 0; i < SoloPolicy::kWays; ++i) measure(same[i]);  // kWays others used after conv
    EXPECT(!q->Solo(conv), "a shape was remembered after kWays others of its set were used");
  }
  EXPECT(!p.Solo(conv), "a new shape did not run in parallel first");
  p.Record(conv, false, 600);
  EXPECT(p.Solo(conv), "a shape measured in parallel only did not run solo next");
  p.Record(conv, true, 1000);
  // quiet machine: parallel 600, solo 1000.  Probes at 8 + slot jitter, then 16, 32, ...
  int solos = visit(conv, 2000, 600, 1000);
  int bound = 0;
  for (int gap = SoloPolicy::kFirstProbe, seen = 0; seen < 2000 + 2 * SoloPolicy::kFirstProbe;
       gap = std::min(2 * gap, SoloPolicy::kMaxProbe))
    seen += gap, ++bound;
  // ... and the interval stops growing at kMaxProbe: a quiet stretch still probes solo
  EXPECT(solos >= 2000 / SoloPolicy::kMaxProbe - 2 && solos <= bound,
         "quiet: %d of 2000 jobs ran solo (probes: at least %d, at most %d)", solos,
         2000 / SoloPolicy::kMaxProbe - 2, bound);
  // busy core: parallel jobs now take 1500 (solo 1000 as measured): the running mean of the
  // parallel time passes 1000 within a few jobs, and the shape goes solo
  int switched = -1;
  for (int v = 0; v < 20 && switched < 0; ++v) {
    const bool solo = p.Solo(conv);
    if (solo) switched = v;
    p.Record(conv, solo, solo ? 1000 : 1500);
  }
  EXPECT(switched >= 0 && switched <= 4, "busy: went solo after %d jobs (want <= 4)", switched);
  // staying busy: nearly everything solo, parallel only at probes (first interval 8)
  solos = visit(conv, 200, 1500, 1000);
  EXPECT(solos >= 200 - 200 / SoloPolicy::kFirstProbe && solos < 200, "busy: %d of 200 jobs solo", solos);
  // the other shape has its own figures: parallel wins there
  visit(pool, 2, 100, 300);
  EXPECT(visit(pool, SoloPolicy::kFirstProbe - 1, 100, 300) == 0, "a shape took another shape's mode");
  // solo also slows under contention (2000): parallel at 1500 is faster again and wins by
  // the running means, with no probe needed
  switched = -1;
  for (int v = 0; v < 20 && switched < 0; ++v) {
    const bool solo = p.Solo(conv);
    if (!solo) switched = v;
    p.Record(conv, solo, solo ? 2000 : 1500);
  }
  EXPECT(switched >= 0 && switched <= 4, "solo got slower: back to parallel after %d jobs", switched);
  // quiet again while solo: a single probe that measures parallel faster brings it back
  EXPECT(visit(conv, 50, 3000, 1000) >= 40, "not solo after parallel measured 3x slower");
  int back = -1;
  for (int v = 0; v < SoloPolicy::kMaxProbe + 1 && back < 0; ++v) {
    const bool solo = p.Solo(conv);
    p.Record(conv, solo, solo ? 1000 : 600);
    if (!solo) back = v;
  }
  EXPECT(back >= 0, "quiet again: no parallel probe within kMaxProbe jobs");
  EXPECT(visit(conv, SoloPolicy::kFirstProbe - 1, 600, 1000) == 0,
         "a probe that measured parallel faster did not switch back");
  return failures;
}

}  // namespace qdsl_test

#endif  // QDSL_TESTS_SOLO_POLICY_TEST_H_
