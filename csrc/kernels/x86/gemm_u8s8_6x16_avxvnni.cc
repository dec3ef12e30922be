// AVX-VNNI int GEMM micro-kernels: 6 rows x 16 columns, u8 x s8 -> int32 via vpdpbusd.
//
// vpdpbusd multiplies four u8 x s8 pairs and adds them to an int32 lane with no
// intermediate rounding or saturation (the non-"s" form wraps only the int32 sum), so
// unlike vpmaddubsw it is exact for every int8 input.  Zero points are handled by
// offsets: with unsigned codes a_u (s8 activations are shifted by +128) and the signed
// weights w' = W - w_zp (which must fit int8; otherwise the packer leaves this format
// out and the int16 AVX2 kernel runs),
//   sum_k (a_u - z_u) w' = sum_k a_u w' - z_u * sum_k w'
// and the driver subtracts the precomputed column (or row) sum; everything is mod 2^32,
// exactly as the reference's wrapping int32 arithmetic.  32 MACs per multiply uop, twice
// the int16 vpmaddwd kernel.
//
// Two forms: GemmU8S8 broadcasts 4 activation bytes per row against s8 weight panels
// (linear layers, the kernel API); GemmS8U8 broadcasts 4 weight bytes per output channel
// against u8 activation panels (convs, whose output is then NCHW).  Panels hold, per
// k-quad, 16 columns x 4 bytes (columns 0..7 then 8..15).  No STL here (see the AVX2 file).
#pragma GCC target("avx2,fma,avxvnni")
#define QDSL_DPBUSD _mm256_dpbusd_avx_epi32
#define QDSL_VNNI_U8S8 GemmU8S8AvxVnni
#define QDSL_VNNI_S8U8 GemmS8U8AvxVnni
#define QDSL_VNNI_U8S8_INIT GemmU8S8InitAvxVnni
#include "kernels/x86/gemm_u8s8_6x16_vnni.h"
