// MAXPOOL1D/2D, AVGPOOL1D/2D and GLOBAL_AVGPOOL (docs/qgraph.md §4.5).  Max pools keep the
// dtype (I8/U8/BIN) and padding never wins; average pools sum x - in_zp over the window's taps inside
// the input (padding adds 0) and rescale by the output stage (the divisor folded in).
#include <algorithm>
#include <vector>

#include "qdsl/aligned.h"
#include "runtime/ops/conv.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct PoolParams : OpParams {
  bool is_max = false;
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  int32_t in_zp = 0;
  StageData out;  // average pools
};

struct GlobalAvgpoolParams : OpParams {
  int64_t in_zp = 0;
  StageData out;
};

}  // namespace

Status PreparePool(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape_out) {
  std::vector<int64_t>& shape = *shape_out;
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  const int rank = (op.opcode == kMaxpool1d || op.opcode == kAvgpool1d) ? 1 : 2;
  const bool is_max = op.opcode == kMaxpool1d || op.opcode == kMaxpool2d;
  // BIN activations are held one ±1 int8 per element (as BINARIZE writes them), so a BIN
  // max pool is the int8 one (max of ±1 is +1 iff any tap inside the input is +1: BIN out)
  // and a BIN average pool sums the ±1 values (zero point 0) into an I8/U8 output stage
  const bool bin = x.dtype == kBin;
  OP_CHECK((IsInt8(x.dtype) || bin || (!is_max && x.dtype == kI32)) &&
               (IsInt8(out.dtype) || (is_max && bin)) && static_cast<int>(shape.size()) == 2 + rank,
           "pool needs an I8/U8/BIN (AVGPOOL: or I32) input of rank %d", 2 + rank);
  if (is_max) OP_CHECK(out.dtype == x.dtype, "MAXPOOL keeps its dtype");
  const auto& k = A.at("kernel").ints;
  const auto& s = A.at("stride").ints;
  const auto& p = A.at("padding").ints;
  std::vector<int64_t> d(rank, 1);
  if (is_max) d = A.at("dilation").ints;
  OP_CHECK(static_cast<int>(k.size()) == rank && static_cast<int>(s.size()) == rank &&
               static_cast<int>(p.size()) == rank && static_cast<int>(d.size()) == rank,
           "kernel/stride/padding/dilation need %d entries", rank);
  for (int i = 0; i < rank; ++i) {
    OP_CHECK(k[i] >= 1 && k[i] <= (1 << 20) && s[i] >= 1 && s[i] <= (1 << 20) && p[i] >= 0 && p[i] <= (1 << 20) &&
                 d[i] >= 1 && d[i] <= (1 << 20) && p[i] <= k[i] / 2,
             "bad pool window in dim %d", i);
    const int64_t len = shape[2 + i] + 2 * p[i] - d[i] * (k[i] - 1) - 1;
    OP_CHECK(len >= 0, "pool window larger than the input");
    shape[2 + i] = len / s[i] + 1;
  }
  auto pp = std::make_shared<PoolParams>();
  pp->is_max = is_max;
  pp->kh = rank == 2 ? k[0] : 1;
  pp->kw = k.back();
  pp->sh = rank == 2 ? s[0] : 1;
  pp->sw = s.back();
  pp->ph = rank == 2 ? p[0] : 0;
  pp->pw = p.back();
  pp->dh = rank == 2 ? d[0] : 1;
  pp->dw = d.back();
  if (!is_max) {
    int64_t lo, hi;
    DTypeRange(x.dtype, &lo, &hi);
    OP_CHECK(A.at("in_zp").i >= lo && A.at("in_zp").i <= hi, "in_zp outside the input dtype");
    pp->in_zp = static_cast<int32_t>(A.at("in_zp").i);
    QDSL_RETURN_IF_ERROR(ReadStage(op, index, shape[1], out.dtype, &pp->out));
  }
  op.prepared = std::move(pp);
  return Status::Ok();
}

// max of c[k0..k1) (a window clipped at the padding; k0 < k1 <= 3)
template <typename T>
T Max3Clipped(const T* c, int64_t k0, int64_t k1) {
  T m = c[k0];
  for (int64_t k = k0 + 1; k < k1; ++k) m = c[k] > m ? c[k] : m;
  return m;
}

// Output row oy of a max pool on NHWC pixels of C channels: out[ox][:] is the max over the
// window's taps inside the input (ry: rows [ry[0], ry[1]) of the row, rx: columns per output)
// of whole input pixels, loops over the channels that the compiler vectorizes.
template <typename T>
void MaxRowNhwc(const T* in, T* out, int64_t C, int64_t W, int64_t OW, int64_t y0, int64_t dh, const int64_t* ry,
                int64_t sw, int64_t pw, int64_t dw, const int64_t* rx) {
  for (int64_t ox = 0; ox < OW; ++ox) {
    T* __restrict d = out + ox * C;
    bool first = true;
    for (int64_t ky = ry[0]; ky < ry[1]; ++ky)
      for (int64_t kx = rx[2 * ox]; kx < rx[2 * ox + 1]; ++kx) {
        const T* __restrict s = in + ((y0 + ky * dh) * W + ox * sw - pw + kx * dw) * C;
        if (first) {
          for (int64_t ch = 0; ch < C; ++ch) d[ch] = s[ch];
          first = false;
        } else {
          for (int64_t ch = 0; ch < C; ++ch) d[ch] = s[ch] > d[ch] ? s[ch] : d[ch];
        }
      }
  }
}

Status RunPool(RunCtx& c, const GraphOp& op) {
  const PoolParams& pp = ParamsOf<PoolParams>(op);
  const bool is_max = pp.is_max;
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi), ys = c.Shape(yi);
  const int rank = static_cast<int>(xs.size()) - 2;
  const int64_t H = rank == 2 ? xs[2] : 1, W = xs.back(), OH = rank == 2 ? ys[2] : 1, OW = ys.back();
  const int64_t kh = pp.kh, kw = pp.kw, sh = pp.sh, sw = pp.sw, ph = pp.ph, pw = pp.pw, dh = pp.dh, dw = pp.dw;
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int64_t planes = xs[0] * xs[1];
  // NHWC tensors (Graph::nhwc: a pool's input and output may each be NHWC): the pool runs on
  // NCHW planes, an NHWC input transposed in and an NHWC output transposed out per image
  const bool in_nhwc = c.g->nhwc[xi] != 0, out_nhwc = c.g->nhwc[yi] != 0;
  // except a max pool from NHWC to NHWC (a ResNet's stem pool: the stem writes NHWC for it,
  // conv::GatheredWritesNhwc), which runs on the NHWC pixels themselves (MaxRowNhwc); at 224 x
  // 224 about 0.16 instead of 0.33 ms (CPU time, loaded machine), the stem ~0.1 ms slower
  const bool nhwc_max = is_max && in_nhwc && out_nhwc && rank == 2;
  const int64_t esize = xd == kI32 ? 4 : 1, HW = H * W, OHW = OH * OW;
  auto transpose = [&](const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {  // per image
    ParallelFor(static_cast<int>(xs[0]), [&](int b) {
      const int64_t off = b * rows * cols * esize;
      if (esize == 4) {
        conv::TransposeI32(reinterpret_cast<const int32_t*>(in + off), cols, rows, cols,
                           reinterpret_cast<int32_t*>(out + off), rows);
      } else {
        conv::TransposeBytes(in + off, cols, rows, cols, out + off, rows);
      }
    }, /*work=*/xs[0] * rows * cols * 4);
  };
  thread_local AlignedVector<uint8_t> in_planes, out_planes;
  if (in_nhwc && !nhwc_max) {
    in_planes.resize(static_cast<size_t>(planes * HW * esize));
    transpose(x, HW, xs[1], in_planes.data());
    x = in_planes.data();
  }
  uint8_t* const y_out = y;
  if (out_nhwc && !nhwc_max) {
    out_planes.resize(static_cast<size_t>(planes * OHW));
    y = out_planes.data();
  }
  const int32_t in_zp = pp.in_zp;
  const OutputStage* st = is_max ? nullptr : &pp.out.stage;
  // the taps inside the input per output row / column, once per op (padding taps never
  // win a max and contribute 0 to a sum)
  auto ranges = [](int64_t outs, int64_t in, int64_t stride, int64_t pad, int64_t k, int64_t dil) {
    std::vector<int64_t> r(2 * outs);
    for (int64_t o = 0; o < outs; ++o) {
      int64_t lo = 0, hi = k;
      while (lo < k && o * stride - pad + lo * dil < 0) ++lo;
      while (hi > lo && o * stride - pad + (hi - 1) * dil >= in) --hi;
      r[2 * o] = lo;
      r[2 * o + 1] = hi;
    }
    return r;
  };
  const std::vector<int64_t> ry = ranges(OH, H, sh, ph, kh, dh), rx = ranges(OW, W, sw, pw, kw, dw);
  if (nhwc_max) {  // I8/U8, or BIN held as +-1 int8; a task per output row
    const int64_t C = xs[1];
    ParallelFor(static_cast<int>(xs[0] * OH), [&](int t) {
      const int64_t b = t / OH, oy = t % OH;
      const int64_t* r = ry.data() + 2 * oy;
      if (xd == kU8) {
        MaxRowNhwc(x + b * HW * C, y + (b * OH + oy) * OW * C, C, W, OW, oy * sh - ph, dh, r, sw, pw, dw, rx.data());
      } else {
        MaxRowNhwc(reinterpret_cast<const int8_t*>(x) + b * HW * C, reinterpret_cast<int8_t*>(y) + (b * OH + oy) * OW * C,
                   C, W, OW, oy * sh - ph, dh, r, sw, pw, dw, rx.data());
      }
    }, /*work=*/planes * OHW * kh * kw);
    return Status::Ok();
  }
  auto plane = [&](auto tag, int64_t pl) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(x) + pl * H * W;
    for (int64_t oy = 0; oy < OH; ++oy) {
      for (int64_t ox = 0; ox < OW; ++ox) {
        int64_t acc = is_max ? INT64_MIN : 0;
        for (int64_t ky = ry[2 * oy]; ky < ry[2 * oy + 1]; ++ky) {
          const T* row = src + (oy * sh - ph + ky * dh) * W + (ox * sw - pw);
          if (is_max) {
            int32_t m = INT32_MIN;
            for (int64_t kx = rx[2 * ox]; kx < rx[2 * ox + 1]; ++kx) m = std::max<int32_t>(m, row[kx * dw]);
            acc = std::max<int64_t>(acc, m);
          } else {
            int64_t sum = 0;
            for (int64_t kx = rx[2 * ox]; kx < rx[2 * ox + 1]; ++kx) sum += row[kx * dw] - in_zp;
            acc += sum;
          }
        }
        const int64_t o = (pl * OH + oy) * OW + ox;
        y[o] = static_cast<uint8_t>(is_max ? acc : ApplyStage(acc, *st, pl % xs[1]));
      }
    }
  };
  // max pools: the taps inside the input are a product (valid rows x valid columns), so each
  // output row takes the column-wise max of its valid input rows once (byte loops the
  // compiler vectorizes), then its valid columns' taps from that row: kh passes over a row
  // plus kw reads per output instead of a clipped kh x kw window per output (the generic
  // loop cost a ResNet's stem pool more than a 3x3 conv of its size)
  auto max_plane = [&](auto tag, int64_t pl) {
    using T = decltype(tag);
    // locals, not the captured references: stores through T* (a char type) may alias
    // them, which made the compiler reload the bounds per byte and vectorize nothing
    const int64_t W_ = W, OH_ = OH, OW_ = OW, sh_ = sh, sw_ = sw, ph_ = ph, pw_ = pw, dh_ = dh, dw_ = dw, kw_ = kw;
    const int64_t* ry_ = ry.data();
    const int64_t* rx_ = rx.data();
    const T* src = reinterpret_cast<const T*>(x) + pl * H * W_;
    T* dst = reinterpret_cast<T*>(y) + pl * OH_ * OW_;
    thread_local std::vector<T> col;
    col.resize(static_cast<size_t>(W_));
    T* __restrict cm = col.data();
    for (int64_t oy = 0; oy < OH_; ++oy) {
      const int64_t y0 = oy * sh_ - ph_;
      const T* r0 = src + (y0 + ry_[2 * oy] * dh_) * W_;
      for (int64_t i = 0; i < W_; ++i) cm[i] = r0[i];
      for (int64_t ky = ry_[2 * oy] + 1; ky < ry_[2 * oy + 1]; ++ky) {
        const T* __restrict r = src + (y0 + ky * dh_) * W_;
        for (int64_t i = 0; i < W_; ++i) cm[i] = r[i] > cm[i] ? r[i] : cm[i];
      }
      T* __restrict d = dst + oy * OW_;
      int64_t ox = 0;
      if (kw_ == 3 && dw_ == 1) {  // the common 3-wide window: full windows without the range loop
        for (; ox < OW_ && rx_[2 * ox] != 0; ++ox) d[ox] = Max3Clipped(cm + ox * sw_ - pw_, rx_[2 * ox], rx_[2 * ox + 1]);
        for (; ox < OW_ && rx_[2 * ox + 1] == 3; ++ox) {
          const T* c0 = cm + ox * sw_ - pw_;
          const T a = c0[0] > c0[1] ? c0[0] : c0[1];
          d[ox] = a > c0[2] ? a : c0[2];
        }
      }
      for (; ox < OW_; ++ox) {
        const T* c0 = cm + ox * sw_ - pw_;
        const int64_t k0 = rx_[2 * ox], k1 = rx_[2 * ox + 1];
        T m = c0[k0 * dw_];
        for (int64_t kx = k0 + 1; kx < k1; ++kx) m = c0[kx * dw_] > m ? c0[kx * dw_] : m;
        d[ox] = m;
      }
    }
  };
  // blocks of planes per task (the claim of a task costs more than a small plane)
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(planes, 4096 / std::max<int64_t>(OH * OW * kh * kw, 1)));
  ParallelFor(static_cast<int>((planes + block - 1) / block), [&](int bi) {
    for (int64_t pl = bi * block, pe = std::min(planes, pl + block); pl < pe; ++pl) {
      if (is_max) {  // I8/U8, or BIN held as +-1 int8 (PreparePool)
        if (xd == kU8) {
          max_plane(uint8_t{}, pl);
        } else {
          max_plane(int8_t{}, pl);
        }
      } else if (xd == kU8) {
        plane(uint8_t{}, pl);
      } else if (xd == kI32) {
        plane(int32_t{}, pl);
      } else {
        plane(int8_t{}, pl);
      }
    }
  }, /*work=*/planes * OH * OW * kh * kw * 4);
  if (out_nhwc) {  // I8/U8 outputs
    const uint8_t* planes_y = y;
    ParallelFor(static_cast<int>(xs[0]), [&](int b) {
      conv::TransposeBytes(planes_y + b * xs[1] * OHW, OHW, xs[1], OHW, y_out + b * OHW * xs[1], xs[1]);
    }, /*work=*/planes * OHW * 4);
  }
  return Status::Ok();
}

Status PrepareGlobalAvgpool(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  // GLOBAL_AVGPOOL also reads a layer's wide I32 output and BIN (one ±1 int8 per element)
  // activations (docs/qgraph.md §4.4)
  OP_CHECK((IsInt8(x.dtype) || x.dtype == kI32 || x.dtype == kBin) && IsInt8(out.dtype),
           "input and output must be I8/U8 (GLOBAL_AVGPOOL input: or I32/BIN)");
  int64_t lo, hi;
  DTypeRange(x.dtype, &lo, &hi);
  const int64_t in_zp = op.attrs.at("in_zp").i;
  OP_CHECK(in_zp >= lo && in_zp <= hi, "in_zp outside the input dtype");
  auto p = std::make_shared<GlobalAvgpoolParams>();
  p->in_zp = in_zp;
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, shape->size() >= 2 ? (*shape)[1] : 1, out.dtype, &p->out));
  OP_CHECK(shape->size() >= 3, "GLOBAL_AVGPOOL needs rank >= 3");
  for (size_t d = 2; d < shape->size(); ++d) (*shape)[d] = 1;
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunGlobalAvgpool(RunCtx& c, const GraphOp& op) {
  const GlobalAvgpoolParams& p = ParamsOf<GlobalAvgpoolParams>(op);
  const uint32_t xi = op.inputs[0], yi = op.outputs[0];
  const std::vector<int64_t> xs = c.Shape(xi);
  const int64_t n = Numel(xs);
  const int xd = c.DType(xi);
  const uint8_t* x = c.Buf(xi);
  uint8_t* y = c.Buf(yi);
  const int64_t planes = xs[0] * xs[1], sp = n / planes;
  const int64_t zp = p.in_zp;
  if (c.g->nhwc[xi]) {  // NHWC input: per image, the sums of its sp rows of C channels (the
    // output [N][C][1...] is the same in either layout)
    const int64_t C = xs[1];
    ParallelFor(static_cast<int>(xs[0]), [&](int b) {
      std::vector<int64_t> acc(static_cast<size_t>(C), 0);
      std::vector<int32_t> a32(static_cast<size_t>(C), 0);
      // int32 partial sums over at most 2^23 rows of bytes (exact), then int64
      for (int64_t r0 = 0; r0 < sp; r0 += int64_t{1} << 23) {
        const int64_t r1 = std::min(sp, r0 + (int64_t{1} << 23));
        std::fill(a32.begin(), a32.end(), 0);
        int32_t* __restrict s32 = a32.data();
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t at = (b * sp + r) * C;
          if (xd == kU8) {
            const uint8_t* __restrict row = x + at;
            for (int64_t ch = 0; ch < C; ++ch) s32[ch] += row[ch];
          } else if (xd == kI32) {
            const int32_t* row = reinterpret_cast<const int32_t*>(x) + at;
            for (int64_t ch = 0; ch < C; ++ch) acc[ch] += row[ch];
          } else {
            const int8_t* __restrict row = reinterpret_cast<const int8_t*>(x) + at;
            for (int64_t ch = 0; ch < C; ++ch) s32[ch] += row[ch];
          }
        }
        for (int64_t ch = 0; ch < C; ++ch) acc[ch] += a32[ch];
      }
      for (int64_t ch = 0; ch < C; ++ch)
        y[b * C + ch] = static_cast<uint8_t>(ApplyStage(acc[ch] - zp * sp, p.out.stage, ch));
    }, /*work=*/n);
    return Status::Ok();
  }
  // blocks of planes per task: one task per plane made 2 threads slower than one
  // (2048 planes of 256 bytes: 0.24 vs 0.10 ms), the claim of a task costs more than its sum
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(planes, 16384 / std::max<int64_t>(sp, 1)));
  const bool small = sp <= (int64_t{1} << 23);  // byte sums fit int32 (|x| <= 255)
  ParallelFor(static_cast<int>((planes + block - 1) / block), [&](int bi) {
    for (int64_t pl = bi * block, pe = std::min(planes, pl + block); pl < pe; ++pl) {
      int64_t acc = 0;  // per-dtype loops: sums the compiler vectorizes
      if (xd == kU8 && small) {
        const uint8_t* src = x + pl * sp;
        int32_t a32 = 0;
        for (int64_t j = 0; j < sp; ++j) a32 += src[j];
        acc = a32;
      } else if (xd == kU8) {
        const uint8_t* src = x + pl * sp;
        for (int64_t j = 0; j < sp; ++j) acc += src[j];
      } else if (xd == kI32) {
        const int32_t* src = reinterpret_cast<const int32_t*>(x) + pl * sp;
        for (int64_t j = 0; j < sp; ++j) acc += src[j];
      } else if (small) {
        const int8_t* src = reinterpret_cast<const int8_t*>(x) + pl * sp;
        int32_t a32 = 0;
        for (int64_t j = 0; j < sp; ++j) a32 += src[j];
        acc = a32;
      } else {
        const int8_t* src = reinterpret_cast<const int8_t*>(x) + pl * sp;
        for (int64_t j = 0; j < sp; ++j) acc += src[j];
      }
      acc -= zp * sp;
      y[pl] = static_cast<uint8_t>(ApplyStage(acc, p.out.stage, pl % xs[1]));
    }
  }, /*work=*/n);  // a vectorized sum: serial below 4M elements (the input is often in the other core's cache)
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kMaxpool1dDef = {PreparePool, RunPool, ValueRange::kInput};
const OpDef kMaxpool2dDef = {PreparePool, RunPool, ValueRange::kInput};
const OpDef kAvgpool1dDef = {PreparePool, RunPool, ValueRange::kStage};
const OpDef kAvgpool2dDef = {PreparePool, RunPool, ValueRange::kStage};
const OpDef kGlobalAvgpoolDef = {PrepareGlobalAvgpool, RunGlobalAvgpool, ValueRange::kStage};

}  // namespace qdsl
