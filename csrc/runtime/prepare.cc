// Graph validation after parsing (docs/qgraph.md §3-§5): op arity and exactly the listed
// attributes with their types (from the generated op_schema.h), then each op's own Prepare
// (runtime/ops/: dtypes, attribute values, the inferred output shape, packed weights, its
// typed params), topological order, and every declared output shape equal to the inferred
// one.  Then the graph-level plans of the AMX and twin convs.  After PrepareGraph succeeds,
// the executor's index arithmetic is in bounds.
#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <string>

#include "runtime/ops/add.h"
#include "runtime/ops/conv.h"
#include "runtime/ops/op.h"

namespace qdsl {
namespace {

// Marks convs that can compute the ADD consuming their output (ConvParams::fused_add).
void FuseResidualAdds(Graph* g) {
  const size_t nt = g->tensors.size();
  std::vector<int> producer(nt, -1), consumers(nt, 0);
  std::vector<char> is_output(nt, 0);
  for (uint32_t t : g->outputs) is_output[t] = 1;
  for (size_t i = 0; i < g->ops.size(); ++i) {
    producer[g->ops[i].outputs[0]] = static_cast<int>(i);
    for (uint32_t t : g->ops[i].inputs) ++consumers[t];
  }
  for (size_t bi = 0; bi < g->ops.size(); ++bi) {
    const GraphOp& add = g->ops[bi];
    if (add.opcode != kAdd || add.inputs.size() != 2 || add.inputs[0] == add.inputs[1]) continue;
    // the later-produced input's conv takes the ADD: the other one is ready by then
    int best = -1;
    for (int slot = 0; slot < 2; ++slot) {
      const uint32_t t = add.inputs[slot];
      const int a = producer[t];
      if (a < 0 || consumers[t] != 1 || is_output[t] || g->tensors[t].dtype != kI32) continue;
      const ConvParams* p = AsConv(g->ops[a]);
      if (p == nullptr) continue;  // not a conv: a LAYERNORM's wide (I32) output, ...
      // the AMX implicit conv's epilogue or IntConvFast's output stage (conv_fast.cc) computes it
      const bool gathered = !p->w16.empty() && !p->depthwise;
      if (!(p->amx_conv || gathered) || !p->fast_acc || p->spatial == 0) continue;
      const int other = producer[add.inputs[1 - slot]];
      if (other >= a) continue;  // (graph inputs have no producer: -1)
      if (best < 0 || a > producer[add.inputs[best]]) best = slot;
    }
    if (best < 0) continue;
    ConvParams& p = *AsConv(g->ops[producer[add.inputs[best]]]);
    p.fused_add = static_cast<int32_t>(bi);
    p.fused_slot = best;
    // the implicit-GEMM conv's epilogue: its int32 stage and the ADD as one estimate
    const int other_dtype = g->tensors[add.inputs[1 - best]].dtype, y_dtype = g->tensors[add.outputs[0]].dtype;
    if (p.igemm && (other_dtype == kU8 || other_dtype == kI8 || other_dtype == kI32) &&
        (y_dtype == kU8 || y_dtype == kI8)) {
      const AddParams& ap = ParamsOf<AddParams>(add);
      PrepareStageAddF32(p.out.stage, p.cout, p.ig_panels * 16, ap.in[best].stage, ap.in[1 - best].stage, ap.pre_shift,
                         ap.out.stage, other_dtype == kI8, other_dtype == kI32, y_dtype == kI8, &p.ig_add);
    }
  }
}

// ConvParams::twins: a conv whose inputs (activation, weight and bias tensors) and prepared
// geometry equal an earlier conv's, both with the fast output stage (fast_acc).  The later
// conv's output is then written when the earlier one runs: only that conv produces it, and
// its inputs are the earlier one's, so they are ready.  (A fused ADD on the later conv only
// runs on the AMX path, which computes twins separately: the two never meet.)
void FindTwinConvs(Graph* g) {
  for (size_t j = 0; j < g->ops.size(); ++j) {
    const GraphOp& b = g->ops[j];
    const ConvParams* pb = AsConv(b);
    if (pb == nullptr || pb->spatial == 0 || pb->w16.empty() || !pb->fast_acc) continue;
    for (size_t i = 0; i < j; ++i) {
      GraphOp& a = g->ops[i];
      ConvParams* pa = AsConv(a);
      if (pa == nullptr || a.opcode != b.opcode || a.inputs != b.inputs || pa->w16.empty() || !pa->fast_acc) continue;
      if (pa->groups != pb->groups || pa->cin != pb->cin || pa->cout != pb->cout || pa->kh != pb->kh ||
          pa->kw != pb->kw || pa->sh != pb->sh || pa->sw != pb->sw || pa->ph != pb->ph || pa->pw != pb->pw ||
          pa->dh != pb->dh || pa->dw != pb->dw || pa->in_zp != pb->in_zp || pa->w_int != pb->w_int ||
          pa->bias != pb->bias)
        continue;
      pa->twins.push_back(static_cast<int32_t>(j));
      break;
    }
  }
}

// Implicit-GEMM convs by kernel rows (ConvParams::ig_rows) with fewer than 8 input channels
// (RGB stems) stay implicit-GEMM convs only where every reader of their output is a max pool
// (a ResNet's stem: NHWC codes from the kernel's registers into the NHWC pool); else the
// gathered-panel conv runs, as it did before kernel rows (a MobileNetV2 stem's reader is a
// 3 x 3 depthwise conv at 112 x 112, which channels-last costs more (b8) than the stem saves,
// and the stem writing NCHW from its int32 tiles measured 1.3x the gathered conv).
// QDSL_IGEMM_ALL=1 (tests) keeps them all.
void KeepRowStems(Graph* g) {
  if (std::getenv("QDSL_IGEMM_ALL") != nullptr) return;
  std::vector<int> readers(g->tensors.size(), 0), pools(g->tensors.size(), 0);
  for (const GraphOp& op : g->ops)
    for (uint32_t t : op.inputs) {
      ++readers[t];
      pools[t] += op.opcode == kMaxpool2d;
    }
  for (uint32_t t : g->outputs) ++readers[t];
  for (GraphOp& op : g->ops)
    if (ConvParams* p = AsConv(op); p != nullptr && p->igemm && p->ig_rows && p->cin < 8) {
      const uint32_t t = op.outputs[0];
      if (readers[t] == 0 || readers[t] != pools[t]) p->igemm = false;
    }
}

// ConvParams::dw_nhwc stays set only on depthwise convs that are neither twins nor twinned:
// a twin's output is written NCHW by the conv it twins (the executor reads dw_nhwc).
void KeepNhwcDepthwise(Graph* g) {
  std::vector<char> twin(g->ops.size(), 0);
  for (const GraphOp& op : g->ops)
    if (const ConvParams* p = AsConv(op))
      for (int32_t j : p->twins) twin[j] = 1;
  for (size_t i = 0; i < g->ops.size(); ++i)
    if (ConvParams* p = AsConv(g->ops[i])) p->dw_nhwc = p->dw_nhwc && p->twins.empty() && !twin[i];
}

// ConvParams::band_producer / band_consumer: an NHWC depthwise conv (dw_nhwc with the
// register stage) and the op right before it when that is a 1x1, stride-1, unpadded
// implicit-GEMM conv with the register stage (ig_stage, the vpmaddubsw kind) that writes
// the depthwise conv's input, read by nothing else (no graph output, no twin, no fused ADD):
// MobileNetV2's expansion convs.  Adjacent, so no op between them reads or writes anything
// the pair's run order changes, and the segment planner keeps the two together
// (segment.cc).  Whether the pair runs fused is decided per run (conv::RowBandFused).
void FindRowBands(Graph* g) {
  const size_t nt = g->tensors.size();
  std::vector<int> consumers(nt, 0);
  for (const GraphOp& op : g->ops)
    for (uint32_t t : op.inputs) ++consumers[t];
  for (uint32_t t : g->outputs) ++consumers[t];
  std::vector<char> twin(g->ops.size(), 0);
  for (const GraphOp& op : g->ops)
    if (const ConvParams* p = AsConv(op))
      for (int32_t j : p->twins) twin[j] = 1;
  for (size_t j = 1; j < g->ops.size(); ++j) {
    ConvParams* d = AsConv(g->ops[j]);
    ConvParams* c = AsConv(g->ops[j - 1]);
    if (d == nullptr || c == nullptr || !d->depthwise || !d->dw_nhwc || !d->dwn_stage.ok || twin[j]) continue;
    const uint32_t t = g->ops[j].inputs[0];
    if (g->ops[j - 1].outputs.size() != 1 || g->ops[j - 1].outputs[0] != t || consumers[t] != 1) continue;
    if (g->ops[j - 1].opcode != kConv2d || !c->igemm || c->ig_int16 || !c->ig_stage.ok || c->kh != 1 ||
        c->kw != 1 || c->sh != 1 || c->sw != 1 || c->ph != 0 || c->pw != 0 || !c->twins.empty() ||
        c->fused_add >= 0 || twin[j - 1] || c->band_producer >= 0)
      continue;
    const int dt = g->tensors[t].dtype;
    if (dt != kU8 && dt != kI8) continue;
    d->band_producer = static_cast<int32_t>(j - 1);
    c->band_consumer = static_cast<int32_t>(j);
  }
}

}  // namespace

namespace {

// Depthwise convs that run channels-last (DepthwiseConvNhwc: ConvParams::dw_nhwc, on every
// path but the reference one) read their input and write their output in either layout.
// (A one-channel depthwise conv is also a groups-1 conv that the AMX path may run: NHWC too.)
bool DwNhwc(const ConvParams& p, uint32_t path) { return p.depthwise && p.dw_nhwc && path != kPathRef; }

// The ops that run on NHWC tensors (Graph::nhwc) on `path`: whether op writes its output
// NHWC when asked to, and whether it reads input k NHWC when that is stored so.
//   convs     the AMX and AVX2 implicit-GEMM convs that path runs (conv::RunsNhwc) and the
//             channels-last depthwise convs (DwNhwc): input 0; the gathered-panel conv writes
//             NHWC for max pools only (conv::GatheredWritesNhwc, PlanNhwc)
//   ADD       elementwise: any layout, but all three tensors the same (PlanNhwc below)
//   pools     MAXPOOL2D/AVGPOOL2D: input and output each either way (transposed per image)
//   GLOBAL_AVGPOOL  reads NHWC; its [N][C][1][1] output is the same in both layouts
bool WritesNhwc(const GraphOp& op, uint32_t path) {
  const ConvParams* p = AsConv(op);
  if (p != nullptr) return conv::RunsNhwc(*p, path) || DwNhwc(*p, path);
  return op.opcode == kAdd || op.opcode == kMaxpool2d || op.opcode == kAvgpool2d;
}
bool ReadsNhwc(const GraphOp& op, size_t k, uint32_t path) {
  const ConvParams* p = AsConv(op);
  if (p != nullptr) return k == 0 && (conv::RunsNhwc(*p, path) || DwNhwc(*p, path));
  if (op.opcode == kAdd) return true;
  return k == 0 && (op.opcode == kMaxpool2d || op.opcode == kAvgpool2d || op.opcode == kGlobalAvgpool);
}

}  // namespace

// Graph::nhwc for runs on `path`: start from every tensor an op that writes NHWC produces
// (WritesNhwc), then drop tensors with another reader (ReadsNhwc; or that are graph outputs)
// until stable; an ADD keeps both inputs and its output in one layout (it is elementwise:
// any layout, but the same).  Graph inputs stay NCHW.
void PlanNhwc(Graph* g, uint32_t path) {
  const size_t nt = g->tensors.size();
  std::vector<char>& s = g->nhwc;
  s.assign(nt, 0);
  // pool_only: outputs of gathered-panel convs (conv::GatheredWritesNhwc), NHWC only while
  // every reader is a max pool that writes NHWC
  std::vector<char> twin(g->ops.size(), 0), pool_only(nt, 0);
  for (const GraphOp& op : g->ops)
    if (const ConvParams* p = AsConv(op))
      for (int32_t j : p->twins) twin[j] = 1;
  for (size_t i = 0; i < g->ops.size(); ++i) {
    const GraphOp& op = g->ops[i];
    if (WritesNhwc(op, path)) {
      s[op.outputs[0]] = 1;
    } else if (const ConvParams* p = AsConv(op); p != nullptr && !twin[i] && conv::GatheredWritesNhwc(*p, path)) {
      s[op.outputs[0]] = pool_only[op.outputs[0]] = 1;
    }
  }
  for (uint32_t t : g->outputs) s[t] = 0;
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < g->ops.size(); ++i) {
      const GraphOp& op = g->ops[i];
      for (size_t k = 0; k < op.inputs.size(); ++k) {
        const uint32_t t = op.inputs[k];
        if (s[t] && (!ReadsNhwc(op, k, path) || (pool_only[t] && (op.opcode != kMaxpool2d || !s[op.outputs[0]])))) {
          s[t] = 0;
          changed = true;
        }
      }
      if (op.opcode == kAdd) {
        bool all = s[op.outputs[0]] != 0;
        for (uint32_t t : op.inputs) all = all && s[t];
        if (!all && (s[op.outputs[0]] || s[op.inputs[0]] || s[op.inputs[1]])) {
          s[op.outputs[0]] = 0;
          for (uint32_t t : op.inputs) s[t] = 0;
          changed = true;
        }
      }
    }
  }
  g->nhwc_path = path;
}

namespace {

// The output's proven value range (GraphTensor::value_min/max) by the op's table rule:
// the clamp the op applies (checked within the dtype by its Prepare), the input's range for
// ops that only move values, else the dtype's range.
void SetValueRange(const GraphOp& op, const GraphTensor& x, GraphTensor* out) {
  if (!IsInt8(out->dtype)) return;
  const auto& A = op.attrs;
  switch (OpDefFor(op.opcode).range) {
    case ValueRange::kQuantize:
      out->value_min = A.at("qmin").i;
      out->value_max = A.at("qmax").i;
      return;
    case ValueRange::kClamp: {  // monotone: the ends of the input range map to the ends of the output's
      const int64_t lo = A.at("out_min").i, hi = A.at("out_max").i;
      out->value_min = std::clamp(x.value_min, lo, hi);
      out->value_max = std::clamp(x.value_max, lo, hi);
      return;
    }
    case ValueRange::kInput:  // padding taps never win a max pool
      out->value_min = x.value_min;
      out->value_max = x.value_max;
      return;
    case ValueRange::kStage: {
      const auto lo = A.find("out_min"), hi = A.find("out_max");
      if (lo != A.end() && hi != A.end()) {  // every stage (and CONCAT) clamps its output
        out->value_min = lo->second.i;
        out->value_max = hi->second.i;
      }
    }
  }
}

}  // namespace

Status PrepareGraph(Graph* g) {
  const int n_tensors = static_cast<int>(g->tensors.size());
  std::vector<char> ready(n_tensors, 0);
  for (int i = 0; i < n_tensors; ++i) ready[i] = g->tensors[i].is_constant;
  // I32 graph inputs are token ids or masks: only EMBEDDING reads them, as its first input,
  // and SOFTMAX_MASKED, after its first (other ops take I32 activations as accumulators)
  std::vector<char> ids(n_tensors, 0);
  for (uint32_t t : g->inputs) {
    const GraphTensor& in = g->tensors[t];
    QDSL_CHECK(!in.is_constant && (in.dtype == kF32 || in.dtype == kI32 || IsInt8(in.dtype)), StatusCode::kFormatError,
               "graph input '%s' must be an F32/I8/U8/I32 activation", in.name.c_str());
    ready[t] = 1;
    ids[t] = in.dtype == kI32;
  }
  for (GraphTensor& t : g->tensors) DTypeRange(t.dtype, &t.value_min, &t.value_max);
  for (int index = 0; index < static_cast<int>(g->ops.size()); ++index) {
    GraphOp& op = g->ops[index];
    const OpSchema& sc = kOpSchemas[op.opcode];  // the loader admits opcodes 1..kMaxOpcode only
    const int n_in = static_cast<int>(op.inputs.size());
    OP_CHECK(n_in >= sc.min_inputs && (sc.max_inputs < 0 || n_in <= sc.max_inputs), "wrong number of inputs (%d)", n_in);
    OP_CHECK(static_cast<int>(op.outputs.size()) == sc.n_outputs, "has %zu outputs, expected %d", op.outputs.size(),
             sc.n_outputs);
    for (uint32_t t : op.inputs) OP_CHECK(ready[t], "input '%s' is not produced before this op", g->tensors[t].name.c_str());
    for (int k = 0; k < n_in; ++k)
      OP_CHECK(!ids[op.inputs[k]] || (k == 0 && op.opcode == kEmbedding) || (k > 0 && op.opcode == kSoftmaxMasked),
               "input '%s' is an I32 graph input (token ids), which only EMBEDDING reads (as its first input), "
               "or a mask, which only SOFTMAX_MASKED reads (after its first input)",
               g->tensors[op.inputs[k]].name.c_str());
    const uint32_t out_index = op.outputs[0];
    GraphTensor& out = g->tensors[out_index];
    OP_CHECK(!ready[out_index] && !out.is_constant, "output '%s' is produced twice or is a constant", out.name.c_str());
    ready[out_index] = 1;
    for (size_t k = 1; k < op.outputs.size(); ++k) {  // QUANTIZE_DYNAMIC's qparams: its Prepare checks them
      const uint32_t t = op.outputs[k];
      OP_CHECK(!ready[t] && !g->tensors[t].is_constant, "output '%s' is produced twice or is a constant",
               g->tensors[t].name.c_str());
      ready[t] = 1;
    }
    // Exactly the listed attributes, with the listed types.
    std::vector<AttrSchema> want(sc.attrs, sc.attrs + sc.n_attrs);
    if (sc.needs_output_stage && out.dtype != kBin) want.insert(want.end(), std::begin(kStageAttrs), std::end(kStageAttrs));
    OP_CHECK(op.attrs.size() == want.size(), "has %zu attributes, expected %zu", op.attrs.size(), want.size());
    for (const AttrSchema& w : want) {
      auto it = op.attrs.find(w.name);
      OP_CHECK(it != op.attrs.end(), "missing attribute '%s'", w.name);
      OP_CHECK(it->second.type == w.type, "attribute '%s' has the wrong type", w.name);
    }
    const GraphTensor& x = g->tensors[op.inputs[0]];
    OP_CHECK(!x.is_constant, "first input '%s' must be an activation", x.name.c_str());
    std::vector<int64_t> shape = x.dims;  // the Prepare function infers the output's
    QDSL_RETURN_IF_ERROR(OpDefFor(op.opcode).prepare(g, op, index, &shape));
    SetValueRange(op, x, &out);
    OP_CHECK(out.dims == shape, "declared output shape of '%s' differs from the inferred shape", out.name.c_str());
  }
  for (uint32_t t : g->outputs)
    QDSL_CHECK(ready[t] && !g->tensors[t].is_constant, StatusCode::kFormatError, "graph output '%s' is never produced",
               g->tensors[t].name.c_str());
  for (int i = 0; i < n_tensors; ++i)
    QDSL_CHECK(ready[i], StatusCode::kFormatError, "activation '%s' is never produced", g->tensors[i].name.c_str());
  g->overflow.assign(g->ops.size(), 0);
  KeepRowStems(g);
  FuseResidualAdds(g);
  FindTwinConvs(g);
  KeepNhwcDepthwise(g);
  FindRowBands(g);
  g->nhwc.assign(g->tensors.size(), 0);  // planned per path by the first run (PlanNhwc)
  g->nhwc_path = 0;
  return Status::Ok();
}

}  // namespace qdsl
