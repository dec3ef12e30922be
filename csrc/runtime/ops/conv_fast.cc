// IntConvFast: int convs with the weights as the broadcast GEMM operand and activation
// panels gathered from padded images (AVX2 int16 / vpmaddubsw, VNNI, AMX explicit).
#include <algorithm>
#include <cstdlib>
#include <utility>

#include "runtime/ops/add.h"
#include "runtime/ops/conv.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace conv {
namespace {

// First row of strip s when og rows are cut into StripRows' balanced strips.
int64_t StripStart(int64_t og, int64_t s) {
  const int64_t strips = (og + kMaxRows - 1) / kMaxRows, base = og / strips, extra = og % strips;
  return s * base + std::min(s, extra);
}

// Part `part` of `parts` near-equal parts of [0, total).
void Part(int64_t total, int64_t parts, int64_t part, int64_t* b, int64_t* e) {
  *b = total * part / parts;
  *e = total * (part + 1) / parts;
}

// Panels gathered and multiplied together (PanelGroup(bytes per panel)): the gather
// reads each tap row's cache line once for all of them, and each weight strip runs over
// all of them while it is in L1; at most 8 panels and ~256 KiB (they are read from L2).
int64_t PanelGroup(int64_t panel_bytes) {
  return std::max<int64_t>(1, std::min<int64_t>(8, (256 << 10) / std::max<int64_t>(1, panel_bytes)));
}

// Bytes of int32 sums per column tile (IntConvFast): with the tile's panels and output
// well inside a Zen 3 / Skylake-SP L2 (512 KB / 1 MB).  QDSL_ACC_TILE_KB overrides (tuning).
int64_t AccTileBytes() {
  static const int64_t bytes = [] {
    const char* v = std::getenv("QDSL_ACC_TILE_KB");
    const long kb = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
    return kb > 0 ? int64_t{kb} * 1024 : int64_t{256} * 1024;
  }();
  return bytes;
}

}  // namespace

// Int conv with the weights as the broadcast operand: acc[o][col] = W'[o][:] . X'[:, col],
// with the columns of several small images side by side (>= ~512 per GEMM), so the GEMM
// output rows are NCHW planes.  Two forms: VNNI (u8 codes, zero point via row sums:
// acc = sum x_u w' - z_u rowsum, mod 2^32 like the reference) and int16 vpmaddwd.  The
// stage runs vectorized per channel row when no overflow is possible (fast_acc), else
// element by element with the exact acc_bits rules.
Status IntConvFast(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
  const Geometry e = Geo(g, op, batch);
  const GraphTensor& xt = g->tensors[op.inputs[0]];
  const int out_dtype = g->tensors[op.outputs[0]].dtype;
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const int64_t P = e.OH * e.OW;
  // >= ~512 columns per GEMM, but at least two tasks per thread when the batch allows
  // (one task of 32 small images kept the second core idle)
  // work: the MACs plus ~64 per output and output stage (twins add theirs, see below)
  const int64_t stages = 1 + (p.fast_acc ? static_cast<int64_t>(p.twins.size()) : 0);
  const int64_t work = e.n * P * p.cout * (p.kp + 64 * stages);
  const int threads = ThreadsFor(work);
  const int64_t want = 2 * threads;
  const int64_t per_task =
      std::max<int64_t>(1, std::min<int64_t>({e.n, (512 + P - 1) / P, (e.n + want - 1) / want}));
  const int64_t chunks = (e.n + per_task - 1) / per_task;
  const int64_t kpairs = p.kp / 2, kquads = p.kp / 4;
  const IntMicroKernel kernel = SelectIntMicroKernel(PanelFormat::kI16, path);
  const VnniMicroKernel vnni = p.w8.empty() ? nullptr : SelectQuadMicroKernel(false, p.maddubs_steps, path);
  const AmxKernel amx = p.w8.empty() ? nullptr : SelectAmxKernel(path);
  const RequantKernel requant = SelectRequantKernel(path);
  const StageI32Kernel stage_i32 = SelectStageI32Kernel(path);
  const StageI32StridedKernel stage_i32_rows = SelectStageI32StridedKernel(path);
  const int64_t units = chunks * p.groups;  // (image chunk, group) pairs
  // Too few units to feed the threads (batch 1: one): each one-image unit is cut into
  // pieces of column panels (spatial tiles; no work repeated) and, when it has fewer
  // panels than pieces wanted (7 x 7 images), also of weight-row strips (each such piece
  // gathers its panels again).  Several pieces per thread, claimed dynamically, so a
  // thread slowed by another process on its core does not hold up the op: the others take
  // its share (kClaimsPerThread pieces per thread).  Pieces of at least kMinParallelWork / 8
  // (the gathers, stages and claims per piece stay small beside them).  The AMX form keeps whole units (its tiles are 16
  // rows x 16 columns and it already fills the cores at batch >= 2 threads).
  const int64_t cols1 = per_task * P, npanels1 = (cols1 + 15) / 16;
  const int64_t nstrips = (e.og + kMaxRows - 1) / kMaxRows;
  int64_t ctiles = 1, rblocks = 1;
  const int64_t want_pieces = int64_t{kClaimsPerThread} * threads;
  if (!amx && threads > 1 && per_task == 1 && units < want_pieces) {
    const int64_t pieces = std::min<int64_t>((want_pieces + units - 1) / units,
                                             std::max<int64_t>(1, work / units / (kMinParallelWork / 8)));
    ctiles = std::min(npanels1, pieces);
    rblocks = std::min(nstrips, (pieces + ctiles - 1) / ctiles);
  }
  const int64_t pieces = ctiles * rblocks;
  const int tasks = static_cast<int>(units * pieces);
  const int32_t zu = p.in_zp + (xt.dtype == kI8 ? 128 : 0);
  const uint8_t flip = xt.dtype == kI8 ? 0x80 : 0;
  // the padded images of units cut into pieces, shared by their pieces (padded here, once)
  // (their buffers are kept per calling thread: no allocation and page faults per run)
  std::vector<PaddedImages> shared(static_cast<size_t>(pieces > 1 ? units : 0));
  thread_local std::vector<std::vector<uint8_t>> shared_store;
  if (shared_store.size() < shared.size()) shared_store.resize(shared.size());
  for (int64_t u = 0; u < static_cast<int64_t>(shared.size()); ++u) {
    const int64_t b0 = (u / p.groups) * per_task, nb = std::min(per_task, e.n - b0);
    shared[u] = PadImagesU8(x, p, e, b0, nb, u % p.groups, flip, static_cast<uint8_t>(zu), p.kp, &shared_store[u]);
    shared[u].FillPositions(nb, e.OH, e.OW, (nb * P + 15) / 16 * 16);
  }
  const RequantAddKernel requant_add = SelectRequantAddKernel(path);
  std::vector<int64_t> counts(static_cast<size_t>(tasks), 0);
  // twin convs (ConvParams::twins) whose stages this run applies too: (op, output dtype)
  std::vector<std::pair<const GraphOp*, int>> twins;
  if (p.fast_acc)
    for (int32_t j : p.twins) {
      twins.emplace_back(&g->ops[j], g->tensors[g->ops[j].outputs[0]].dtype);
      g->fused_done[j] = 1;
    }
  // Residual ADD fused into this conv (ConvParams::fused_add; I32 output, fast stage): after
  // each tile's stage, its I32 values (written as usual, still in cache) go through AddRange
  // with the ADD's other input at the same elements into the ADD's output; the executor skips
  // the ADD.  Elementwise with per-tensor rescales, so pieces of the tensor compute what the
  // whole-tensor ADD does, bit for bit.
  const GraphOp* add = (p.fused_add >= 0 && out_dtype == kI32 && p.fast_acc) ? &g->ops[p.fused_add] : nullptr;
  const AddParams* add_p = add != nullptr ? &ParamsOf<AddParams>(*add) : nullptr;
  const uint8_t* add_other = nullptr;
  uint8_t* add_y = nullptr;
  int add_other_dtype = 0;
  int64_t add_other_size = 1;
  bool add_signed = false;
  if (add != nullptr) {
    const uint32_t other = add->inputs[1 - p.fused_slot];
    add_other = g->buffers[other].data();
    add_other_dtype = g->tensors[other].dtype;
    add_other_size = add_other_dtype == kI32 ? 4 : 1;
    add_y = g->buffers[add->outputs[0]].data();
    add_signed = g->tensors[add->outputs[0]].dtype == kI8;
    g->fused_done[p.fused_add] = 1;
  }
  // NHWC output (GatheredWritesNhwc; PlanNhwc chose it): each tile's codes go to a block
  // [image][channel row][column] and are transposed into the images' NHWC positions
  const bool nhwc_out = g->nhwc[op.outputs[0]] != 0;
  // the bias added inside the stage's pass (RequantAddKernel) when every output is I8/U8
  bool fold_bias = requant_add != nullptr && !p.bias.empty() && out_dtype != kI32;
  for (const auto& tw : twins) fold_bias = fold_bias && tw.second != kI32;
  ParallelFor(tasks, [&](int t) {
    const int64_t u = t / pieces, piece = t % pieces;
    const int64_t chunk = u / p.groups, gi = u % p.groups;
    const int64_t b0 = chunk * per_task, nb = std::min(per_task, e.n - b0);
    const int64_t cols_n = nb * P, Pp = (cols_n + 15) / 16 * 16, npanels = Pp / 16;
    // this piece: panels [p0, p1) x weight rows [r0, r1) (whole strips), run in column tiles [q0, q1)
    int64_t p0 = 0, p1 = 0, s0 = 0, s1 = 0;
    Part(npanels, ctiles, piece / rblocks, &p0, &p1);
    Part(nstrips, rblocks, piece % rblocks, &s0, &s1);
    if (p1 <= p0 || s1 <= s0) return;
    const int64_t r0 = StripStart(e.og, s0), r1 = StripStart(e.og, s1);
    PaddedImages own;
    const PaddedImages* pi = &own;
    if (pieces > 1) {
      pi = &shared[u];
    } else if (!amx) {  // both gathered forms below read padded images at these offsets
      own = PadImagesU8(x, p, e, b0, nb, gi, flip, static_cast<uint8_t>(zu), p.kp);
      own.FillPositions(nb, e.OH, e.OW, Pp);
    }
    // Column tiles of one image's panels, each through the GEMM and then the output stage
    // while its accumulators are still in L2 (whole images: at 112 x 112 the int32 sums of
    // all columns, e.g. 96 channels x 12544 x 4 B = 4.8 MB, left the cache before the stage
    // read them back).  Several images (nb > 1, small planes) and AMX keep one tile.
    int64_t tile = p1 - p0;
    if (!amx && nb == 1) tile = std::max<int64_t>(1, AccTileBytes() / ((r1 - r0) * 16 * 4));
    for (int64_t q0 = p0; q0 < p1; q0 += tile) {
      const int64_t q1 = std::min(p1, q0 + tile);
      const int64_t c0 = q0 * 16, c1 = std::min(cols_n, q1 * 16), ld = (q1 - q0) * 16;
      thread_local AlignedVector<int32_t> acc;
      const int64_t og16 = (e.og + 15) / 16 * 16;
      // grow only (as conv_dw.cc): a shrink made the next larger conv zero-fill its buffer
      const size_t need = static_cast<size_t>((amx ? og16 : r1 - r0) * ld);
      if (acc.size() < need) acc.resize(need);
      bool bias_done = false;
      if (amx) {  // whole units only: ld == Pp, rows [0, og)
        // AMX: s8 weight rows (A tiles) x u8 activation panels (B tiles, 16 quads per K
        // block, zero past K).  C starts at -z_u * rowsum (+ bias when no overflow is
        // possible), one 16 x 16 tile per 16 channels, so no pass over C remains.
        thread_local AlignedVector<uint8_t> cols8, panels8;
        thread_local AlignedVector<int32_t> cinit;
        const int64_t kblocks = p.kp64 / kAmxKBlock, kq16 = kblocks * 16;
        cols8.assign(static_cast<size_t>(p.kp * Pp), 0);
        panels8.resize(static_cast<size_t>(npanels * kq16 * 64));
        Im2colU8(x, p, e, b0, nb, gi, xt.dtype, static_cast<uint8_t>(zu), P, Pp, cols8.data());
        PackU8QuadPanels(cols8.data(), Pp, kquads, npanels, kq16, panels8.data());
        cinit.resize(static_cast<size_t>(og16 * 16));
        bias_done = p.fast_acc && !p.bias.empty();
        for (int64_t o = 0; o < og16; ++o) {
          const int64_t oc = gi * e.og + o;
          uint32_t v = 0;
          if (o < e.og) {
            v = (bias_done ? static_cast<uint32_t>(p.bias[oc]) : 0u) -
                static_cast<uint32_t>(zu) * static_cast<uint32_t>(p.rowsum[oc]);
          }
          for (int i = 0; i < 16; ++i) cinit[o * 16 + i] = static_cast<int32_t>(v);
        }
        amx(true, reinterpret_cast<const uint8_t*>(p.w8[gi].data()), p.kp64, og16 / 16, panels8.data(), kq16 * 64,
            npanels, kblocks, acc.data(), Pp, AmxInit::kRows, cinit.data());
      } else if (vnni) {
        // u8 quad panels gathered from padded images one panel at a time (as the int16 path
        // below; no im2col matrix).  K rows past kdim read offset 0 (their weights are 0).
        thread_local std::vector<uint8_t> panels8;
        const int64_t G = PanelGroup(kquads * 64);
        panels8.resize(static_cast<size_t>(G * kquads * 64));
        const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w8[gi].data());
        for (int64_t g0 = q0; g0 < q1; g0 += G) {
          const int64_t ng = std::min(G, q1 - g0);
          PackU8QuadPanelsGather(pi->base, pi->tap.data(), kquads, pi->pos.data() + 16 * g0, ng, panels8.data());
          for (int64_t o0 = r0, rows = 0; o0 < r1; o0 += rows) {
            rows = StripRows(e.og, o0);
            for (int64_t q = g0; q < g0 + ng; ++q)
              vnni(static_cast<int>(rows), w + o0 * p.kp64, p.kp64, panels8.data() + (q - g0) * kquads * 64, kquads,
                   acc.data() + (o0 - r0) * ld + (q - q0) * 16, ld, false);
          }
        }
        // one pass for the zero-point offset and (when no overflow is possible) the bias;
        // none when both are 0 (e.g. ReLU outputs with zero point 0 and no bias)
        bias_done = p.fast_acc && !p.bias.empty();
        for (int64_t o = r0; o < r1; ++o) {
          const int64_t oc = gi * e.og + o;
          const uint32_t corr = static_cast<uint32_t>(zu) * static_cast<uint32_t>(p.rowsum[oc]) -
                                (bias_done ? static_cast<uint32_t>(p.bias[oc]) : 0u);
          if (corr == 0) continue;
          int32_t* row = acc.data() + (o - r0) * ld;
          for (int64_t i = 0; i < c1 - c0; ++i) row[i] = static_cast<int32_t>(static_cast<uint32_t>(row[i]) - corr);
        }
      } else {
        // int16 pair panels (code - zu) gathered straight from the padded images: no im2col
        // matrix (its row copies cost more than the GEMM on small images).  Positions past
        // cols_n and K rows past kdim read offset 0: their products are dropped / times 0.
        thread_local std::vector<int16_t> panels;
        // one panel at a time, packed right before its row strips read it (from L1; packing
        // all panels first left them in L2 for the kernel)
        const int64_t G = PanelGroup(kpairs * 64);
        panels.resize(static_cast<size_t>(G * kpairs * 32));
        const int16_t* w = p.w16[gi].data();
        for (int64_t g0 = q0; g0 < q1; g0 += G) {
          const int64_t ng = std::min(G, q1 - g0);
          PackI16PanelsGather(pi->base, pi->tap.data(), kpairs, pi->pos.data() + 16 * g0, ng,
                              static_cast<uint8_t>(zu), panels.data(), path);
          for (int64_t o0 = r0, rows = 0; o0 < r1; o0 += rows) {
            rows = StripRows(e.og, o0);
            for (int64_t q = g0; q < g0 + ng; ++q)
              kernel(static_cast<int>(rows), w + o0 * p.kp, p.kp, reinterpret_cast<const uint8_t*>(panels.data()) +
                     (q - g0) * kpairs * 64, kpairs, acc.data() + (o0 - r0) * ld + (q - q0) * 16, ld, false);
          }
        }
      }
      // columns [c0, c1) of nb images: one image's span when cut into pieces (nb == 1),
      // else all nb * P columns (c0 == 0), P per image
      const int64_t len = (c1 - c0) / nb;
      thread_local AlignedVector<uint8_t> codes;
      if (nhwc_out) codes.resize(static_cast<size_t>(nb * (r1 - r0) * len));
      for (int64_t o = r0; o < r1; ++o) {
        const int64_t oc = gi * e.og + o;
        int32_t* row = acc.data() + (o - (amx ? 0 : r0)) * ld;
        if (p.fast_acc) {
          const bool add_bias = !p.bias.empty() && !bias_done;
          if (add_bias && !fold_bias)
            for (int64_t i = 0; i < c1 - c0; ++i) row[i] += p.bias[oc];
          // this op's stage, then each twin's on the same accumulators
          for (size_t tw = 0; tw <= twins.size(); ++tw) {
            const StageData& sd = tw == 0 ? p.out : ParamsOf<ConvParams>(*twins[tw - 1].first).out;
            const int dt = tw == 0 ? out_dtype : twins[tw - 1].second;
            uint8_t* dst = tw == 0 ? y : g->buffers[twins[tw - 1].first->outputs[0]].data();
            const Rescale& r = sd.stage.rescale;
            OutputStage one = sd.stage;
            const int64_t ch = r.channels == 1 ? 0 : oc;
            one.rescale.multiplier = r.multiplier + ch;
            one.rescale.shift = r.shift + ch;
            one.rescale.channels = 1;
            if (dt != kI32) {  // all nb images in one call: rows = images, output stride O * P
              if (nhwc_out) {  // (no twins: tw == 0)
                uint8_t* block = codes.data() + (o - r0) * len;
                const int64_t ldb = (r1 - r0) * len;
                if (add_bias && fold_bias) {
                  requant_add(row, nb, len, len, p.bias[oc], one, block, ldb, dt == kI8);
                } else {
                  requant(row, nb, len, len, one, 0, block, ldb, dt == kI8);
                }
                continue;
              }
              if (add_bias && fold_bias) {
                requant_add(row, nb, len, len, p.bias[oc], one, dst + (b0 * e.O + oc) * P + c0, e.O * P, dt == kI8);
              } else {
                requant(row, nb, len, len, one, 0, dst + (b0 * e.O + oc) * P + c0, e.O * P, dt == kI8);
              }
              continue;
            }
            int32_t* dst32 = reinterpret_cast<int32_t*>(dst) + (b0 * e.O + oc) * P + c0;
            if (stage_i32_rows != nullptr) {  // all nb images in one call, like requant above
              stage_i32_rows(row, nb, len, len, one, dst32, e.O * P);
            } else {
              for (int64_t bi = 0; bi < nb; ++bi) stage_i32(row + bi * len, len, one, dst32 + bi * e.O * P);
            }
          }
        } else {
          for (int64_t col = c0; col < c1; ++col) {
            const int64_t bi = col / P, i = col % P;
            Emit(row[col - c0], p, oc, y, out_dtype == kI32, ((b0 + bi) * e.O + oc) * P + i, &counts[t]);
          }
        }
      }
      if (nhwc_out) {  // columns [c0, c0 + len) of one image, or all P of nb images (c0 == 0)
        for (int64_t bi = 0; bi < nb; ++bi)
          TransposeBytes(codes.data() + bi * (r1 - r0) * len, len, r1 - r0, len,
                         y + ((b0 + bi) * P + (nb == 1 ? c0 : 0)) * e.O + r0, e.O);
      }
      if (add != nullptr) {
        // the fused ADD on the values just staged (still in cache): one call per image when
        // the tile spans whole images (its rows are then contiguous), else one per row
        const uint8_t* conv_out = y;
        auto add_block = [&](int64_t at, int64_t n) {
          const uint8_t* vb = conv_out + at * 4;
          const uint8_t* ob = add_other + at * add_other_size;
          AddRange(*add_p, p.fused_slot == 0 ? vb : ob, p.fused_slot == 0 ? kI32 : add_other_dtype,
                   p.fused_slot == 0 ? ob : vb, p.fused_slot == 0 ? add_other_dtype : kI32, n, add_y + at, add_signed,
                   path);
        };
        const int64_t ch0 = gi * e.og + r0;
        if (len == P) {
          for (int64_t bi = 0; bi < nb; ++bi) add_block(((b0 + bi) * e.O + ch0) * P, (r1 - r0) * P);
        } else {
          for (int64_t bi = 0; bi < nb; ++bi)
            for (int64_t o = r0; o < r1; ++o) add_block(((b0 + bi) * e.O + gi * e.og + o) * P + c0, len);
        }
      }
    }  // column tiles
  }, /*work=*/work);
  for (int64_t c : counts) *overflow += c;
  return Status::Ok();
}

}  // namespace conv
}  // namespace qdsl
