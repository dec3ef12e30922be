// Cache-aware execution (Graph::segments): runs of early ops whose whole-batch tensors
// outgrow the cache run a slice of the batch at a time, so a slice's intermediate tensors
// are still in cache when the next op reads them.  At batch 8, MobileNetV2's 112 x 112
// layers move 3-10 MB per tensor: each op streams its input back from memory (or L3),
// while one image's tensors (0.2-1.2 MB) stay near the core.
//
// Exact by construction: only ops that compute each image from that image alone run in a
// segment (PerImage: no op that reads across the batch), every tensor they touch is batched
// (dims[0] = -1: image i's bytes are the i-th slice in NCHW and NHWC alike), and a conv's
// fused ADD and twins (ConvParams::fused_add, twins: ops the conv computes itself) are in
// its segment.  Each slice then computes the same bytes as the whole-batch run.
//
// The plan, once per batch size: an op is "large" when it is PerImage, the bytes it reads
// and writes for the whole batch exceed the budget (a core's L2 by default), and one image's
// activations outweigh its weights (a pass re-reads the weights: ResNet-18's layer3/4 convs,
// 0.6-2.4 MB of weights against 50-100 KB of activations per image, stay whole-batch); a maximal run
// of consecutive large ops (at least two) becomes a segment, with step = the images whose
// largest op footprint fits the budget (at least 1).  Tensors produced in the segment and
// read only there are `internal` (the slice uses the buffer's first images' room, the same
// memory every pass), the others it touches are `sliced` (viewed at the slice's images).
//
// QDSL_SEGMENT=0 turns it off (for A/B timing and debugging); QDSL_SEGMENT_KB=n sets the
// budget in KiB (tests set a small one to segment small graphs).  Both are read per run.
#include <algorithm>
#include <cstdlib>

#include "runtime/ops/conv.h"
#include "runtime/ops/op.h"

namespace qdsl {
namespace {

// A core's L2 on the machines we tune for (Zen 3: 512 KiB).
constexpr int64_t kDefaultBudgetBytes = int64_t{512} << 10;

// Ops whose output image i depends on input image i only (and that keep no state across
// calls).  Convs of every kind compute per output position from one image's window; ADD,
// CLAMP, QUANTIZE, REQUANTIZE are elementwise; the 2-D pools work per image and channel.
bool PerImageOpcode(int opcode) {
  switch (opcode) {
    case kQuantize:
    case kRequantize:
    case kConv2d:
    case kAdd:
    case kClamp:
    case kMaxpool2d:
    case kAvgpool2d:
      return true;
    default:
      return false;
  }
}

bool Batched(const GraphTensor& t) { return !t.is_constant && t.dims.size() >= 2 && t.dims[0] == -1; }

int64_t ElemBytes(int dtype) { return dtype == kF32 || dtype == kI32 ? 4 : 1; }

int64_t ImageBytes(const GraphTensor& t) { return Numel(ShapeFor(t, 1)) * ElemBytes(t.dtype); }

// The op may run on a slice of the batch: a per-image opcode whose activation tensors are
// all batched; -1 if not, else the bytes one image of them takes (what it reads and writes).
// *weights: the bytes of its constants (their values, as stored in the file's dtype or wider).
int64_t PerImageFootprint(const Graph& g, const GraphOp& op, int64_t* weights) {
  *weights = 0;
  if (!PerImageOpcode(op.opcode)) return -1;
  // dense convs with a window (ResNet's 3x3s, the 7x7 stem) are left whole-batch: their
  // batch-1 tiling ran 8-15% slower per image than the batch-8 GEMM (CPU-time profile of
  // ResNet-18 a7, batch 8), more than the cache saves; depthwise and 1x1 convs gain
  if (const ConvParams* p = AsConv(op); p != nullptr && !p->depthwise && p->kh * p->kw > 1) return -1;
  int64_t bytes = 0;
  for (const std::vector<uint32_t>* ts : {&op.inputs, &op.outputs})
    for (uint32_t t : *ts) {
      const GraphTensor& gt = g.tensors[t];
      if (gt.is_constant) {
        *weights += static_cast<int64_t>(gt.values.size()) * (gt.dtype == kI32 || gt.dtype == kF32 ? 4 : 1);
        continue;
      }
      if (!Batched(gt)) return -1;
      bytes += ImageBytes(gt);
    }
  return bytes;
}

// Per op: the conv that computes it (its fused ADD or a twin), else -1.
std::vector<int64_t> Owners(const Graph& g) {
  std::vector<int64_t> owner(g.ops.size(), -1);
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (const ConvParams* p = AsConv(g.ops[i])) {
      if (p->fused_add >= 0) owner[p->fused_add] = static_cast<int64_t>(i);
      for (int32_t j : p->twins) owner[j] = static_cast<int64_t>(i);
    }
  return owner;
}

// Tensors of ops [first, end) split into sliced and internal (see the file comment).
void ClassifyTensors(const Graph& g, GraphSegment* s) {
  const size_t nt = g.tensors.size();
  std::vector<char> touched(nt, 0), made_inside(nt, 0), read_outside(nt, 0);
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const GraphOp& op = g.ops[i];
    const bool inside = i >= s->first && i < s->end;
    for (uint32_t t : op.inputs) {
      if (inside) touched[t] = 1;
      else read_outside[t] = 1;
    }
    if (inside)
      for (uint32_t t : op.outputs) touched[t] = made_inside[t] = 1;
  }
  for (uint32_t t : g.outputs) read_outside[t] = 1;
  for (size_t t = 0; t < nt; ++t) {
    if (!touched[t] || g.tensors[t].is_constant) continue;
    (made_inside[t] && !read_outside[t] ? s->internal : s->sliced).push_back(static_cast<uint32_t>(t));
  }
}

}  // namespace

int64_t SegmentBudgetFromEnv() {
  const char* off = std::getenv("QDSL_SEGMENT");
  if (off != nullptr && off[0] == '0' && off[1] == '\0') return 0;
  const char* kb = std::getenv("QDSL_SEGMENT_KB");
  if (kb != nullptr && kb[0] != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(kb, &end, 10);
    if (end != kb && *end == '\0' && v > 0 && v < (int64_t{1} << 40)) return static_cast<int64_t>(v) << 10;
  }
  return kDefaultBudgetBytes;
}

void PlanSegments(Graph* g, int64_t batch, int64_t budget) {
  g->segments.clear();
  g->segment_budget = budget;
  if (batch < 2 || budget <= 0) return;
  const size_t n = g->ops.size();
  const std::vector<int64_t> owner = Owners(*g);
  std::vector<int64_t> foot(n, -1);
  for (size_t i = 0; i < n; ++i) {
    int64_t weights = 0;
    const int64_t f = PerImageFootprint(*g, g->ops[i], &weights);
    if (f > 0 && f * batch > budget && f >= weights) foot[i] = f;
  }
  for (size_t i = 0; i < n;) {
    if (foot[i] < 0) {
      ++i;
      continue;
    }
    size_t end = i;
    int64_t widest = 0;
    while (end < n && foot[end] >= 0) widest = std::max(widest, foot[end++]);
    // shrink to a range that holds every op computed by another together with it: an op
    // whose owner is before the range starts after it, one whose owner is past the range
    // (or past an op already cut) ends it
    size_t first = i, cut = end;
    for (bool again = true; again && first < cut;) {
      again = false;
      for (size_t k = first; k < cut && !again; ++k) {
        const int64_t o = owner[k];
        if (o >= 0 && o < static_cast<int64_t>(first)) {
          if (k == first) ++first;
          else cut = k;
          again = true;
        } else if (o >= static_cast<int64_t>(cut)) {  // (an owner comes before its op: unreachable)
          cut = k;
          again = true;
        }
      }
      for (size_t k = first; k < cut && !again; ++k) {
        const int64_t j = k;  // the ops conv k computes must be inside too
        for (size_t m = k + 1; m < n && !again; ++m)
          if (owner[m] == j && m >= cut) {
            cut = k;
            again = true;
          }
      }
    }
    // a row-band pair (ConvParams::band_producer: the depthwise conv computes the 1x1 conv's
    // output, reading that conv's input) is inside a segment together or not at all
    if (first < cut)
      if (const ConvParams* d = AsConv(g->ops[first]); d != nullptr && d->band_producer >= 0 &&
                                                         d->band_producer < static_cast<int32_t>(first))
        ++first;
    if (cut > first)
      if (const ConvParams* c = AsConv(g->ops[cut - 1]); c != nullptr && c->band_consumer >= static_cast<int32_t>(cut))
        --cut;
    if (cut > first + 1) {
      GraphSegment s;
      s.first = first;
      s.end = cut;
      widest = 0;
      for (size_t k = first; k < cut; ++k) widest = std::max(widest, foot[k]);
      s.step = std::clamp<int64_t>(budget / widest, 1, batch);
      if (s.step < batch) {
        ClassifyTensors(*g, &s);
        g->segments.push_back(std::move(s));
      }
    }
    i = std::max(end, i + 1);
  }
}

}  // namespace qdsl
