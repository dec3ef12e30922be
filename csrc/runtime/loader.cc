// .qgraph parser (docs/qgraph.md §1-§2): every read is bounds-checked by Reader, every
// count and size is validated before anything is allocated from it.  Op-level checks
// (attributes, shapes) happen in PrepareGraph (prepare.cc), called at the end.
#include <cstring>

#include "qdsl/graph.h"
#include "runtime/ops/op_schema.h"

namespace qdsl {

Status PrepareGraph(Graph* g);  // prepare.cc

namespace {

constexpr int64_t kMaxString = 4096;
constexpr int64_t kMaxNumel = int64_t{1} << 36;

uint32_t Crc32(const uint8_t* p, int64_t n) {
  static uint32_t table[256];
  static bool init = false;
  if (!init) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    init = true;
  }
  uint32_t c = 0xFFFFFFFFu;
  for (int64_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// Strict UTF-8 as Python's decoder applies it (RFC 3629): no overlong forms, no UTF-16
// surrogates (U+D800..U+DFFF), nothing above U+10FFFF, no truncated sequences.
bool IsValidUtf8(const uint8_t* p, int64_t n) {
  int64_t i = 0;
  while (i < n) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return false;  // continuation byte, C0/C1 overlong lead, or F5..FF
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (int k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    i += len;
  }
  return true;
}

#define FMT_CHECK(cond, ...) QDSL_CHECK(cond, ::qdsl::StatusCode::kFormatError, __VA_ARGS__)

class Reader {
 public:
  Reader(const uint8_t* data, int64_t begin, int64_t end) : data_(data), pos_(begin), end_(end) {}
  int64_t pos() const { return pos_; }
  int64_t end() const { return end_; }
  template <typename T>
  Status Read(T* v) {
    FMT_CHECK(end_ - pos_ >= static_cast<int64_t>(sizeof(T)), "truncated table: need %d bytes at byte %lld",
              (int)sizeof(T), (long long)pos_);
    std::memcpy(v, data_ + pos_, sizeof(T));  // little-endian host assumed (x86, arm64)
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status ReadString(std::string* s, const char* what) {
    uint32_t len = 0;
    QDSL_RETURN_IF_ERROR(Read(&len));
    FMT_CHECK(len <= kMaxString, "string of %u bytes at byte %lld exceeds %lld", len, (long long)pos_ - 4,
              (long long)kMaxString);
    FMT_CHECK(end_ - pos_ >= len, "truncated string at byte %lld", (long long)pos_);
    // Same rule as the Python loader (bytes.decode("utf-8")): names are text, so a graph
    // one loader accepts the other accepts too.
    FMT_CHECK(IsValidUtf8(data_ + pos_, len), "%s is not valid UTF-8 (at byte %lld)", what, (long long)pos_);
    s->assign(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return Status::Ok();
  }
  Status ReadIndices(uint32_t limit, std::vector<uint32_t>* out, const char* what) {
    uint32_t n = 0;
    QDSL_RETURN_IF_ERROR(Read(&n));
    FMT_CHECK(static_cast<int64_t>(n) * 4 <= end_ - pos_, "%s count %u at byte %lld runs past the table", what, n,
              (long long)pos_ - 4);
    out->resize(n);
    for (uint32_t i = 0; i < n; ++i) {
      QDSL_RETURN_IF_ERROR(Read(&(*out)[i]));
      FMT_CHECK((*out)[i] < limit, "%s tensor index %u out of range (%u tensors)", what, (*out)[i], limit);
    }
    return Status::Ok();
  }

 private:
  const uint8_t* data_;
  int64_t pos_, end_;
};

int DTypeBits(int dtype) {
  switch (dtype) {
    case kF32: case kI32: return 32;
    case kI8: case kU8: return 8;
    case kI4: case kU4: return 4;
    case kI2: case kU2: return 2;
    case kBin: return 1;
    default: return 0;
  }
}

// Decodes a constant payload into logical values (docs/qgraph.md §2 packing).
Status DecodePayload(const uint8_t* p, int64_t size, int64_t numel, GraphTensor* t) {
  const int bits = DTypeBits(t->dtype);
  FMT_CHECK(t->dtype != kF32, "constant '%s' has dtype F32 (constants are integer)", t->name.c_str());
  const int64_t need = (numel * bits + 7) / 8;
  FMT_CHECK(size == need, "constant '%s' payload is %lld bytes, expected %lld", t->name.c_str(), (long long)size,
            (long long)need);
  t->values.resize(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) {
    int32_t v;
    if (bits == 32) {
      std::memcpy(&v, p + 4 * i, 4);
    } else if (bits == 8) {
      v = t->dtype == kI8 ? static_cast<int8_t>(p[i]) : p[i];
    } else {
      const int64_t bit = i * bits;
      const int raw = (p[bit >> 3] >> (bit & 7)) & ((1 << bits) - 1);
      if (t->dtype == kBin) {
        v = raw ? -1 : 1;
      } else if (t->dtype == kI4 || t->dtype == kI2) {
        v = raw >= (1 << (bits - 1)) ? raw - (1 << bits) : raw;
      } else {
        v = raw;
      }
    }
    t->values[i] = v;
  }
  const int64_t used_bits = numel * bits;
  if (used_bits % 8 != 0) {
    const uint8_t last = p[size - 1];
    FMT_CHECK((last >> (used_bits % 8)) == 0, "constant '%s' has nonzero padding bits", t->name.c_str());
  }
  return Status::Ok();
}

}  // namespace

Status LoadGraph(const uint8_t* data, int64_t size, std::unique_ptr<Graph>* out) {
  FMT_CHECK(data != nullptr || size == 0, "null data");
  FMT_CHECK(size >= 68, "file is %lld bytes, shorter than the 68-byte minimum", (long long)size);
  FMT_CHECK(std::memcmp(data, "QDSLGRPH", 8) == 0, "bad magic (not a .qgraph file)");
  Reader h(data, 8, 64);
  uint32_t version = 0, flags = 0;
  uint64_t table_offset = 0, table_size = 0, data_offset = 0, data_size = 0, file_size = 0, zero = 0;
  QDSL_RETURN_IF_ERROR(h.Read(&version));
  QDSL_RETURN_IF_ERROR(h.Read(&flags));
  QDSL_RETURN_IF_ERROR(h.Read(&table_offset));
  QDSL_RETURN_IF_ERROR(h.Read(&table_size));
  QDSL_RETURN_IF_ERROR(h.Read(&data_offset));
  QDSL_RETURN_IF_ERROR(h.Read(&data_size));
  QDSL_RETURN_IF_ERROR(h.Read(&file_size));
  QDSL_RETURN_IF_ERROR(h.Read(&zero));
  FMT_CHECK(version == 1, "unsupported version %u (this runtime reads version 1)", version);
  FMT_CHECK(flags == 0 && zero == 0, "nonzero flags/reserved header bytes");
  FMT_CHECK(file_size == static_cast<uint64_t>(size), "header says %llu bytes, file has %lld",
            (unsigned long long)file_size, (long long)size);
  uint32_t crc = 0;
  std::memcpy(&crc, data + size - 4, 4);
  FMT_CHECK(crc == Crc32(data, size - 4), "CRC-32 mismatch (corrupt file)");
  const uint64_t usize = static_cast<uint64_t>(size);
  FMT_CHECK(table_offset == 64 && table_size <= usize && 64 + table_size <= usize - 4, "bad table section");
  FMT_CHECK(data_offset % 64 == 0 && data_offset >= 64 + table_size && data_offset <= usize - 4 &&
                data_size <= usize - 4 - data_offset && data_offset + data_size + 4 == usize,
            "inconsistent data section (offset %llu size %llu)", (unsigned long long)data_offset,
            (unsigned long long)data_size);

  auto g = std::make_unique<Graph>();
  Reader r(data, 64, 64 + static_cast<int64_t>(table_size));
  QDSL_RETURN_IF_ERROR(r.ReadString(&g->name, "graph name"));
  uint32_t n_tensors = 0;
  QDSL_RETURN_IF_ERROR(r.Read(&n_tensors));
  FMT_CHECK(static_cast<int64_t>(n_tensors) * 24 <= r.end() - r.pos(), "tensor count %u runs past the table",
            n_tensors);
  g->tensors.resize(n_tensors);
  std::map<std::string, int> names;
  for (uint32_t i = 0; i < n_tensors; ++i) {
    GraphTensor& t = g->tensors[i];
    QDSL_RETURN_IF_ERROR(r.ReadString(&t.name, "tensor name"));
    FMT_CHECK(names.emplace(t.name, i).second, "duplicate tensor name '%s'", t.name.c_str());
    uint8_t dtype = 0, is_const = 0, rank = 0, reserved = 0;
    QDSL_RETURN_IF_ERROR(r.Read(&dtype));
    QDSL_RETURN_IF_ERROR(r.Read(&is_const));
    QDSL_RETURN_IF_ERROR(r.Read(&rank));
    QDSL_RETURN_IF_ERROR(r.Read(&reserved));
    FMT_CHECK(DTypeBits(dtype) > 0, "tensor '%s' has unknown dtype %d", t.name.c_str(), dtype);
    FMT_CHECK(is_const <= 1 && reserved == 0 && rank <= 8, "tensor '%s' has a bad record", t.name.c_str());
    t.dtype = dtype;
    t.is_constant = is_const == 1;
    t.dims.resize(rank);
    int64_t numel = 1;
    for (int d = 0; d < rank; ++d) {
      QDSL_RETURN_IF_ERROR(r.Read(&t.dims[d]));
      const bool dynamic = !t.is_constant && d == 0 && t.dims[d] == -1;
      FMT_CHECK(dynamic || (t.dims[d] >= 1 && t.dims[d] <= kMaxNumel), "tensor '%s' dim %d = %lld is invalid",
                t.name.c_str(), d, (long long)t.dims[d]);
      if (!dynamic) numel *= t.dims[d];
      FMT_CHECK(numel <= kMaxNumel, "tensor '%s' is too large", t.name.c_str());
    }
    uint64_t off = 0, psize = 0;
    QDSL_RETURN_IF_ERROR(r.Read(&off));
    QDSL_RETURN_IF_ERROR(r.Read(&psize));
    if (t.is_constant) {
      FMT_CHECK(off % 64 == 0 && off >= data_offset && psize <= data_size && off - data_offset <= data_size - psize,
                "constant '%s' payload (offset %llu, %llu bytes) is unaligned or outside the data section",
                t.name.c_str(), (unsigned long long)off, (unsigned long long)psize);
      QDSL_RETURN_IF_ERROR(DecodePayload(data + off, static_cast<int64_t>(psize), numel, &t));
    } else {
      FMT_CHECK(off == 0 && psize == 0, "activation '%s' has a payload", t.name.c_str());
      FMT_CHECK(rank >= 1, "activation '%s' has rank 0", t.name.c_str());
    }
  }
  QDSL_RETURN_IF_ERROR(r.ReadIndices(n_tensors, &g->inputs, "graph input"));
  QDSL_RETURN_IF_ERROR(r.ReadIndices(n_tensors, &g->outputs, "graph output"));
  uint32_t n_ops = 0;
  QDSL_RETURN_IF_ERROR(r.Read(&n_ops));
  FMT_CHECK(static_cast<int64_t>(n_ops) * 20 <= r.end() - r.pos(), "op count %u runs past the table", n_ops);
  g->ops.resize(n_ops);
  for (uint32_t i = 0; i < n_ops; ++i) {
    GraphOp& op = g->ops[i];
    uint16_t opcode = 0, reserved = 0;
    QDSL_RETURN_IF_ERROR(r.Read(&opcode));
    QDSL_RETURN_IF_ERROR(r.Read(&reserved));
    // an unassigned opcode below kMaxOpcode has a null row (op_schema.h)
    FMT_CHECK(opcode >= 1 && opcode <= kMaxOpcode && kOpSchemas[opcode].name != nullptr && reserved == 0,
              "op %u has unknown opcode %u", i, opcode);
    op.opcode = opcode;
    QDSL_RETURN_IF_ERROR(r.ReadString(&op.name, "op name"));
    QDSL_RETURN_IF_ERROR(r.ReadIndices(n_tensors, &op.inputs, "op input"));
    QDSL_RETURN_IF_ERROR(r.ReadIndices(n_tensors, &op.outputs, "op output"));
    uint32_t n_attrs = 0;
    QDSL_RETURN_IF_ERROR(r.Read(&n_attrs));
    FMT_CHECK(static_cast<int64_t>(n_attrs) * 5 <= r.end() - r.pos(), "op %u attribute count runs past the table", i);
    for (uint32_t a = 0; a < n_attrs; ++a) {
      std::string key;
      QDSL_RETURN_IF_ERROR(r.ReadString(&key, "attribute name"));
      uint8_t type = 0;
      QDSL_RETURN_IF_ERROR(r.Read(&type));
      Attr attr;
      attr.type = type;
      if (type == kAttrInt) {
        QDSL_RETURN_IF_ERROR(r.Read(&attr.i));
      } else if (type == kAttrFloat) {
        QDSL_RETURN_IF_ERROR(r.Read(&attr.f));
      } else if (type == kAttrInts) {
        uint32_t count = 0;
        QDSL_RETURN_IF_ERROR(r.Read(&count));
        FMT_CHECK(static_cast<int64_t>(count) * 8 <= r.end() - r.pos(), "op %u attribute '%s' runs past the table",
                  i, key.c_str());
        attr.ints.resize(count);
        for (uint32_t c = 0; c < count; ++c) QDSL_RETURN_IF_ERROR(r.Read(&attr.ints[c]));
      } else {
        return MakeStatus(StatusCode::kFormatError, "op %u attribute '%s' has unknown type %d", i, key.c_str(), type);
      }
      FMT_CHECK(op.attrs.emplace(key, std::move(attr)).second, "op %u has duplicate attribute '%s'", i, key.c_str());
    }
  }
  FMT_CHECK(r.pos() == r.end(), "%lld bytes left over after the op list", (long long)(r.end() - r.pos()));
  QDSL_RETURN_IF_ERROR(PrepareGraph(g.get()));
  *out = std::move(g);
  return Status::Ok();
}

std::vector<int64_t> ShapeFor(const GraphTensor& t, int64_t n) {
  std::vector<int64_t> s = t.dims;
  if (!t.is_constant && !s.empty() && s[0] == -1) s[0] = n;
  return s;
}

}  // namespace qdsl
