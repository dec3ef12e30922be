// The op table: opcode -> (Prepare, Run, output value range).  Names, arity and attribute
// schemas come from the generated op_schema.h (kOpSchemas); this file adds the C++ side.
#include "runtime/ops/op.h"

namespace qdsl {
namespace {

constexpr OpDef kConvDef = {PrepareConv, RunConvOp, ValueRange::kStage};
constexpr OpDef kPoolStageDef = {PreparePool, RunPool, ValueRange::kStage};
constexpr OpDef kMaxPoolDef = {PreparePool, RunPool, ValueRange::kInput};

// Indexed by opcode, row for row with kOpSchemas.
constexpr OpDef kOpDefs[] = {
    {nullptr, nullptr, ValueRange::kStage},                         // 0: no op
    {PrepareQuantize, RunQuantize, ValueRange::kQuantize},          // QUANTIZE
    {PrepareDequantize, RunDequantize, ValueRange::kStage},         // DEQUANTIZE (F32 output)
    {PrepareRequantize, RunRequantize, ValueRange::kStage},         // REQUANTIZE
    kConvDef,                                                       // CONV1D
    kConvDef,                                                       // CONV2D
    kConvDef,                                                       // LINEAR
    kConvDef,                                                       // BCONV1D
    kConvDef,                                                       // BCONV2D
    kConvDef,                                                       // BLINEAR
    {PrepareAdd, RunAdd, ValueRange::kStage},                       // ADD
    {PrepareConcat, RunConcat, ValueRange::kStage},                 // CONCAT
    {PrepareClamp, RunClamp, ValueRange::kClamp},                   // CLAMP
    kMaxPoolDef,                                                    // MAXPOOL1D
    kMaxPoolDef,                                                    // MAXPOOL2D
    kPoolStageDef,                                                  // AVGPOOL1D
    kPoolStageDef,                                                  // AVGPOOL2D
    {PrepareGlobalAvgpool, RunGlobalAvgpool, ValueRange::kStage},   // GLOBAL_AVGPOOL
    {PrepareReshape, RunReshape, ValueRange::kInput},               // RESHAPE
    {PrepareBinarize, RunBinarize, ValueRange::kStage},             // BINARIZE (BIN output)
    {PrepareLut, RunLut, ValueRange::kStage},                       // LUT (no out_min/max: the dtype's range)
};
// A row per opcode: adding an op to the Python schema (and regenerating op_schema.h)
// fails here until its row is added.
static_assert(sizeof(kOpDefs) / sizeof(kOpDefs[0]) == kMaxOpcode + 1,
              "every opcode of op_schema.h needs its Prepare and Run here");

}  // namespace

const OpDef& OpDefFor(int opcode) { return kOpDefs[opcode]; }

}  // namespace qdsl
