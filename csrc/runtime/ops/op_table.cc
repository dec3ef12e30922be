// OpDefFor: opcode -> the op's table entry.  The entries (Prepare, Run, output value range)
// are defined in each op's own .cc as k<Op>Def and listed by opcode in the generated
// op_schema.h (kOpDefs), so adding an op edits no file here.
#include "runtime/ops/op.h"

namespace qdsl {

const OpDef& OpDefFor(int opcode) { return *kOpDefs[opcode]; }

}  // namespace qdsl
