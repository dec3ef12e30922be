// C ABI for graphs: load (validate) once, then run the whole graph per call.
#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <new>

#include "bindings/c_api.h"
#include "bindings/guard.h"
#include "qdsl/graph.h"
#include "runtime/ops/conv.h"

namespace {

using qdsl::bindings::Guard;
using qdsl::bindings::Report;

}  // namespace

extern "C" {

int qdsl_graph_load(const void* data, int64_t size, void** handle, char* err, int64_t errlen) {
  return Guard(err, errlen, [&]() -> qdsl::Status {
    QDSL_CHECK_ARG(handle != nullptr && size >= 0, "bad arguments");
    *handle = nullptr;
    std::unique_ptr<qdsl::Graph> g;
    QDSL_RETURN_IF_ERROR(qdsl::LoadGraph(static_cast<const uint8_t*>(data), size, &g));
    *handle = g.release();
    return qdsl::Status::Ok();
  });
}

void qdsl_graph_free(void* handle) { delete static_cast<qdsl::Graph*>(handle); }

int64_t qdsl_graph_entry(void* handle, int which, int64_t index, int64_t* info, char* name, int64_t namelen) {
  const auto* g = static_cast<const qdsl::Graph*>(handle);
  const int64_t count = which == 0 ? g->inputs.size() : (which == 1 ? g->outputs.size() : g->ops.size());
  if (index < 0 || index >= count) return count;
  std::string nm;
  if (which == 2) {
    const qdsl::GraphOp& op = g->ops[index];
    info[0] = op.opcode;
    // int conv/linear: bit 0 when its int32 stage and a fused ADD run as one estimate, bit 1
    // when its implicit-GEMM taps are kernel rows (ConvParams::ig_rows)
    info[1] = 0;
    const qdsl::GraphTensor& x = g->tensors[op.inputs[0]];
    info[2] = x.value_min;
    info[3] = x.value_max;
    const qdsl::ConvParams* cp = qdsl::AsConv(op);
    const bool int_gemm = cp != nullptr && (op.opcode == qdsl::kConv1d || op.opcode == qdsl::kConv2d ||
                                            op.opcode == qdsl::kLinear);
    info[4] = int_gemm && cp->int32_exact ? cp->maddubs_steps : -1;
    info[5] = int_gemm ? (cp->fast_acc ? 1 : 0) : -1;  // (binary ops: not tracked)
    // 2: the int16 kernel kind; 3: the vpmaddubsw kind run by its vpdpbusd kernels (on the last
    // run's path, before any run the default one)
    uint32_t path = g->nhwc_path;
    if (path == 0 && !qdsl::ResolvePath(0, &path).ok()) path = 0;
    info[6] = int_gemm ? (cp->igemm ? (cp->ig_int16 ? 2 : (qdsl::IgemmRunsVnni(path) ? 3 : 1)) : 0) : -1;
    // info[1] bits: 1 the residual ADD fused into the conv's stage; 4 that stage from the kernel's
    // registers (IgemmStageAddKernel, where the path has it: K <= 512, no twins); 2 an implicit GEMM
    // by kernel rows (ConvParams::ig_rows)
    if (int_gemm) {
      const bool fused = cp->igemm && cp->fused_add >= 0 && cp->ig_add.ok;
      const bool regs = fused && !cp->ig_int16 && cp->twins.empty() && cp->ig_taps * cp->ig_cp <= 512 &&
                        qdsl::SelectIgemmStageAddKernel(path) != nullptr;
      info[1] = (fused ? 1 : 0) | (regs ? 4 : 0) | (cp->igemm && cp->ig_rows ? 2 : 0);
    }
    // the output stage prepared for the kernel's registers (StageF32: igemm or NHWC depthwise)
    // (2: an NHWC depthwise conv that runs on the vpmaddubsw kernel, ConvParams::dwq)
    // (an I32 output: ig_stage32, which the AVX-512 twin epilogue applies)
    info[9] = int_gemm ? ((cp->igemm && (cp->ig_stage.ok || cp->ig_stage32.ok)) || (cp->dw_nhwc && cp->dwn_stage.ok)
                              ? 1 + cp->dwq : 0) : -1;
    // the output's layout in the last run (Graph::nhwc; NCHW before any run)
    info[7] = op.outputs[0] < g->nhwc.size() ? g->nhwc[op.outputs[0]] : 0;
    // images per pass the op ran with in the last run (0: the whole batch; segment.cc)
    info[10] = static_cast<size_t>(index) < g->op_step.size() ? g->op_step[index] : 0;
    // row bands in the last run: 1 on a depthwise conv that computed its 1x1 producer's rows,
    // 2 on that producer (conv::RowBandFused; the layouts are the last run's)
    info[11] = 0;
    if (cp != nullptr && g->nhwc_path != 0) {
      if (cp->band_producer >= 0 && qdsl::conv::RowBandFused(g, op, g->nhwc_path)) info[11] = 1;
      if (cp->band_consumer >= 0 && qdsl::conv::RowBandFused(g, g->ops[cp->band_consumer], g->nhwc_path)) info[11] = 2;
    }
    info[8] = op.opcode == qdsl::kLinear && cp != nullptr ? (qdsl::conv::LinearFusedGemm(g, op) ? 1 : 0) : -1;
    nm = op.name;
  } else {
    const qdsl::GraphTensor& t = g->tensors[which == 0 ? g->inputs[index] : g->outputs[index]];
    info[0] = t.dtype;
    info[1] = static_cast<int64_t>(t.dims.size());
    for (size_t d = 0; d < t.dims.size() && d < 8; ++d) info[2 + d] = t.dims[d];
    nm = t.name;
  }
  if (name != nullptr && namelen > 0) {
    const size_t n = std::min<size_t>(nm.size(), static_cast<size_t>(namelen - 1));
    std::memcpy(name, nm.data(), n);
    name[n] = 0;
  }
  return count;
}

int qdsl_graph_run(void* handle, int64_t batch, const void* const* inputs, void* const* outputs, uint32_t path,
                   char* err, int64_t errlen) {
  return Guard(err, errlen, [&]() -> qdsl::Status {
    QDSL_CHECK_ARG(handle != nullptr && inputs != nullptr && outputs != nullptr, "null graph arguments");
    return qdsl::RunGraph(static_cast<qdsl::Graph*>(handle), batch, inputs, outputs, path);
  });
}

void qdsl_graph_overflow(void* handle, int64_t* counts, int64_t n) {
  const auto* g = static_cast<const qdsl::Graph*>(handle);
  for (int64_t i = 0; i < n && i < static_cast<int64_t>(g->overflow.size()); ++i) counts[i] = g->overflow[i];
}

}  // extern "C"
