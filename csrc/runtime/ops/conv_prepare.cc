// Validation and weight packing of CONV1D/CONV2D/LINEAR and their binary forms.
//
// Exactness: the int GEMM accumulates in int32.  The exact sum S is needed (acc_bits
// wrap/saturate and overflow counts are defined on it), so a layer uses the GEMM only
// when K * max|x - in_zp| * max|W - w_zp| <= INT32_MAX (no partial sum can wrap); the
// bias is added afterwards in int64.  Otherwise the exact int64 reference path runs.
#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "runtime/ops/conv.h"

namespace qdsl {

namespace {

// Segments and VNNI weight panels of the AMX implicit-GEMM conv (see ConvParams::amx_conv).
void PrepareAmxConv(const GraphTensor& x, ConvParams* pp) {
  ConvParams& p = *pp;
  const int64_t C = p.cin, H = p.spatial == 2 ? x.dims[2] : 1, W = x.dims.back();
  p.amx_hp = H + 2 * p.ph;
  p.amx_wp = W + 2 * p.pw;
  struct Segment {
    int64_t off, len, ky, kx;  // kx = -1: the whole kernel row (dw == 1)
  };
  std::vector<Segment> segs;
  for (int64_t ky = 0; ky < p.kh; ++ky) {
    const int64_t row = ky * p.dh * p.amx_wp * C;
    if (p.dw == 1) {
      segs.push_back({row, p.kw * C, ky, -1});
    } else {
      for (int64_t kx = 0; kx < p.kw; ++kx) segs.push_back({row + kx * p.dw * C, C, ky, kx});
    }
  }
  p.amx_koff.clear();
  std::vector<std::pair<size_t, int64_t>> block_seg;  // (segment, first byte) per block
  for (size_t si = 0; si < segs.size(); ++si)
    for (int64_t b = 0; b < segs[si].len; b += 64) {
      p.amx_koff.push_back(segs[si].off + b);
      block_seg.emplace_back(si, b);
    }
  p.amx_kblocks = static_cast<int64_t>(p.amx_koff.size());
  p.amx_panels = (p.cout + 15) / 16;
  p.amx_w.assign(static_cast<size_t>(p.amx_panels * p.amx_kblocks * 1024), 0);
  const int64_t kdim = C * p.kh * p.kw;
  for (int64_t oc = 0; oc < p.cout; ++oc) {
    const int32_t* wrow = p.w_int[0].data() + oc * kdim;  // [c][ky][kx]
    uint8_t* panel = p.amx_w.data() + (oc / 16) * p.amx_kblocks * 1024;
    for (int64_t kb = 0; kb < p.amx_kblocks; ++kb) {
      const Segment& sg = segs[block_seg[kb].first];
      for (int64_t t = 0; t < 64; ++t) {
        const int64_t byte = block_seg[kb].second + t;
        if (byte >= sg.len) break;
        const int64_t kx = sg.kx >= 0 ? sg.kx : byte / C, c = sg.kx >= 0 ? byte : byte % C;
        const int32_t v = wrow[(c * p.kh + sg.ky) * p.kw + kx];
        // quad row t / 4, column oc % 16, byte t % 4
        panel[kb * 1024 + (t / 4) * 64 + (oc % 16) * 4 + t % 4] = static_cast<uint8_t>(static_cast<int8_t>(v));
      }
    }
  }
  p.amx_conv = true;
}

// The vpmaddubsw weights of an NHWC depthwise conv (ConvParams::dwq), from dw_taps and
// dwn_init, when they are exact for the input's codes: int8 weights whose pairs (taps 2k,
// 2k + 1 of a step, as the kernel pairs them) times in_max_code stay within int16.
void PrepareDepthwiseQuads(ConvParams* pp) {
  ConvParams& p = *pp;
  const int64_t C = p.cin, taps = p.kh * p.kw, steps = DwNhwcQuadSteps(taps), tp = steps * 4;
  const int64_t C32 = (C + 31) / 32 * 32;
  std::vector<int8_t> rows(static_cast<size_t>(C * tp), 0);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t t = 0; t < taps; ++t) {
      const int32_t v = p.dw_taps[c * taps + t];
      if (v < -128 || v > 127) return;
      rows[c * tp + t] = static_cast<int8_t>(v);
    }
  // (EVEX vpdpbusd on the AVX2 path, EvexVnniUsable: exact for any codes, no bound needed)
  if (!EvexVnniUsable() && MaddubsStepsFor(MaddubsPairBound(rows.data(), C, tp, tp), p.in_max_code) < 1) return;
  p.dwq_w.assign(static_cast<size_t>(C32 / 32 * steps * 128), 0);
  p.dwq_init.assign(static_cast<size_t>(C32), 0);
  const bool lone = taps % 4 == 1;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t slot = DwNhwcQuadSlot(c) % 32, r = slot / 8, dword = slot % 8;  // vector r's dword
    p.dwq_init[c / 32 * 32 + slot] = p.dwn_init[c];
    uint8_t* block = p.dwq_w.data() + c / 32 * steps * 128;
    for (int64_t t = 0; t < taps; ++t) {
      uint8_t* d = block + (t / 4) * 128 + r * 32 + dword * 4;
      if (lone && t == taps - 1) {  // the lone tap: an int16 (w, 0) pair per dword
        const uint16_t h = static_cast<uint16_t>(static_cast<int16_t>(p.dw_taps[c * taps + t]));
        d[0] = static_cast<uint8_t>(h), d[1] = static_cast<uint8_t>(h >> 8);
      } else {
        d[t % 4] = static_cast<uint8_t>(rows[c * tp + t]);
      }
    }
  }
  p.dwq = true;
}

// The depthwise conv's taps and vpmaddwd tap pairs (ConvParams::depthwise), from w_int:
// with one input channel per group, group gi's rows [og][kh * kw] are output channels
// gi * og + o in order.
void PrepareDepthwise(ConvParams* pp, bool x_u8) {
  ConvParams& p = *pp;
  const int64_t taps = p.kh * p.kw, npairs = (p.kw + 1) / 2;
  p.dw_taps.clear();
  for (const std::vector<int32_t>& rows : p.w_int) p.dw_taps.insert(p.dw_taps.end(), rows.begin(), rows.end());
  p.dw_pairs.assign(static_cast<size_t>(p.cout * p.kh * npairs), 0);
  for (int64_t oc = 0; oc < p.cout; ++oc)
    for (int64_t ky = 0; ky < p.kh; ++ky)
      for (int64_t kx = 0; kx < p.kw; ++kx) {
        // |W - w_zp| <= 511 (int32_exact): an int16
        const uint32_t v = static_cast<uint16_t>(static_cast<int16_t>(p.dw_taps[oc * taps + ky * p.kw + kx]));
        p.dw_pairs[(oc * p.kh + ky) * npairs + kx / 2] |= static_cast<int32_t>(v << (16 * (kx % 2)));
      }
  p.depthwise = true;
  if (p.cout != p.cin || !p.fast_stage || p.bin_out) return;
  const int64_t C = p.cin, cols = DwNhwcCols(C), np = (taps + 1) / 2;
  p.dwn_taps.assign(static_cast<size_t>(taps * cols), 0);
  p.dwn_pairs.assign(static_cast<size_t>(cols * np), 0);
  p.dwn_init.assign(static_cast<size_t>(cols), 0);
  for (int64_t c = 0; c < C; ++c) {
    int64_t sum = 0;
    for (int64_t t = 0; t < taps; ++t) {
      const int32_t v = p.dw_taps[c * taps + t];
      sum += v;
      p.dwn_taps[t * cols + c] = v;
      const uint32_t half = static_cast<uint16_t>(static_cast<int16_t>(v));  // |v| <= 511
      int32_t& pair = p.dwn_pairs[((c / 16) * np + t / 2) * 16 + kDwNhwcLane[c % 16]];
      pair = static_cast<int32_t>(static_cast<uint32_t>(pair) | (half << (16 * (t % 2))));
    }
    const int64_t init = (p.bias.empty() ? 0 : p.bias[c]) - int64_t{p.in_zp} * sum;
    p.dwn_init[c] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(init)));
  }
  p.dwn_zrow.assign(static_cast<size_t>(cols), static_cast<uint8_t>(p.in_zp));
  PrepareStageF32(p.out.stage, C, cols, &p.dwn_stage);
  p.dw_nhwc = true;
  if (x_u8 && p.dwn_stage.ok) PrepareDepthwiseQuads(&p);
}

// The implicit-GEMM conv's weight panels and start values (ConvParams::igemm), when the
// shape is one where it
// beats the gathered-panel conv (measured per op inside MobileNetV2 and ResNet-18, AVX2, with
// the NHWC depthwise convs between the 1x1 convs): K = taps x C >= 16 and O >= 24.  With the
// output stage applied from the kernel's registers (ig_stage) that includes MobileNetV2's
// 16 -> 96 expansion at 112 x 112 (~1.1 -> ~0.85 ms, and the stride-2 depthwise conv after
// it then runs NHWC: ~0.5 -> ~0.3 ms).  Its 32 -> 16 projection (O = 16) stays on the NCHW
// gathered conv: as an implicit-GEMM conv it would make the 32-channel 112 x 112 depthwise
// conv before it write NHWC, where the plane kernel is ~2x faster (on a Zen 4 with the EVEX
// VNNI kernels, QDSL_IGEMM_ALL=1 inside MobileNetV2 at batch 1: projection 0.148 -> 0.123 ms,
// depthwise conv 0.202 -> 0.231, the block's sum unchanged; CPU-time A/B under load).  The
// kernel kind: vpmaddubsw when it is exact on the weights for the input's codes (int8
// weights, MaddubsStepsFor >= 1), or it runs as EVEX vpdpbusd (EvexVnniUsable, any codes),
// else the int16 kind (|W - w_zp| <= 511: int32_exact), e.g. full-range 8-bit activations
// with any int8 weights.
void PrepareIgemm(const GraphTensor& x, const GraphTensor& out, ConvParams* pp) {
  ConvParams& p = *pp;
  // Kernel rows as taps (ConvParams::ig_rows) when C is off the multiples of 4 and a kernel
  // row is contiguous in NHWC (dw == 1, kw > 1): fewer K bytes (no per-tap padding to 4) and
  // row pointers.  That also takes convs with fewer than 8 input channels (an RGB stem: with
  // one k-quad per tap the kernel was spent on row pointer loads, measured slower on
  // MobileNetV2's stem; a 7 x 7 x 3 kernel row is 6 quads).
  // (one input channel: a depthwise conv too, left to conv_dw.cc's plane kernel)
  const bool by_rows = p.cin % 4 != 0 && p.cin > 1 && p.dw == 1 && p.kw > 1;
  if (p.groups != 1 || p.spatial != 2 || !p.fast_acc || (p.cin < 8 && !by_rows) || out.dtype == kBin) return;
  const int64_t cp = by_rows ? (p.kw * p.cin + 3) / 4 * 4 : (p.cin + 3) / 4 * 4;
  const int64_t taps = by_rows ? p.kh : p.kh * p.kw, kq = taps * cp / 4, O = p.cout;
  const bool pays = taps * cp >= 16 && O >= 24;
  // QDSL_IGEMM_ALL=1 (read when a graph is prepared): every eligible shape (tests)
  if (!pays && std::getenv("QDSL_IGEMM_ALL") == nullptr) return;
  const int64_t kdim = p.cin * p.kh * p.kw, panels = (O + 15) / 16;
  // the weights in K order [tap][byte] (zero past C, or past kw * C for kernel rows): its
  // pairs are the kernels' pairs.  Byte b of tap t is channel b (tap t = ky * kw + kx), or
  // for kernel rows tap column b / C, channel b % C (tap t = ky).
  std::vector<int16_t> rows(static_cast<size_t>(O * taps * cp), 0);
  std::vector<int8_t> rows8(static_cast<size_t>(O * taps * cp), 0);
  bool int8 = !p.w8.empty();
  const int64_t tap_bytes = by_rows ? p.kw * p.cin : p.cin;
  for (int64_t oc = 0; oc < O; ++oc)
    for (int64_t t = 0; t < taps; ++t)
      for (int64_t b = 0; b < tap_bytes; ++b) {
        const int64_t c = by_rows ? b % p.cin : b, k = by_rows ? t * p.kw + b / p.cin : t;  // k: ky * kw + kx
        const int32_t v = p.w_int[0][oc * kdim + c * p.kh * p.kw + k];  // |v| <= 511 (int32_exact)
        rows[(oc * taps + t) * cp + b] = static_cast<int16_t>(v);
        rows8[(oc * taps + t) * cp + b] = static_cast<int8_t>(v);
      }
  // (where the AVX2 path runs the kind as EVEX vpdpbusd, EvexVnniUsable, it is exact for any u8
  // codes: full-range 8-bit activations take it too, not the int16 kind)
  int8 = int8 && (EvexVnniUsable() ||
                  MaddubsStepsFor(MaddubsPairBound(rows8.data(), O, taps * cp, taps * cp), p.in_max_code) >= 1);
  if (int8) {
    p.ig_w.assign(static_cast<size_t>(panels * kq * 64), 0);
    for (int64_t oc = 0; oc < O; ++oc)
      for (int64_t k = 0; k < taps * cp; ++k)  // panel oc / 16, quad k / 4, column oc % 16, byte k % 4
        p.ig_w[((oc / 16) * kq + k / 4) * 64 + (oc % 16) * 4 + k % 4] = static_cast<uint8_t>(rows8[oc * taps * cp + k]);
  } else {
    // int16 panels: panel oc / 16, quad k / 4, pair (k % 4) / 2, column oc % 16, half k % 2
    p.ig_w.assign(static_cast<size_t>(panels * kq * 128), 0);
    int16_t* w16 = reinterpret_cast<int16_t*>(p.ig_w.data());
    for (int64_t oc = 0; oc < O; ++oc)
      for (int64_t k = 0; k < taps * cp; ++k)
        w16[((oc / 16) * kq + k / 4) * 64 + ((k % 4) / 2) * 32 + (oc % 16) * 2 + k % 2] = rows[oc * taps * cp + k];
  }
  const uint32_t zu = static_cast<uint32_t>(p.in_zp + (x.dtype == kI8 ? 128 : 0));
  p.ig_cinit.assign(static_cast<size_t>(panels * 16), 0);
  for (int64_t oc = 0; oc < O; ++oc) {  // mod 2^32 like the sums (no overflow: fast_acc)
    uint32_t rowsum = 0;
    for (int64_t k = 0; k < kdim; ++k) rowsum += static_cast<uint32_t>(p.w_int[0][oc * kdim + k]);
    p.ig_cinit[oc] = static_cast<int32_t>((p.bias.empty() ? 0u : static_cast<uint32_t>(p.bias[oc])) - zu * rowsum);
  }
  p.ig_cp = cp;
  p.ig_taps = taps;
  p.ig_rows = by_rows;
  p.ig_panels = panels;
  p.ig_int16 = !int8;
  // the register stage where the stage is a sizable share of the work (K <= 512: about 1/K of
  // the MACs per output); on ResNet-18's K >= 576 convs it measured 1-3 % slower than the
  // stage over int32 tiles (within noise, but never faster)
  // (the vpmaddubsw kind only: the stage kernel accumulates as IgemmU8S8Avx2 does)
  if (!p.ig_int16 && (out.dtype == kU8 || out.dtype == kI8) && taps * cp <= 512)
    PrepareStageF32(p.out.stage, O, panels * 16, &p.ig_stage);
  if (!p.ig_int16 && out.dtype == kI32 && taps * cp <= 512)
    PrepareStageI32Reg(p.out.stage, O, panels * 16, &p.ig_stage32);
  p.igemm = true;
}

}  // namespace

Status PrepareConv(Graph* g, GraphOp& op, int index, std::vector<int64_t>* out_shape) {
  auto params = std::make_shared<ConvParams>();
  op.prepared = params;
  ConvParams& p = *params;
  const bool binary = op.opcode == kBconv1d || op.opcode == kBconv2d || op.opcode == kBlinear;
  p.spatial = (op.opcode == kConv1d || op.opcode == kBconv1d) ? 1 : ((op.opcode == kConv2d || op.opcode == kBconv2d) ? 2 : 0);
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& w = g->tensors[op.inputs[1]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  OP_CHECK(binary ? x.dtype == kBin : (x.dtype == kI8 || x.dtype == kU8), "input dtype does not fit the op");
  OP_CHECK(w.is_constant && (binary ? w.dtype == kBin : (w.dtype != kF32 && w.dtype != kI32)),
           "weights must be a constant of a weight dtype");
  OP_CHECK(out.dtype == kI8 || out.dtype == kU8 || out.dtype == kI32 || out.dtype == kBin, "output must be I8/U8/I32/BIN");
  const int rank = p.spatial;
  // LINEAR reads (N, K) or (N, ..., K): features last, every leading position a row
  OP_CHECK((rank == 0 ? x.dims.size() >= 2 : static_cast<int>(x.dims.size()) == 2 + rank) &&
               static_cast<int>(w.dims.size()) == 2 + rank,
           "input/weight ranks must be %d", 2 + rank);
  p.cin = rank == 0 ? x.dims.back() : x.dims[1];
  p.cout = w.dims[0];
  if (rank > 0) {
    p.groups = A.at("groups").i;
    OP_CHECK(p.groups >= 1 && p.cin % p.groups == 0 && p.cout % p.groups == 0 && w.dims[1] * p.groups == p.cin,
             "groups=%lld does not divide C=%lld, O=%lld with weight dim 1 = %lld", (long long)p.groups,
             (long long)p.cin, (long long)p.cout, (long long)w.dims[1]);
    const auto& st = A.at("stride").ints;
    const auto& pd = A.at("padding").ints;
    const auto& dl = A.at("dilation").ints;
    OP_CHECK(static_cast<int>(st.size()) == rank && static_cast<int>(pd.size()) == rank &&
                 static_cast<int>(dl.size()) == rank, "stride/padding/dilation need %d entries", rank);
    for (int i = 0; i < rank; ++i)
      OP_CHECK(st[i] >= 1 && st[i] <= (1 << 20) && pd[i] >= 0 && pd[i] <= (1 << 20) && dl[i] >= 1 && dl[i] <= (1 << 20),
               "bad stride/padding/dilation");
    int64_t* ks[2] = {&p.kh, &p.kw};
    int64_t* ss[2] = {&p.sh, &p.sw};
    int64_t* ps[2] = {&p.ph, &p.pw};
    int64_t* ds[2] = {&p.dh, &p.dw};
    const int off = 2 - rank;  // 1-D convs use the W slot
    for (int i = 0; i < rank; ++i) {
      *ks[off + i] = w.dims[2 + i];
      *ss[off + i] = st[i];
      *ps[off + i] = pd[i];
      *ds[off + i] = dl[i];
      const int64_t len = x.dims[2 + i] + 2 * pd[i] - dl[i] * (w.dims[2 + i] - 1) - 1;
      OP_CHECK(len >= 0, "kernel larger than the padded input in spatial dim %d", i);
      (*out_shape)[2 + i] = len / st[i] + 1;
    }
  } else {
    OP_CHECK(w.dims[1] == p.cin, "LINEAR weight K=%lld but input K=%lld", (long long)w.dims[1], (long long)p.cin);
  }
  (*out_shape)[rank == 0 ? out_shape->size() - 1 : 1] = p.cout;
  if (op.inputs.size() == 3) {
    const GraphTensor& b = g->tensors[op.inputs[2]];
    OP_CHECK(b.is_constant && b.dtype == kI32 && b.dims.size() == 1 && b.dims[0] == p.cout, "bias must be I32 [O]");
    p.bias = b.values;
  }
  p.acc_bits = static_cast<int>(std::min<int64_t>(std::max<int64_t>(A.at("acc_bits").i, 0), 64));
  p.overflow_mode = static_cast<int>(A.at("overflow").i);
  OP_CHECK(A.at("acc_bits").i >= 2 && A.at("acc_bits").i <= 64, "acc_bits outside [2, 64]");
  OP_CHECK(p.acc_bits <= 32 || kHasWideRescale, "acc_bits %d > 32 needs a compiler with 128-bit integers", p.acc_bits);
  OP_CHECK(p.overflow_mode == 0 || p.overflow_mode == 1, "overflow must be 0 (wrap) or 1 (saturate)");
  p.bin_out = out.dtype == kBin;
  if (!p.bin_out) QDSL_RETURN_IF_ERROR(ReadStage(op, index, p.cout, out.dtype, &p.out));

  const int64_t og = p.cout / p.groups;
  const int64_t kdim = (p.cin / p.groups) * p.kh * p.kw;
  if (binary) {
    for (int64_t gi = 0; gi < p.groups; ++gi) {
      std::vector<int8_t> rows(static_cast<size_t>(og * kdim));
      for (int64_t i = 0; i < og * kdim; ++i) rows[i] = static_cast<int8_t>(w.values[gi * og * kdim + i]);
      p.packed.emplace_back();
      QDSL_RETURN_IF_ERROR(PackBinaryWeights(rows.data(), og, kdim, kdim, &p.packed.back()));
    }
    return Status::Ok();
  }
  int64_t xlo = x.dtype == kI8 ? -128 : 0, xhi = x.dtype == kI8 ? 127 : 255;
  p.in_zp = static_cast<int32_t>(A.at("in_zp").i);
  OP_CHECK(A.at("in_zp").i >= xlo && A.at("in_zp").i <= xhi, "in_zp outside the input dtype");
  const auto& wzp = A.at("w_zp").ints;
  OP_CHECK(wzp.size() == 1 || static_cast<int64_t>(wzp.size()) == p.cout, "w_zp needs 1 or O entries");
  for (int64_t v : wzp) OP_CHECK(std::llabs(v) <= 255, "w_zp %lld out of range", (long long)v);
  int64_t wmax = 0, wmin_signed = 0, wmax_signed = 0;
  for (int64_t gi = 0; gi < p.groups; ++gi) {
    std::vector<int32_t> vals(static_cast<size_t>(og * kdim));
    for (int64_t o = 0; o < og; ++o) {
      const int64_t oc = gi * og + o;
      const int64_t zp = wzp.size() == 1 ? wzp[0] : wzp[oc];
      for (int64_t k = 0; k < kdim; ++k) {
        const int64_t v = w.values[oc * kdim + k] - zp;
        vals[o * kdim + k] = static_cast<int32_t>(v);
        wmax = std::max<int64_t>(wmax, std::llabs(v));
        wmin_signed = std::min<int64_t>(wmin_signed, v);
        wmax_signed = std::max<int64_t>(wmax_signed, v);
      }
    }
    p.w_int.push_back(std::move(vals));
  }
  // the input's proven range (GraphTensor::value_min/max; padding taps read in_zp itself)
  xlo = std::max(xlo, x.value_min);
  xhi = std::min(xhi, x.value_max);
  const int64_t xmax = std::max(std::llabs(xlo - p.in_zp), std::llabs(xhi - p.in_zp));
  // the largest u8 code the kernels see (int8: value + 128), padding included
  p.in_max_code = static_cast<int32_t>(std::max<int64_t>(xhi, p.in_zp) + (x.dtype == kI8 ? 128 : 0));
  p.int32_exact = wmax <= 511 && kdim * xmax * wmax <= INT32_MAX;
  int64_t bmax = 0;
  for (int32_t b : p.bias) bmax = std::max<int64_t>(bmax, std::llabs(static_cast<int64_t>(b)));
  // no accumulator of acc_bits can overflow (so wrap/saturate and the overflow counts are
  // moot): |sum + bias| <= 2^(acc_bits - 1) - 1, e.g. a 24-bit accumulator with 4-bit weights
  // (and, for a wider accumulator, the int32 range: the fast stages rescale int32 sums, where
  // the wide rescale equals the int32 one)
  const int64_t acc_max = p.acc_bits >= 32 ? INT32_MAX : (int64_t{1} << (p.acc_bits - 1)) - 1;
  p.fast_acc = p.int32_exact && out.dtype != kBin && kdim * xmax * wmax + bmax <= acc_max;
  p.fast_stage = p.fast_acc && out.dtype != kI32;
  if (p.int32_exact && p.spatial > 0) {  // convs: weights are the broadcast (A) operand
    p.kp = (kdim + 3) / 4 * 4;
    for (int64_t gi = 0; gi < p.groups; ++gi) {
      std::vector<int16_t> rows(static_cast<size_t>(og * p.kp), 0);
      for (int64_t o = 0; o < og; ++o)
        for (int64_t k = 0; k < kdim; ++k) rows[o * p.kp + k] = static_cast<int16_t>(p.w_int[gi][o * kdim + k]);
      p.w16.push_back(std::move(rows));
    }
    if (p.groups == p.cin) PrepareDepthwise(&p, x.dtype == kU8);
    if (wmin_signed >= -128 && wmax_signed <= 127) {  // int8 rows for the VNNI/AMX convs (+ row sums)
      p.rowsum.assign(static_cast<size_t>(p.cout), 0);
      for (int64_t gi = 0; gi < p.groups; ++gi) {
        // rows padded with zeros to a multiple of 16 and K to 64: the AMX conv reads whole
        // 16-row x 64-byte tiles, each row on a cache line boundary
        p.kp64 = (p.kp + 63) / 64 * 64;
        AlignedVector<int8_t> rows(static_cast<size_t>((og + 15) / 16 * 16 * p.kp64), 0);
        for (int64_t o = 0; o < og; ++o)
          for (int64_t k = 0; k < kdim; ++k) {
            const int32_t v = p.w_int[gi][o * kdim + k];
            rows[o * p.kp64 + k] = static_cast<int8_t>(v);
            p.rowsum[gi * og + o] += v;
          }
        const int steps = MaddubsStepsFor(MaddubsPairBound(rows.data(), og, p.kp64, p.kp64), p.in_max_code);
        p.maddubs_steps = gi == 0 ? steps : std::min(p.maddubs_steps, steps);
        p.w8.push_back(std::move(rows));
      }
      if (p.groups == 1) PrepareAmxConv(x, &p);
    }
    PrepareIgemm(x, out, &p);
  } else if (p.int32_exact) {
    for (int64_t gi = 0; gi < p.groups; ++gi) {
      std::vector<int16_t> v16(p.w_int[gi].begin(), p.w_int[gi].end());
      p.packed.emplace_back();
      QDSL_RETURN_IF_ERROR(PackWeights(v16.data(), og, kdim, kdim, &p.packed.back()));
      // what Gemm derives from the input's code bound (ActView::max_code)
      const PackedWeights& pw = p.packed.back();
      const int steps = pw.colsum.empty() ? 0 : MaddubsStepsFor(pw.maddubs_pair, p.in_max_code);
      p.maddubs_steps = gi == 0 ? steps : std::min(p.maddubs_steps, steps);
    }
  }
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kConv1dDef = {PrepareConv, RunConvOp, ValueRange::kStage};
const OpDef kConv2dDef = {PrepareConv, RunConvOp, ValueRange::kStage};
const OpDef kLinearDef = {PrepareConv, RunConvOp, ValueRange::kStage};
const OpDef kBconv1dDef = {PrepareConv, RunConvOp, ValueRange::kStage};
const OpDef kBconv2dDef = {PrepareConv, RunConvOp, ValueRange::kStage};
const OpDef kBlinearDef = {PrepareConv, RunConvOp, ValueRange::kStage};

}  // namespace qdsl
