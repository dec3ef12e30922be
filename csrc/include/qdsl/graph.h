// A loaded .qgraph (docs/qgraph.md, version 1) and its executor.
//
// LoadGraph parses and validates every byte (header, CRC-32, section bounds, string
// lengths, dtypes, payload sizes and padding bits, op arity and attributes, topological
// order, shapes by inference), so Run never reads out of bounds: a corrupt file is a
// kFormatError Status, never a crash.  Run executes the whole graph in one call with the
// semantics of qdsl/graph/reference.py, bit for bit.
#ifndef QDSL_GRAPH_H_
#define QDSL_GRAPH_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qdsl/gemm.h"
#include "qdsl/status.h"

namespace qdsl {

// File dtype codes (docs/qgraph.md §2).
enum GraphDType : int { kF32 = 1, kI8 = 2, kU8 = 3, kI32 = 4, kI4 = 5, kU4 = 6, kI2 = 7, kU2 = 8, kBin = 9 };

struct Attr {
  int type = 0;  // 1 INT, 2 FLOAT, 3 INTS
  int64_t i = 0;
  float f = 0.f;
  std::vector<int64_t> ints;
};

struct GraphTensor {
  std::string name;
  int dtype = 0;
  bool is_constant = false;
  std::vector<int64_t> dims;    // activations: dims[0] is the batch (-1 = dynamic)
  std::vector<int32_t> values;  // constants: logical values, row-major
  // Activations: a proven range of the values, from the clamp of the op that produces them
  // (QUANTIZE qmin/qmax, a stage's out_min/out_max, CLAMP), else the dtype's range; set by
  // the validator.  Convs use it to bound their sums (docs/qgraph.md §4.3).
  int64_t value_min = 0, value_max = 0;
};

struct OpParams;  // an op's checked parameters and packed weights (runtime/ops/op.h)

struct GraphOp {
  int opcode = 0;
  std::string name;
  std::vector<uint32_t> inputs, outputs;
  std::map<std::string, Attr> attrs;
  std::shared_ptr<OpParams> prepared;  // set by the op's Prepare (runtime/ops/)
};

struct Graph {
  std::string name;
  std::vector<GraphTensor> tensors;
  std::vector<uint32_t> inputs, outputs;
  std::vector<GraphOp> ops;
  std::vector<int64_t> overflow;  // per op, from the last Run
  // Run-time buffers, reused while the batch size stays the same.
  int64_t planned_batch = -1;
  std::vector<std::vector<uint8_t>> buffers;
  // Per run: ADD ops already computed by the conv they were fused into (ConvParams::fused_add).
  std::vector<char> fused_done;
  // Per tensor: stored NHWC instead of NCHW (runtime/prepare.cc PlanNhwc), planned for the
  // kernel path of the run (nhwc_path; RunGraph plans again when it changes): only tensors
  // that NHWC convs (the AMX and AVX2 implicit-GEMM convs that path runs) produce or ADDs
  // pass on, and that only such convs and ADDs read, so no other op ever sees the layout.
  std::vector<char> nhwc;
  uint32_t nhwc_path = 0;
};

Status LoadGraph(const uint8_t* data, int64_t size, std::unique_ptr<Graph>* out);
// Shape of tensor t for batch n (dims[0] = n for activations).
std::vector<int64_t> ShapeFor(const GraphTensor& t, int64_t n);
// inputs[i]: graph input i (float32 / int8 / uint8 container, shape ShapeFor(batch));
// outputs[i]: caller-allocated buffers of graph output i.
Status RunGraph(Graph* g, int64_t batch, const void* const* inputs, void* const* outputs, uint32_t path);

}  // namespace qdsl

#endif  // QDSL_GRAPH_H_
