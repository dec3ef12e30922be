// AVX512-VNNI (EVEX, ymm with AVX512VL) build of the 6 x 16 vpdpbusd micro-kernels, for CPUs
// without the VEX-encoded AVX-VNNI (e.g. AMD Zen 4).  Same code and results as
// gemm_u8s8_6x16_avxvnni.cc; the body is gemm_u8s8_6x16_vnni.h.
#pragma GCC target("avx2,fma,avx512f,avx512vl,avx512vnni")
#define QDSL_DPBUSD _mm256_dpbusd_epi32
#define QDSL_VNNI_U8S8 GemmU8S8Avx512Vnni
#define QDSL_VNNI_S8U8 GemmS8U8Avx512Vnni
#define QDSL_VNNI_U8S8_INIT GemmU8S8InitAvx512Vnni
#include "kernels/x86/gemm_u8s8_6x16_vnni.h"
