// Path selection and the Select* functions (see dispatch.h).
#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "kernels/portable/portable_kernels.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QDSL_HAVE_X86 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels/x86/x86_kernels.h"
#endif

namespace qdsl {
namespace {

std::atomic<uint32_t> enabled_override{0};

uint32_t EnvPaths() {
  const char* env = std::getenv("QDSL_KERNELS");
  if (env == nullptr || *env == 0 || std::strcmp(env, "auto") == 0) return ~0u;
  if (std::strcmp(env, "reference") == 0 || std::strcmp(env, "ref") == 0) return kPathRef;
  if (std::strcmp(env, "portable") == 0) return kPathRef | kPathPortable;
  if (std::strcmp(env, "avx2") == 0) return kPathRef | kPathPortable | kPathAvx2;
  if (std::strcmp(env, "avxvnni") == 0) return kPathRef | kPathPortable | kPathAvx2 | kPathAvxVnni;
  if (std::strcmp(env, "avx512") == 0) return ~0u & ~static_cast<uint32_t>(kPathAmx);
  if (std::strcmp(env, "amx") == 0) return ~0u;
  return ~0u;  // unknown values are reported by the Python layer, not here
}

#ifdef QDSL_HAVE_X86
// AMX-TILE + AMX-INT8 (CPUID.(EAX=7, ECX=0):EDX bits 24, 25), and the kernel's permission
// to use the tile data state: Linux enables it per process on request (ARCH_REQ_XCOMP_PERM
// = 0x1023, XFEATURE_XTILEDATA = 18); without it the first tile instruction faults.
bool AmxUsable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}
#endif

// Kernels other than the int GEMM treat the AMX path as the AVX-512 one.
inline uint32_t Base(uint32_t path) { return path == kPathAmx ? static_cast<uint32_t>(kPathAvx512) : path; }

uint32_t HighestBit(uint32_t mask) {
  uint32_t best = 0;
  for (uint32_t b = 1; b != 0 && b <= mask; b <<= 1) {
    if (mask & b) best = b;
  }
  return best;
}

}  // namespace

uint32_t CompiledPaths() {
#ifdef QDSL_HAVE_X86
  return kPathRef | kPathPortable | kPathAvx2 | kPathAvxVnni | kPathAvx512 | kPathAmx;
#else
  return kPathRef | kPathPortable;
#endif
}

namespace {
// EVEX VNNI: AVX512_VNNI with AVX512VL (+ F, BW) has vpdpbusd on ymm registers, EVEX-encoded;
// some CPUs (AMD Zen 4) have only that form, not the VEX-encoded AVX-VNNI, so the runtime's
// VNNI paths (kPathAvxVnni / kPathAvx512) are not detected there and the AVX2 path runs.
// QDSL_EVEX_VNNI (read once per process), on a CPU with the instructions:
//   unset / "1" / anything else: the AVX2 path runs its u8*s8 kernels as vpdpbusd (the int
//     GEMM's quad kernel, the implicit-GEMM conv and the NHWC depthwise quad kernel), and
//     picks them for full-range 8-bit activations too: vpdpbusd's sums are exact mod 2^32
//     for any u8 codes, so no activation bound is needed (EvexVnniUsable);
//   "0": off (the vpmaddubsw / int16 kernels; QDSL_IGEMM_VNNI=0, its earlier name, too);
//   "paths": also enables kPathAvxVnni / kPathAvx512 with the EVEX build of the VNNI GEMM
//     kernels (every op on those paths; their convs are not the channels-last AVX2 ones).
enum EvexMode { kEvexOff, kEvexAvx2, kEvexPaths };
int EvexVnniMode() {
#ifdef QDSL_HAVE_X86
  static const int mode = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")))
      return static_cast<int>(kEvexOff);
    const char* env = std::getenv("QDSL_EVEX_VNNI");
    const char* old = std::getenv("QDSL_IGEMM_VNNI");
    if ((env != nullptr && std::strcmp(env, "0") == 0) || (old != nullptr && std::strcmp(old, "0") == 0))
      return static_cast<int>(kEvexOff);
    if (env != nullptr && std::strcmp(env, "paths") == 0) {
      unsigned a = 0, b = 0, c = 0, d = 0;  // AVX-VNNI: CPUID.(EAX=7, ECX=1):EAX bit 4
      const bool avx_vnni = __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1);
      if (!avx_vnni) return static_cast<int>(kEvexPaths);
    }
    return static_cast<int>(kEvexAvx2);
  }();
  return mode;
#else
  return kEvexOff;
#endif
}
// The VNNI paths run the EVEX build of their kernels (QDSL_EVEX_VNNI=paths on such a CPU).
bool EvexVnniOnly() { return EvexVnniMode() == kEvexPaths; }
}  // namespace

bool EvexVnniUsable() { return EvexVnniMode() != kEvexOff; }

namespace {
// CPUID traps to the hypervisor on virtual machines (tens of microseconds), so the CPU
// is probed once per process.
uint32_t DetectCpuPaths() {
  uint32_t paths = kPathRef | kPathPortable;
#ifdef QDSL_HAVE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("popcnt")) {
    paths |= kPathAvx2;
    // AVX-VNNI is CPUID.(EAX=7, ECX=1):EAX bit 4 (gcc 12's __builtin_cpu_supports misses it).
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool avx_vnni = __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1);
    const bool vnni = avx_vnni || EvexVnniOnly();
    if (vnni) paths |= kPathAvxVnni;
    // kPathAvx512 also uses the VNNI int kernels, so it needs them too
    if (vnni && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vpopcntdq")) {
      paths |= kPathAvx512;
      if (AmxUsable()) paths |= kPathAmx;
    }
  }
#endif
  return paths;
}
}  // namespace

uint32_t CpuPaths() {
  static const uint32_t paths = DetectCpuPaths();
  return paths;
}

uint32_t EnabledPaths() {
  static const uint32_t env = EnvPaths();
  const uint32_t over = enabled_override.load();
  return (CompiledPaths() & CpuPaths() & (over ? over : env)) | kPathRef;
}

void SetEnabledPaths(uint32_t mask) { enabled_override.store(mask); }

Status ResolvePath(uint32_t requested, uint32_t* chosen) {
  if (requested == 0) {
    *chosen = HighestBit(EnabledPaths());
    return Status::Ok();
  }
  const uint32_t runnable = requested & CompiledPaths() & CpuPaths();
  QDSL_CHECK(runnable != 0, StatusCode::kUnsupported,
             "requested kernel path mask 0x%x cannot run here (compiled 0x%x, cpu 0x%x)", requested,
             CompiledPaths(), CpuPaths());
  *chosen = HighestBit(runnable);
  return Status::Ok();
}

VnniMicroKernel SelectVnniMicroKernel(bool broadcast_unsigned, uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if ((path == kPathAvxVnni || path == kPathAvx512) && EvexVnniOnly())
    return broadcast_unsigned ? x86::GemmU8S8Avx512Vnni : x86::GemmS8U8Avx512Vnni;
  if (path == kPathAvxVnni || path == kPathAvx512)
    return broadcast_unsigned ? x86::GemmU8S8AvxVnni : x86::GemmS8U8AvxVnni;
#endif
  (void)broadcast_unsigned;
  (void)path;
  return nullptr;
}

VnniInitKernel SelectQuadInitKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if ((path == kPathAvxVnni || path == kPathAvx512) && EvexVnniOnly()) return x86::GemmU8S8InitAvx512Vnni;
  if (path == kPathAvxVnni || path == kPathAvx512) return x86::GemmU8S8InitAvxVnni;
  if (path == kPathAvx2 && EvexVnniUsable()) return x86::GemmU8S8InitAvx512Vnni;
#endif
  (void)path;
  return nullptr;
}

IgemmKernel SelectIgemmKernel(uint32_t path, bool int16) {
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2) return int16 ? x86::IgemmU8I16Avx2 : (EvexVnniUsable() ? x86::IgemmU8S8Avx512Vnni : x86::IgemmU8S8Avx2);
#endif
  (void)path;
  (void)int16;
  return nullptr;
}

bool IgemmRunsVnni(uint32_t path) {
#ifdef QDSL_HAVE_X86
  return path == kPathAvx2 && EvexVnniUsable();
#else
  (void)path;
  return false;
#endif
}

IgemmStageKernel SelectIgemmStageKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2) return EvexVnniUsable() ? x86::IgemmU8S8StageAvx512Vnni : x86::IgemmU8S8StageAvx2;
#endif
  (void)path;
  return nullptr;
}

IgemmStageTwinKernel SelectIgemmStageTwinKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2 && EvexVnniUsable()) return x86::IgemmU8S8StageTwinAvx512Vnni;
#endif
  (void)path;
  return nullptr;
}

IgemmStageAddKernel SelectIgemmStageAddKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2 && EvexVnniUsable()) return x86::IgemmU8S8StageAddAvx512Vnni;
#endif
  (void)path;
  return nullptr;
}

VnniMicroKernel SelectQuadMicroKernel(bool broadcast_unsigned, int maddubs_steps, uint32_t path) {
  if (VnniMicroKernel k = SelectVnniMicroKernel(broadcast_unsigned, path)) return k;
#ifdef QDSL_HAVE_X86
  // EVEX vpdpbusd on the AVX2 path: exact for any codes (the weights are int8 here)
  if (Base(path) == kPathAvx2 && EvexVnniUsable())
    return broadcast_unsigned ? x86::GemmU8S8Avx512Vnni : x86::GemmS8U8Avx512Vnni;
  if (Base(path) == kPathAvx2 && maddubs_steps >= 1) {
    const int s = maddubs_steps >= 8 ? 8 : (maddubs_steps >= 4 ? 4 : (maddubs_steps >= 2 ? 2 : 1));
    switch (s) {
      case 8: return broadcast_unsigned ? x86::GemmU8S8Avx2S8 : x86::GemmS8U8Avx2S8;
      case 4: return broadcast_unsigned ? x86::GemmU8S8Avx2S4 : x86::GemmS8U8Avx2S4;
      case 2: return broadcast_unsigned ? x86::GemmU8S8Avx2S2 : x86::GemmS8U8Avx2S2;
      default: return broadcast_unsigned ? x86::GemmU8S8Avx2S1 : x86::GemmS8U8Avx2S1;
    }
  }
#endif
  (void)broadcast_unsigned, (void)maddubs_steps, (void)path;
  return nullptr;
}

AmxKernel SelectAmxKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path == kPathAmx) return x86::GemmAmx;
#endif
  (void)path;
  return nullptr;
}

AmxGatherKernel SelectAmxGatherKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path == kPathAmx) return x86::GemmAmxGather;
#endif
  (void)path;
  return nullptr;
}

void UnpackPanelToVnni(int bits, const uint8_t* src, int64_t quads, uint8_t* dst, uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (Base(path) == kPathAvx512) {
    x86::UnpackPanelToVnniAvx512(bits, src, quads, dst);
  } else {
    x86::UnpackPanelToVnni(bits, src, quads, dst);
  }
#else
  (void)bits, (void)src, (void)quads, (void)dst, (void)path;
#endif
}

void PackU8QuadPanels(const uint8_t* rows, int64_t ld, int64_t kquads, int64_t npanels, int64_t panel_quads,
                      uint8_t* panels) {
#ifdef QDSL_HAVE_X86
  x86::PackU8QuadPanels(rows, ld, kquads, npanels, panel_quads, panels);
#else
  (void)rows, (void)ld, (void)kquads, (void)npanels, (void)panel_quads, (void)panels;
#endif
}

void PackI16PanelsGather(const uint8_t* base, const int64_t* tap, int64_t kpairs, const int64_t* pos,
                         int64_t npanels, uint8_t zu, int16_t* panels, uint32_t path) {
#ifdef QDSL_HAVE_X86
  const uint32_t b = Base(path);
  if (b == kPathAvx2 || b == kPathAvxVnni || b == kPathAvx512) {
    x86::PackI16PanelsGather(base, tap, kpairs, pos, npanels, zu, panels);
    return;
  }
#endif
  (void)path;
  for (int64_t q = 0; q < npanels; ++q)
    for (int64_t j = 0; j < kpairs; ++j) {
      int16_t* dst = panels + (q * kpairs + j) * 32;
      for (int i = 0; i < 16; ++i) {
        const int64_t o = pos[16 * q + i];
        dst[(i / 8) * 16 + 2 * (i % 8)] = static_cast<int16_t>(base[tap[2 * j] + o] - zu);
        dst[(i / 8) * 16 + 2 * (i % 8) + 1] = static_cast<int16_t>(base[tap[2 * j + 1] + o] - zu);
      }
    }
}

void PackU8QuadPanelsGather(const uint8_t* base, const int64_t* tap, int64_t kquads, const int64_t* pos,
                            int64_t npanels, uint8_t* panels) {
#ifdef QDSL_HAVE_X86
  x86::PackU8QuadPanelsGather(base, tap, kquads, pos, npanels, panels);
#else
  for (int64_t q = 0; q < npanels; ++q)
    for (int64_t j = 0; j < kquads; ++j)
      for (int i = 0; i < 16; ++i)
        for (int t = 0; t < 4; ++t) panels[(q * kquads + j) * 64 + i * 4 + t] = base[tap[4 * j + t] + pos[16 * q + i]];
#endif
}

IntMicroKernel SelectIntMicroKernel(PanelFormat format, uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2 || path == kPathAvxVnni || path == kPathAvx512) {  // the int16 kernels serve both
    switch (format) {
      case PanelFormat::kI16: return x86::GemmI16Avx2;
      case PanelFormat::kI4: return x86::GemmI4Avx2;
      case PanelFormat::kI2: return x86::GemmI2Avx2;
    }
  }
#endif
  switch (format) {  // portable fallback (also the kRef path never reaches here)
    case PanelFormat::kI4: return portable::GemmI4;
    case PanelFormat::kI2: return portable::GemmI2;
    default: return portable::GemmI16;
  }
}

namespace {
void StageI32Portable(const int32_t* acc, int64_t n, const OutputStage& one, int32_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = ApplyStage(acc[i], one, 0);
}
}  // namespace

namespace {
void StageI32RowsPortable(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage,
                          int64_t c0, int32_t* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = ApplyStage(acc[r * lda + c], stage, c0 + c);
}
}  // namespace

StageI32RowsKernel SelectStageI32RowsKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx512) return x86::StageI32RowsAvx512;
  if (path == kPathAvx2 || path == kPathAvxVnni) return x86::StageI32RowsAvx2;
#endif
  return StageI32RowsPortable;
}

AddKernel SelectAddKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx512) return x86::AddAvx512;
  if (path == kPathAvx2 || path == kPathAvxVnni || path == kPathAvx512) return x86::AddAvx2;
#endif
  (void)path;
  return nullptr;
}

MulKernel SelectMulKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::MulAvx2;  // every path from AVX2 up has AVX2
#endif
  (void)path;
  return nullptr;
}

QuantizeF32Kernel SelectQuantizeF32Kernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::QuantizeF32Avx2;  // every path from AVX2 up has AVX2
#endif
  (void)path;
  return nullptr;
}

FloorDivScaledKernel SelectFloorDivScaledKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::FloorDivScaledAvx2;  // every path from AVX2 up has AVX2 and FMA
#endif
  (void)path;
  return nullptr;
}

LayernormKernels SelectLayernormKernels(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return {x86::LayernormSumAvx2, x86::LayernormCenterAvx2, x86::LayernormNormalizeAvx2};
#endif
  (void)path;
  return {portable::LayernormSum, portable::LayernormCenter, portable::LayernormNormalize};
}

LutKernel SelectLutKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::LutU8Avx2;
#endif
  (void)path;
  return nullptr;
}

StageI32StridedKernel SelectStageI32StridedKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2 || path == kPathAvxVnni) return x86::RequantI32RowsAvx2;
#endif
  (void)path;
  return nullptr;
}

StageI32Kernel SelectStageI32Kernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx512) return x86::RequantI32Avx512;
  if (path == kPathAvx2 || path == kPathAvxVnni || path == kPathAvx512) return x86::RequantI32Avx2;
#endif
  (void)path;
  return StageI32Portable;
}

BinaryMicroKernel SelectBinaryColsKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx512) return x86::BinaryPopcountColsAvx512;
#endif
  (void)path;
  return nullptr;
}

BinaryMicroKernel SelectBinarySplitKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2 || path == kPathAvxVnni) return x86::BinaryPopcountSplitAvx2;
#endif
  (void)path;
  return nullptr;
}

BinaryMicroKernel SelectBinaryMicroKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx512) return x86::BinaryPopcountAvx512;
  if (path == kPathAvx2 || path == kPathAvxVnni) return x86::BinaryPopcountAvx2;
#endif
  return portable::BinaryPopcount;
}

RequantKernel SelectRequantKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx512) return x86::RequantAvx512;
  if (path == kPathAvx2 || path == kPathAvxVnni || path == kPathAvx512) return x86::RequantAvx2;
#endif
  return portable::Requant;
}

RequantAddKernel SelectRequantAddKernel(uint32_t path) {
  path = Base(path);
#ifdef QDSL_HAVE_X86
  if (path == kPathAvx2 || path == kPathAvxVnni || path == kPathAvx512) return x86::RequantAddAvx2;
#endif
  return nullptr;
}

DwConvKernel SelectDwConvKernel(const DwConvShape& s, uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2 && s.sw <= 2 && s.dw == 1) return x86::DwConvAvx2;  // every path from AVX2 up has AVX2
#endif
  (void)s, (void)path;
  return portable::DwConv;
}

DwNhwcKernel SelectDwNhwcKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::DwConvNhwcAvx2;  // every path from AVX2 up has AVX2
#endif
  (void)path;
  return portable::DwConvNhwc;
}

DwNhwcStageKernel SelectDwNhwcStageKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::DwConvNhwcStageAvx2;
#endif
  (void)path;
  return nullptr;
}

DwNhwcQuadKernel SelectDwNhwcQuadKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return EvexVnniUsable() ? x86::DwConvNhwcQuadAvx512Vnni : x86::DwConvNhwcQuadAvx2;
#endif
  (void)path;
  return nullptr;
}

StageAddRowsKernel SelectStageAddRowsKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::StageAddRowsAvx2;
#endif
  (void)path;
  return nullptr;
}

DwFillKernel SelectDwFillKernel(uint32_t path) {
#ifdef QDSL_HAVE_X86
  if (path >= kPathAvx2) return x86::DwFillPlaneAvx2;
#endif
  (void)path;
  return nullptr;
}

}  // namespace qdsl
