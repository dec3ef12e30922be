// A loaded .qgraph (docs/qgraph.md, version 1) and its executor.
//
// LoadGraph parses and validates every byte (header, CRC-32, section bounds, string
// lengths, dtypes, payload sizes and padding bits, op arity and attributes, topological
// order, shapes by inference), so Run never reads out of bounds: a corrupt file is a
// kFormatError Status, never a crash.  Run executes the whole graph in one call with the
// semantics of qdsl/graph/reference.py, bit for bit.
#ifndef QDSL_GRAPH_H_
#define QDSL_GRAPH_H_

#include <cstddef>
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

// A tensor's run-time storage and the view of it that ops read and write (data(), size()).
// The view is the whole buffer except while a segment of the graph runs a slice of the
// batch at a time (executor.cc): then it is that slice's images (tensors the segment reads
// from or leaves to the rest of the graph) or the first images' room (tensors that live
// inside the segment, reused by every slice so they stay in cache).
class TensorBuffer {
 public:
  TensorBuffer() = default;
  TensorBuffer(const TensorBuffer& o) : store_(o.store_) { SetView(o.view_ - o.store_.data(), o.size_); }
  TensorBuffer& operator=(const TensorBuffer& o) {
    if (this != &o) {
      store_ = o.store_;
      SetView(o.view_ - o.store_.data(), o.size_);
    }
    return *this;
  }
  // (moves keep the heap block, so the view stays valid)
  TensorBuffer(TensorBuffer&&) noexcept = default;
  TensorBuffer& operator=(TensorBuffer&&) noexcept = default;

  // Zeroed storage of `bytes`, viewed whole.
  void Allocate(size_t bytes) {
    store_.assign(bytes, 0);
    ViewAll();
  }
  void ViewAll() { SetView(0, store_.size()); }
  // bytes [offset, offset + size) of the storage (within it: the executor's plan says so)
  void SetView(ptrdiff_t offset, size_t size) {
    view_ = store_.data() + offset;
    size_ = size;
  }
  uint8_t* data() const { return view_; }
  size_t size() const { return size_; }
  size_t capacity() const { return store_.size(); }

 private:
  std::vector<uint8_t> store_;
  uint8_t* view_ = nullptr;
  size_t size_ = 0;
};

// A run of consecutive ops that the executor runs `step` images at a time (a segment: the
// ops are per-image computations whose whole-batch tensors outgrow the cache; segment.cc).
struct GraphSegment {
  size_t first = 0, end = 0;       // ops [first, end)
  int64_t step = 1;                // images per pass
  std::vector<uint32_t> sliced;    // tensors read from or left to the rest of the graph: viewed per slice
  std::vector<uint32_t> internal;  // produced and only read inside: the first `step` images' room, reused
};

struct Graph {
  std::string name;
  std::vector<GraphTensor> tensors;
  std::vector<uint32_t> inputs, outputs;
  std::vector<GraphOp> ops;
  std::vector<int64_t> overflow;  // per op, from the last Run
  // Run-time buffers, reused while the batch size stays the same.
  int64_t planned_batch = -1;
  std::vector<TensorBuffer> buffers;
  // Segments planned for planned_batch (PlanSegments, segment.cc); segment_budget: the cache
  // budget they were planned with (-1: none planned; 0: segmentation off).
  std::vector<GraphSegment> segments;
  int64_t segment_budget = -1;
  // Per op: images per pass it ran with in the last run (0: the whole batch at once).
  std::vector<int64_t> op_step;
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
