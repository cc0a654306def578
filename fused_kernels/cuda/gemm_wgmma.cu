// Step 6 of the GEMM ladder (benchmarks/gemm/gemm_kernels.cu has steps 1-5): Hopper wgmma fed by TMA, sm_90a only
// (build with -gencode=arch=compute_90a,code=sm_90a; wgmma and setmaxnreg do not exist on plain sm_90).
// C[M,N] = A[M,K] @ B[K,N], row-major bf16 in and out, fp32 accumulation.
//
// Design (the CUTLASS "warp-specialised" Hopper mainloop, written out by hand):
//   * 128x256 output tile per CTA, BK = 64, 3 warpgroups (384 threads): warpgroup 0 is the producer
//     (one thread issues TMA copies), warpgroups 1 and 2 are consumers, each owning 64 rows x 256 columns
//     and issuing wgmma.mma_async.m64n256k16 (4 per k-tile) straight from shared memory, so operands never
//     pass through registers (the limit of the mma.sync kernel).
//   * 4-stage ring of shared-memory stages (48 KiB each: A 128x64 = 16 KiB, B 64x256 = 32 KiB; 192 KiB in
//     all, 5 stages would exceed the 227 KiB limit); each stage has a "full" mbarrier (the TMA transaction
//     count: the consumers wait on it) and an "empty" mbarrier (one arrival per consumer warp: the producer
//     waits on it before overwriting the stage).
//   * Consumers keep one k-tile of wgmma in flight (wait_group 1) and release a stage only once the wgmmas
//     reading it have completed.
//   * Register budget: 128 fp32 accumulators per consumer thread; setmaxnreg moves registers from the
//     producer (40) to the consumers (232): 128*40 + 256*232 <= 65536.
//
// Shared-memory layouts (both written by TMA with CU_TENSOR_MAP_SWIZZLE_128B, which is exactly the
// Swizzle<3,4,3> pattern the wgmma descriptor's "128B swizzle" mode undoes; stage bases are 1024-byte
// aligned so the descriptor's base-offset field is 0):
//   * A [M,K] row-major is K-major (K contiguous), wgmma's default (tnspA = 0). A stage is 128 rows of 64
//     bf16 = 128 bytes: one swizzle row per matrix row, 8-row core-matrix groups 1024 bytes apart
//     (SBO = 1024; LBO is unused for swizzled K-major). The k16 slice kk starts 32*kk bytes into the row.
//   * B [K,N] row-major has N contiguous, i.e. it is MN-major ("transposed" for wgmma, tnspB = 1, allowed
//     for 16-bit types). A 128-byte swizzle row holds 64 n, so the 256-wide stage is 4 TMA boxes of
//     [64 k][64 n] (8 KiB each). In the MN-major canonical layout ((8,8,n),(8,k)):((1,8,LBO),(64,SBO)) in
//     elements, LBO is the step between 64-wide n blocks (8192 bytes: the next box) and SBO the step between
//     8-row k groups (1024 bytes). The k16 slice kk starts 16 rows = 2048*kk bytes into each box.

#include <cstdint>

#include "gemm_kernels.h"
#include "wgmma_common.cuh"  // mbarriers, TMA, wgmma descriptors and instruction, tensor maps

namespace {

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
constexpr int CONSUMERS = 2, THREADS = 128 * (1 + CONSUMERS);
constexpr int BOX_N = 64;                                    // 128-byte swizzle row: 64 bf16
constexpr int A_STAGE = BM * BK, B_STAGE = BK * BN;          // elements
constexpr int STAGE_BYTES = (A_STAGE + B_STAGE) * 2;         // the TMA transaction count of one stage
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + 1024;  // + barriers + alignment slack
static_assert(BM == 64 * CONSUMERS, "each consumer warpgroup owns 64 rows (wgmma M = 64)");

// ---------------------------------------------------------------- the kernel
__global__ void __launch_bounds__(THREADS, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 bf16* __restrict__ C, int M, int N, int K) {
  extern __shared__ unsigned char smem_raw[];
  // 128-byte swizzle repeats every 1024 bytes; TMA and the descriptors both assume 1024-aligned stages.
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  bf16* sA = reinterpret_cast<bf16*>(smem);  // [STAGES][BM][BK], swizzled
  bf16* sB = sA + STAGES * A_STAGE;          // [STAGES][BN / 64 boxes][BK][64], swizzled
  uint64_t* full = reinterpret_cast<uint64_t*>(sB + STAGES * B_STAGE);
  uint64_t* empty = full + STAGES;

  // Grouped tile order (as the mma kernel): 8 row-tiles walk the columns together for L2 reuse.
  constexpr int GROUP_M = 8;
  const int tiles_m = M / BM, tiles_n = N / BN, pid = blockIdx.x;
  const int first_m = pid / (GROUP_M * tiles_n) * GROUP_M;
  const int group_m = min(tiles_m - first_m, GROUP_M);
  const int tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m;
  const int tile_n = (pid % (GROUP_M * tiles_n)) / group_m;

  const int wg = threadIdx.x / 128, KT = K / BK;
  init_pipeline_barriers<STAGES, CONSUMERS>(full, empty);
  __syncthreads();  // the last block-wide barrier: the roles below never meet again

  if (wg == 0) {  // ---------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % STAGES;
        if (kt >= STAGES) mbar_wait(&empty[s], (kt / STAGES - 1) & 1);  // consumers done with round - 1
        mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
        tma_load(sA + s * A_STAGE, &map_a, &full[s], kt * BK, tile_m * BM);
#pragma unroll
        for (int j = 0; j < BN / BOX_N; ++j)
          tma_load(sB + s * B_STAGE + j * BK * BOX_N, &map_b, &full[s], tile_n * BN + j * BOX_N, kt * BK);
      }
    }
    return;
  }

  // ---------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float d[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) d[i] = 0.f;
  fence_acc(d);
  for (int kt = 0; kt < KT; ++kt) {
    const int s = kt % STAGES;
    mbar_wait(&full[s], (kt / STAGES) & 1);
    const bf16* a = sA + s * A_STAGE + c * 64 * BK;  // this warpgroup's 64 rows: 8 KiB in, 1024-aligned
    const bf16* b = sB + s * B_STAGE;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      wgmma_m64n256k16(d, sw128_desc(a + kk * 16, 16, 1024), sw128_desc(b + kk * 16 * BOX_N, BK * BOX_N * 2, 1024));
    wgmma_commit();
    wgmma_wait<1>();  // k-tile kt - 1 is done: its stage can be refilled while kt runs
    fence_acc(d);
    if (kt > 0 && lane == 0) mbar_arrive(&empty[(kt - 1) % STAGES]);
  }
  wgmma_wait<0>();
  fence_acc(d);

  const size_t row0 = (size_t)tile_m * BM + c * 64 + warp * 16 + lane / 4;
  const size_t col0 = (size_t)tile_n * BN + 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    *reinterpret_cast<__nv_bfloat162*>(C + row0 * N + col0 + 8 * j) = __floats2bfloat162_rn(d[4 * j], d[4 * j + 1]);
    *reinterpret_cast<__nv_bfloat162*>(C + (row0 + 8) * N + col0 + 8 * j) =
        __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
  }
}

}  // namespace

const char* gemm_wgmma(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  if (M % BM || N % BN || K % BK) return "wgmma kernel needs M % 128 == 0, N % 256 == 0 and K % 64 == 0";
  if ((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B) | reinterpret_cast<uintptr_t>(C)) % 16)
    return "wgmma kernel needs 16-byte aligned A, B and C (TMA)";
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return "cuTensorMapEncodeTiled is not available from the CUDA driver";
  CUtensorMap map_a, map_b;
  if (!make_map(encode, &map_a, A, K, M, BK, BM) || !make_map(encode, &map_b, B, N, K, BOX_N, BK))
    return "cuTensorMapEncodeTiled rejected the A or B tensor map";
  if (cudaFuncSetAttribute(wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES) != cudaSuccess)
    return "cannot raise the dynamic shared-memory limit for the wgmma kernel";
  wgmma_kernel<<<(M / BM) * (N / BN), THREADS, SMEM_BYTES, stream>>>(map_a, map_b, static_cast<bf16*>(C), M, N, K);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}
