// The GEMM ladder: C[M,N] = A[M,K] @ B[K,N], all row-major bf16, fp32 accumulation, bf16 output.
// Each kernel is one step from naive to a pipelined tensor-core kernel:
//   1. naive         one thread per output, operands straight from global memory
//   2. smem          32x32 shared-memory tiles: each global element is read once per tile, not per output
//   3. regblock      128x128 block tile, 8x8 outputs per thread in registers, 16-byte vector loads, unrolled k
//   4. wmma          tensor cores through the WMMA API (16x16x16 bf16 fragments), 128x128 block tile
//   5. mma           mma.sync.m16n8k16 fed by ldmatrix, a cp.async multi-stage shared-memory pipeline,
//                    XOR-swizzled shared memory (no bank conflicts for ldmatrix), grouped tile order for L2
// Launchers take raw pointers and a stream and return nullptr or an error message (the binding raises it).
// Builds for sm_80 and sm_90; no Hopper-only (wgmma/TMA) instructions: step 6 (wgmma + TMA, sm_90a) is
// fused_kernels/cuda/gemm_wgmma.cu. gemm_kernels.h lives there too (build with -I fused_kernels/cuda).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include "gemm_kernels.h"

using bf16 = __nv_bfloat16;

namespace {

// ---------------------------------------------------------------- 1. naive
// threadIdx.x runs along N so a warp reads consecutive B and writes consecutive C (coalesced);
// A[m, k] is the same address for the warp (a broadcast).
__global__ void naive_kernel(const bf16* A, const bf16* B, bf16* C, int M, int N, int K) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  int m = blockIdx.y * blockDim.y + threadIdx.y;
  if (m >= M || n >= N) return;
  float acc = 0.f;
  for (int k = 0; k < K; ++k) acc += __bfloat162float(A[(size_t)m * K + k]) * __bfloat162float(B[(size_t)k * N + n]);
  C[(size_t)m * N + n] = __float2bfloat16(acc);
}

// ---------------------------------------------------------------- 2. shared-memory tiling
constexpr int T = 32;
__global__ void smem_kernel(const bf16* A, const bf16* B, bf16* C, int M, int N, int K) {
  __shared__ float As[T][T];
  __shared__ float Bs[T][T + 1];
  int tx = threadIdx.x, ty = threadIdx.y;
  int m = blockIdx.y * T + ty, n = blockIdx.x * T + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += T) {
    As[ty][tx] = (m < M && k0 + tx < K) ? __bfloat162float(A[(size_t)m * K + k0 + tx]) : 0.f;
    Bs[ty][tx] = (k0 + ty < K && n < N) ? __bfloat162float(B[(size_t)(k0 + ty) * N + n]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < T; ++k) acc += As[ty][k] * Bs[k][tx];
    __syncthreads();
  }
  if (m < M && n < N) C[(size_t)m * N + n] = __float2bfloat16(acc);
}

// ---------------------------------------------------------------- 3. register blocking
// 256 threads compute a 128x128 tile, each an 8x8 sub-tile: per k, 8 + 8 shared loads feed 64 FMAs.
// A is stored transposed in shared memory so a thread's 8 A values are contiguous (two float4 loads).
constexpr int RB_BM = 128, RB_BN = 128, RB_BK = 16, RB_TM = 8, RB_TN = 8;
__global__ void __launch_bounds__(256) regblock_kernel(const bf16* A, const bf16* B, bf16* C, int M, int N, int K) {
  __shared__ __align__(16) float As[RB_BK][RB_BM];  // [k][m]
  __shared__ __align__(16) float Bs[RB_BK][RB_BN];  // [k][n]
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int m0 = blockIdx.y * RB_BM, n0 = blockIdx.x * RB_BN;
  float acc[RB_TM][RB_TN] = {};
  for (int k0 = 0; k0 < K; k0 += RB_BK) {
    {  // A tile 128x16: one 16-byte load (8 bf16) per thread, stored transposed
      int row = tid / 2, col = (tid % 2) * 8;
      uint4 v = *reinterpret_cast<const uint4*>(A + (size_t)(m0 + row) * K + k0 + col);
      const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
      for (int i = 0; i < 8; ++i) As[col + i][row] = __bfloat162float(e[i]);
    }
    {  // B tile 16x128: one 16-byte load per thread
      int row = tid / 16, col = (tid % 16) * 8;
      uint4 v = *reinterpret_cast<const uint4*>(B + (size_t)(k0 + row) * N + n0 + col);
      const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
      for (int i = 0; i < 8; ++i) Bs[row][col + i] = __bfloat162float(e[i]);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < RB_BK; ++k) {
      float a[RB_TM], b[RB_TN];
      *reinterpret_cast<float4*>(a) = *reinterpret_cast<const float4*>(&As[k][ty * RB_TM]);
      *reinterpret_cast<float4*>(a + 4) = *reinterpret_cast<const float4*>(&As[k][ty * RB_TM + 4]);
      *reinterpret_cast<float4*>(b) = *reinterpret_cast<const float4*>(&Bs[k][tx * RB_TN]);
      *reinterpret_cast<float4*>(b + 4) = *reinterpret_cast<const float4*>(&Bs[k][tx * RB_TN + 4]);
#pragma unroll
      for (int i = 0; i < RB_TM; ++i)
#pragma unroll
        for (int j = 0; j < RB_TN; ++j) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < RB_TM; ++i) {
    __align__(16) bf16 out[RB_TN];
#pragma unroll
    for (int j = 0; j < RB_TN; ++j) out[j] = __float2bfloat16(acc[i][j]);
    *reinterpret_cast<uint4*>(C + (size_t)(m0 + ty * RB_TM + i) * N + n0 + tx * RB_TN) =
        *reinterpret_cast<const uint4*>(out);
  }
}

// ---------------------------------------------------------------- 4. WMMA tensor cores
// 8 warps as 2 (M) x 4 (N), each a 64x32 warp tile = 4x2 fragments of 16x16. Rows padded by 8 bf16
// (16 bytes) so successive rows start in different banks.
constexpr int WM_BM = 128, WM_BN = 128, WM_BK = 32, WM_PAD = 8;
__global__ void __launch_bounds__(256) wmma_kernel(const bf16* A, const bf16* B, bf16* C, int M, int N, int K) {
  using namespace nvcuda;
  __shared__ __align__(128) bf16 As[WM_BM][WM_BK + WM_PAD];
  __shared__ __align__(128) bf16 Bs[WM_BK][WM_BN + WM_PAD];
  __shared__ __align__(128) float scratch[8][16 * 16];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4;
  const int m0 = blockIdx.y * WM_BM, n0 = blockIdx.x * WM_BN;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  for (int k0 = 0; k0 < K; k0 += WM_BK) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // A 128x32 and B 32x128: 512 16-byte chunks each, 2 per thread
      int c = tid + r * 256;
      int ar = c / 4, ac = (c % 4) * 8;
      *reinterpret_cast<uint4*>(&As[ar][ac]) = *reinterpret_cast<const uint4*>(A + (size_t)(m0 + ar) * K + k0 + ac);
      int br = c / 16, bc = (c % 16) * 8;
      *reinterpret_cast<uint4*>(&Bs[br][bc]) = *reinterpret_cast<const uint4*>(B + (size_t)(k0 + br) * N + n0 + bc);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < WM_BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(a[i], &As[wm * 64 + i * 16][kk], WM_BK + WM_PAD);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &Bs[kk][wn * 32 + j * 16], WM_BN + WM_PAD);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  // fp32 fragment -> this warp's scratch -> bf16, 8 values (16 bytes) per lane
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(scratch[warp], acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      int r = lane / 2, c = (lane % 2) * 8;
      __align__(16) bf16 out[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = __float2bfloat16(scratch[warp][r * 16 + c + e]);
      *reinterpret_cast<uint4*>(C + (size_t)(m0 + wm * 64 + i * 16 + r) * N + n0 + wn * 32 + j * 16 + c) =
          *reinterpret_cast<const uint4*>(out);
      __syncwarp();
    }
}

// ---------------------------------------------------------------- 5. mma.sync + cp.async pipeline
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
// D[16x8] += A[16x16] B[16x8]; fragments as the PTX ISA lays them out for m16n8k16 (g = lane/4, t = lane%4):
// a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..); b0 (k 2t..2t+1, n g) b1 (k 2t+8.., n g);
// d0 d1 (g, 2t..2t+1), d2 d3 (g+8, 2t..2t+1).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory layouts, in 16-byte chunks of 8 bf16. A stage: [BM][BK=32], 4 chunks (64 bytes) per row;
// chunk c of row r is stored at c ^ ((r >> 1) & 3), so the 8 rows one ldmatrix reads (same logical
// chunk) land in 8 different 16-byte bank groups. B stage: [BK][BN]; chunk c of row r at c ^ (r & 7).
__device__ __forceinline__ int a_off(int row, int chunk) { return row * 32 + ((chunk ^ ((row >> 1) & 3)) << 3); }
template <int BN>
__device__ __forceinline__ int b_off(int row, int chunk) { return row * BN + ((chunk ^ (row & 7)) << 3); }

template <int BM, int BN, int WM, int WN, int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MIN_BLOCKS)
    mma_kernel(const bf16* __restrict__ A, const bf16* __restrict__ B, bf16* __restrict__ C, int M, int N, int K) {
  constexpr int BK = 32, WARPS_N = BN / WN, THREADS = (BM / WM) * WARPS_N * 32;
  constexpr int MT = WM / 16, NT = WN / 8;  // m16 x n8 mma tiles per warp
  static_assert(NT % 2 == 0 && BN % 64 == 0, "B fragments are loaded two n8 tiles at a time");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sA = reinterpret_cast<bf16*>(smem);  // [STAGES][BM][BK]
  bf16* sB = sA + STAGES * BM * BK;          // [STAGES][BK][BN]

  // Grouped tile order (as Triton's GROUP_M): 8 row-tiles walk the columns together, so the A rows
  // and B columns that consecutive blocks need are still in L2.
  constexpr int GROUP_M = 8;
  const int tiles_m = M / BM, tiles_n = N / BN, pid = blockIdx.x;
  const int group = pid / (GROUP_M * tiles_n), first_m = group * GROUP_M;
  const int group_m = min(tiles_m - first_m, GROUP_M);
  const int tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m;
  const int tile_n = (pid % (GROUP_M * tiles_n)) / group_m;
  const bf16* gA = A + (size_t)tile_m * BM * K;
  const bf16* gB = B + (size_t)tile_n * BN;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;

  auto load_stage = [&](int stage, int kt) {
    bf16* a = sA + stage * BM * BK;
    bf16* b = sB + stage * BK * BN;
#pragma unroll
    for (int c = tid; c < BM * BK / 8; c += THREADS) {
      int row = c / (BK / 8), chunk = c % (BK / 8);
      cp_async16(a + a_off(row, chunk), gA + (size_t)row * K + kt * BK + chunk * 8);
    }
#pragma unroll
    for (int c = tid; c < BK * BN / 8; c += THREADS) {
      int row = c / (BN / 8), chunk = c % (BN / 8);
      cp_async16(b + b_off<BN>(row, chunk), gB + (size_t)(kt * BK + row) * N + chunk * 8);
    }
  };

  float acc[MT][NT][4] = {};
  const int KT = K / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();  // always commit, so group counting stays uniform
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();  // tile kt has landed (this thread's copies) ...
    __syncthreads();              // ... everyone's, and everyone is done with the stage we refill next
    if (kt + STAGES - 1 < KT) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
    cp_async_commit();

    const bf16* a = sA + (kt % STAGES) * BM * BK;
    const bf16* b = sB + (kt % STAGES) * BK * BN;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned af[MT][4], bfr[NT][2];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {  // lanes 0-15: rows 0-15 at k 0-7; lanes 16-31: rows 0-15 at k 8-15
        int row = warp_m * WM + mi * 16 + (lane % 16);
        ldmatrix_x4(af[mi], a + a_off(row, kk * 2 + lane / 16));
      }
#pragma unroll
      for (int nj = 0; nj < NT / 2; ++nj) {  // lanes 0-15: k rows 0-15 at n 0-7; lanes 16-31: same at n 8-15
        unsigned r[4];
        int krow = kk * 16 + (lane % 16);
        int chunk = (warp_n * WN + nj * 16) / 8 + lane / 16;
        ldmatrix_x4_trans(r, b + b_off<BN>(krow, chunk));
        bfr[2 * nj][0] = r[0];
        bfr[2 * nj][1] = r[1];
        bfr[2 * nj + 1][0] = r[2];
        bfr[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) mma_bf16(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
    }
  }
  cp_async_wait<0>();

  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      size_t row = (size_t)tile_m * BM + warp_m * WM + mi * 16 + g;
      size_t col = (size_t)tile_n * BN + warp_n * WN + ni * 8 + 2 * t;
      *reinterpret_cast<__nv_bfloat162*>(C + row * N + col) = __floats2bfloat162_rn(acc[mi][ni][0], acc[mi][ni][1]);
      *reinterpret_cast<__nv_bfloat162*>(C + (row + 8) * N + col) =
          __floats2bfloat162_rn(acc[mi][ni][2], acc[mi][ni][3]);
    }
}

template <int BM, int BN, int WM, int WN, int STAGES, int MIN_BLOCKS>
const char* launch_mma(const bf16* A, const bf16* B, bf16* C, int M, int N, int K, cudaStream_t stream) {
  if (M % BM || N % BN || K % 32) return "mma kernel needs M % BM == 0, N % BN == 0 and K % 32 == 0";
  constexpr int threads = (BM / WM) * (BN / WN) * 32;
  constexpr int smem = STAGES * (BM * 32 + 32 * BN) * (int)sizeof(bf16);
  auto kernel = mma_kernel<BM, BN, WM, WN, STAGES, MIN_BLOCKS>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return "cannot raise the dynamic shared-memory limit for the mma kernel";
  kernel<<<(M / BM) * (N / BN), threads, smem, stream>>>(A, B, C, M, N, K);
  return nullptr;
}

const char* launch_status() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* gemm_naive(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  dim3 block(32, 8), grid((N + 31) / 32, (M + 7) / 8);
  naive_kernel<<<grid, block, 0, stream>>>(static_cast<const bf16*>(A), static_cast<const bf16*>(B),
                                           static_cast<bf16*>(C), M, N, K);
  return launch_status();
}

const char* gemm_smem(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  dim3 block(T, T), grid((N + T - 1) / T, (M + T - 1) / T);
  smem_kernel<<<grid, block, 0, stream>>>(static_cast<const bf16*>(A), static_cast<const bf16*>(B),
                                          static_cast<bf16*>(C), M, N, K);
  return launch_status();
}

const char* gemm_regblock(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  if (M % RB_BM || N % RB_BN || K % RB_BK) return "regblock kernel needs M, N % 128 == 0 and K % 16 == 0";
  regblock_kernel<<<dim3(N / RB_BN, M / RB_BM), 256, 0, stream>>>(
      static_cast<const bf16*>(A), static_cast<const bf16*>(B), static_cast<bf16*>(C), M, N, K);
  return launch_status();
}

const char* gemm_wmma(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  if (M % WM_BM || N % WM_BN || K % WM_BK) return "wmma kernel needs M, N % 128 == 0 and K % 32 == 0";
  wmma_kernel<<<dim3(N / WM_BN, M / WM_BM), 256, 0, stream>>>(static_cast<const bf16*>(A), static_cast<const bf16*>(B),
                                                               static_cast<bf16*>(C), M, N, K);
  return launch_status();
}

const char* gemm_mma_128x128(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  const char* err = launch_mma<128, 128, 64, 64, 4, 2>(static_cast<const bf16*>(A), static_cast<const bf16*>(B),
                                                       static_cast<bf16*>(C), M, N, K, stream);
  return err ? err : launch_status();
}

const char* gemm_mma_128x256(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  const char* err = launch_mma<128, 256, 64, 64, 4, 1>(static_cast<const bf16*>(A), static_cast<const bf16*>(B),
                                                       static_cast<bf16*>(C), M, N, K, stream);
  return err ? err : launch_status();
}
