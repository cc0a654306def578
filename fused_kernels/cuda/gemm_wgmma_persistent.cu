// Step 7 of the GEMM ladder: gemm_wgmma.cu's mainloop made persistent, with the epilogue staged through shared
// memory and written by TMA stores. sm_90a only. C[M,N] = A[M,K] @ B[K,N] (optionally GELU(A @ B + bias), or one
// of the MLP up-projection's fused forward / backward epilogues below), row-major bf16 in and out, fp32 accumulation.
//
// Design:
//   * Same CTA shape as gemm_wgmma.cu: 128x256x64 tiles, 3 warpgroups (384 threads, one CTA per SM): a TMA
//     producer warpgroup (one thread issues the copies) and two consumer warpgroups, each owning 64 rows x
//     256 columns of the tile with wgmma.mma_async.m64n256k16 straight from 128-byte-swizzled shared memory
//     (see gemm_wgmma.cu for the descriptor layouts). 4-stage full/empty mbarrier ring (48 KiB a stage).
//   * Persistent: grid = min(#tiles, #SMs); CTA b handles tiles b, b + grid, b + 2 grid, ... (static
//     scheduler: every tile costs the same, so an atomic counter would buy nothing). Tile t is mapped to
//     (tile_m, tile_n) in groups of 8 row-tiles that walk the columns together, so one wave of 132 CTAs
//     touches ~8 row panels of A and ~17 column panels of B (L2 reuse).
//   * The stage ring runs across tile boundaries (one k-iteration counter for the whole CTA), so the producer
//     prefetches tile i+1's first 4 k-tiles while the consumers run tile i's epilogue: the epilogue overlaps
//     the next tile's loads, and the consumers start the next mainloop on full stages.
//   * Epilogue through shared memory: each consumer warpgroup converts its 64x256 fp32 accumulators to bf16
//     in four 64x64 chunks, each written into one of two 8 KiB staging buffers (double-buffered) in the TMA
//     128-byte-swizzle layout (bank-conflict free for the accumulator fragment: the 8 rows a warp writes land
//     in 8 different 16-byte chunks), then one thread issues a TMA store of the chunk
//     (cp.async.bulk.tensor ... bulk_group) and goes on; a buffer is rewritten only after the store two
//     chunks back has finished reading it (cp.async.bulk.wait_group.read). Stores drain while the next
//     chunk is converted and while the next tile's mainloop runs.
//   * Shape support: TMA zero-fills loads outside the matrix and clips stores to it, so M, N and K need not
//     be multiples of the tile: the constraints are N % 8 == 0 and K % 8 == 0 (TMA needs 16-byte row
//     strides) and 16-byte aligned A, B, C (and bias, AUX). Epilogue chunks that lie wholly outside C are skipped.
//   * Shared memory: 4 x 48 KiB stages + 2 consumers x 2 x 8 KiB staging + barriers = 225 KiB (limit 227).
//   * The epilogue variants below are one kernel template over enum Epilogue (kPlain is the plain GEMM).
//   * bias_gelu variant: the epilogue adds bias[col] (bf16) and applies GELU with the tanh approximation
//     (tanh.approx.f32) before rounding to bf16: the MLP up-projection's bias + GELU fused into the GEMM.
//   * bias_gelu_aux variant (forward, for training): as bias_gelu, and also writes AUX[M,N] = A @ B + bias in
//     bf16 (the pre-activation the backward needs; cuBLASLt's GELU_AUX) through a second tensor map. No shared
//     memory is left for more staging, so each chunk stages + stores AUX, then stages + stores C through the same
//     two buffers: one rotation of 8 stores a tile (AUX always in buffer 0, C in buffer 1), each buffer rewritten
//     only after the store two stores back has finished reading it, as for the plain chunks.
//   * dgelu variant (backward): C = (A @ B) * GELU_tanh'(AUX), the down-projection's dgrad with GELU's backward
//     fused (A = dy, B = W_down as nn.Linear stores it, AUX = the forward's pre-activation), and DBIAS[N] (fp32,
//     zeroed by the caller) += column sums of C before rounding: the up-projection's bias gradient (cuBLASLt's
//     DGELU_BGRAD). Each AUX chunk arrives by TMA load into the chunk's staging buffer (one mbarrier a buffer;
//     chunks 0 and 1 are loaded before the tile's mainloop, chunk q + 2 as soon as chunk q's store has read its
//     buffer); every thread reads its fragment's AUX at exactly the swizzled offsets it then overwrites with the
//     result, so the buffer is converted in place and stored as before. Column sums: the fragment's two rows in
//     thread, then __shfl_xor_sync over the 8 lanes with the same lane % 4, then one fp32 atomicAdd a column by
//     lanes 0..3 of each warp (512 atomics a column at 8192 rows); rows >= M and columns >= N add nothing.

#include <cstdint>

#include "gemm_kernels.h"
#include "wgmma_common.cuh"  // mbarriers, TMA loads, wgmma descriptors and instruction, tensor maps

namespace {

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
constexpr int CONSUMERS = 2, THREADS = 128 * (1 + CONSUMERS);
constexpr int BOX_N = 64;                             // 128-byte swizzle row: 64 bf16
constexpr int A_STAGE = BM * BK, B_STAGE = BK * BN;   // elements
constexpr int STAGE_BYTES = (A_STAGE + B_STAGE) * 2;  // the TMA transaction count of one stage
constexpr int EPI_N = 64;                             // columns per epilogue chunk: one 128-byte swizzle row
constexpr int EPI_BUF = 64 * EPI_N;                   // elements of one staging buffer (a consumer's 64 rows)
constexpr int EPI_BUFS = 2;                           // per consumer warpgroup
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + CONSUMERS * EPI_BUFS * EPI_BUF * 2 +
                           (2 * STAGES + CONSUMERS * EPI_BUFS) * 8 + 1024;  // + alignment slack
constexpr int GROUP_M = 8;
static_assert(BM == 64 * CONSUMERS, "each consumer warpgroup owns 64 rows (wgmma M = 64)");
static_assert(BN % EPI_N == 0 && EPI_N * 2 == 128, "epilogue chunks are one 128-byte swizzle row wide");
static_assert(SMEM_BYTES <= 227 * 1024, "over the 227 KiB of shared memory a Hopper CTA may use");

// ---------------------------------------------------------------- TMA stores and named barriers
// 2-D TMA store of one box from shared memory at (c0 = innermost coordinate, c1); elements outside the tensor
// are not written. Completion is tracked per thread in bulk async-groups.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
               :
               : "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// All but the newest N bulk groups of this thread have finished reading their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// All bulk groups of this thread have completed (global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Makes this thread's generic-proxy shared-memory writes visible to the async proxy (the TMA store).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Barrier over the 128 threads of one consumer warpgroup (id 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_bar(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * fmaf(0.044715f * x, x * x, x);  // sqrt(2/pi) (x + 0.044715 x^3)
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(u));
  return 0.5f * x * (1.f + t);
}

// d/dx GELU_tanh(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(u) as above
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  const float x2 = x * x;
  const float u = 0.7978845608028654f * fmaf(0.044715f * x, x2, x);
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(u));
  const float du = 0.7978845608028654f * fmaf(3.f * 0.044715f, x2, 1.f);
  return fmaf(0.5f * x * fmaf(-t, t, 1.f), du, 0.5f * (1.f + t));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

struct Tile {
  int m, n;
};
// Grouped order: GROUP_M row-tiles walk the columns together.
__device__ __forceinline__ Tile tile_of(int t, int tiles_m, int tiles_n) {
  const int per_group = GROUP_M * tiles_n, first_m = t / per_group * GROUP_M;
  const int group_m = min(tiles_m - first_m, GROUP_M), r = t % per_group;
  return {first_m + r % group_m, r / group_m};
}

// ---------------------------------------------------------------- the kernel
// kPlain: C = A @ B; kBiasGelu: C = GELU(A @ B + bias); kBiasGeluAux: that and AUX = A @ B + bias;
// kDGelu: C = (A @ B) * GELU'(AUX), DBIAS += column sums of C.
enum class Epilogue { kPlain, kBiasGelu, kBiasGeluAux, kDGelu };

template <Epilogue E>
__global__ void __launch_bounds__(THREADS, 1)
    wgmma_persistent_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_aux,
                            const bf16* __restrict__ bias, float* __restrict__ dbias, int M, int N, int K) {
  constexpr bool kBias = E == Epilogue::kBiasGelu || E == Epilogue::kBiasGeluAux;
  constexpr int STORES = E == Epilogue::kBiasGeluAux ? 2 : 1;  // TMA stores a chunk: (AUX,) C
  extern __shared__ unsigned char smem_raw[];
  // 128-byte swizzle repeats every 1024 bytes; TMA and the descriptors both assume 1024-aligned buffers.
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  bf16* sA = reinterpret_cast<bf16*>(smem);  // [STAGES][BM][BK], swizzled
  bf16* sB = sA + STAGES * A_STAGE;          // [STAGES][BN / 64 boxes][BK][64], swizzled
  bf16* sC = sB + STAGES * B_STAGE;          // [CONSUMERS][EPI_BUFS][64][64], swizzled (8 KiB each: aligned)
  uint64_t* full = reinterpret_cast<uint64_t*>(sC + CONSUMERS * EPI_BUFS * EPI_BUF);
  uint64_t* empty = full + STAGES;
  uint64_t* aux_full = empty + STAGES;  // [CONSUMERS][EPI_BUFS] (dgelu): AUX chunk landed in the staging buffer

  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN, tiles = tiles_m * tiles_n;
  const int KT = (K + BK - 1) / BK;  // a partial last k-tile is zero-filled by TMA in both A and B
  const int wg = threadIdx.x / 128;
  if (E == Epilogue::kDGelu && threadIdx.x == 0)  // before init_pipeline_barriers: its fence covers these too
    for (int i = 0; i < CONSUMERS * EPI_BUFS; ++i) mbar_init(&aux_full[i], 1);
  init_pipeline_barriers<STAGES, CONSUMERS>(full, empty);
  __syncthreads();  // the last block-wide barrier: the roles below never meet again

  if (wg == 0) {  // ---------------- producer: runs ahead across tiles, bounded by the empty barriers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      unsigned it = 0;  // k-iterations issued by this CTA, over all its tiles
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const Tile tile = tile_of(t, tiles_m, tiles_n);
        for (int kt = 0; kt < KT; ++kt, ++it) {
          const unsigned s = it % STAGES;
          if (it >= STAGES) mbar_wait(&empty[s], (it / STAGES - 1) & 1);  // consumers done with round - 1
          mbar_arrive_expect_tx(&full[s], STAGE_BYTES);  // full boxes, out-of-bounds parts included
          tma_load(sA + s * A_STAGE, &map_a, &full[s], kt * BK, tile.m * BM);
#pragma unroll
          for (int j = 0; j < BN / BOX_N; ++j)
            tma_load(sB + s * B_STAGE + j * BK * BOX_N, &map_b, &full[s], tile.n * BN + j * BOX_N, kt * BK);
        }
      }
    }
    return;
  }

  // ---------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const bool leader = threadIdx.x % 128 == 0;  // issues this warpgroup's TMA stores
  unsigned char* stage_c = reinterpret_cast<unsigned char*>(sC + c * EPI_BUFS * EPI_BUF);
  const int row = warp * 16 + lane / 4;  // the fragment's first row within the warpgroup's 64 (and row + 8)
  const uint32_t swz = lane / 4;         // row % 8 (= (row + 8) % 8): the 128-byte swizzle's XOR term
  bool prev_stored = false;              // did this warpgroup's previous store slot issue a store?
  uint64_t* aux_bar = aux_full + c * EPI_BUFS;
  unsigned aux_phase = 0;  // dgelu: bit b is the parity of buffer b's next AUX load (all 128 threads track it)
  unsigned it = 0;
  float d[128];
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tile = tile_of(t, tiles_m, tiles_n);
    const int row0 = tile.m * BM + c * 64;
    // chunk q (64 columns) of this warpgroup's 64 rows lies (partly) inside C; false for every later q too
    const auto chunk_in = [&](int q) { return row0 < M && tile.n * BN + q * EPI_N < N; };
    // dgelu, leader only: AUX chunk q -> staging buffer q % EPI_BUFS, whose last store must have read it
    const auto load_aux = [&](int q) {
      const int b = q % EPI_BUFS;
      mbar_arrive_expect_tx(&aux_bar[b], EPI_BUF * 2);  // the full box: TMA zero-fills outside AUX
      tma_load(stage_c + b * EPI_BUF * 2, &map_aux, &aux_bar[b], tile.n * BN + q * EPI_N, row0);
    };
    if constexpr (E == Epilogue::kDGelu) {
      if (leader) {
        bulk_wait_read<0>();  // the last tile's stores have read both buffers
#pragma unroll
        for (int q = 0; q < EPI_BUFS; ++q)
          if (chunk_in(q)) load_aux(q);  // in flight during the mainloop
      }
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    fence_acc(d);
    for (int kt = 0; kt < KT; ++kt, ++it) {
      const unsigned s = it % STAGES;
      mbar_wait(&full[s], (it / STAGES) & 1);
      const bf16* a = sA + s * A_STAGE + c * 64 * BK;  // this warpgroup's 64 rows: 8 KiB in, 1024-aligned
      const bf16* b = sB + s * B_STAGE;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_m64n256k16(d, sw128_desc(a + kk * 16, 16, 1024),
                         sw128_desc(b + kk * 16 * BOX_N, BK * BOX_N * 2, 1024));
      wgmma_commit();
      wgmma_wait<1>();  // k-iteration it - 1 is done: its stage can be refilled while this one runs
      fence_acc(d);
      if (kt > 0 && lane == 0) mbar_arrive(&empty[(it - 1) % STAGES]);
    }
    wgmma_wait<0>();
    fence_acc(d);
    if (lane == 0) mbar_arrive(&empty[(it - 1) % STAGES]);  // the tile's last stage: the producer may go on

    // ---- epilogue: 4 chunks of 64 rows x 64 columns, fp32 -> bf16 -> swizzled staging buffer -> TMA store
    // element (r, cc) of a 64x64 chunk sits at r * 128 + ((cc / 8) ^ (r % 8)) * 16 + (cc % 8) * 2; this thread's
    // fragment of column group jj is at rows row and row + 8, byte offset ((jj ^ swz) << 4) + 4 * (lane % 4)
#pragma unroll
    for (int q = 0; q < BN / EPI_N; ++q) {
      const int col0 = tile.n * BN + q * EPI_N;
      if (!chunk_in(q)) {  // wholly outside C (same for the whole warpgroup): nothing to store
        prev_stored = false;
        continue;
      }
      if constexpr (E == Epilogue::kDGelu) {
        const int b = q % EPI_BUFS;
        unsigned char* buf = stage_c + b * EPI_BUF * 2;
        mbar_wait(&aux_bar[b], (aux_phase >> b) & 1);  // AUX chunk q is in buf
        aux_phase ^= 1u << b;
        const bool in0 = row0 + row < M, in8 = row0 + row + 8 < M;
        float sum[EPI_N / 4];  // this thread's column sums: columns 8 jj + 2 (lane % 4) + {0, 1}
#pragma unroll
        for (int jj = 0; jj < EPI_N / 8; ++jj) {
          const int j = q * (EPI_N / 8) + jj;
          const uint32_t off = ((jj ^ swz) << 4) + 4 * (lane % 4);
          __nv_bfloat162* p0 = reinterpret_cast<__nv_bfloat162*>(buf + row * 128 + off);
          __nv_bfloat162* p8 = reinterpret_cast<__nv_bfloat162*>(buf + (row + 8) * 128 + off);
          const float2 x0 = __bfloat1622float2(*p0), x8 = __bfloat1622float2(*p8);
          const float v0 = d[4 * j] * gelu_tanh_grad(x0.x), v1 = d[4 * j + 1] * gelu_tanh_grad(x0.y);
          const float v2 = d[4 * j + 2] * gelu_tanh_grad(x8.x), v3 = d[4 * j + 3] * gelu_tanh_grad(x8.y);
          *p0 = __floats2bfloat162_rn(v0, v1);  // in place: the offsets this thread alone read
          *p8 = __floats2bfloat162_rn(v2, v3);
          // out-of-bounds rows are zero anyway (zero-filled A), but DBIAS must not depend on that
          sum[2 * jj] = (in0 ? v0 : 0.f) + (in8 ? v2 : 0.f);
          sum[2 * jj + 1] = (in0 ? v1 : 0.f) + (in8 ? v3 : 0.f);
        }
        fence_proxy_async_smem();
        warpgroup_bar(1 + c);  // all 128 threads have converted their part of buf
        if (leader) {
          tma_store(&map_c, buf, col0, row0);
          bulk_commit();
          if (q + EPI_BUFS < BN / EPI_N && chunk_in(q + EPI_BUFS)) {
            bulk_wait_read<0>();  // that store has read buf (chunk q + 1's AUX is already in the other one)
            load_aux(q + EPI_BUFS);
          }
        }
        // column sums over the warp's 16 rows: lanes with the same lane % 4 hold the same columns
#pragma unroll
        for (int i = 0; i < EPI_N / 4; ++i) {
          sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 4);
          sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 8);
          sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 16);
        }
        if (lane < 4) {
#pragma unroll
          for (int jj = 0; jj < EPI_N / 8; ++jj) {
            const int col = col0 + 8 * jj + 2 * lane;
            if (col < N) {  // N % 8 == 0: col + 1 < N too
              atomicAdd(dbias + col, sum[2 * jj]);
              atomicAdd(dbias + col + 1, sum[2 * jj + 1]);
            }
          }
        }
        prev_stored = true;
      } else {
        // STORES stores a chunk (bias_gelu_aux: AUX, then C) rotate through the EPI_BUFS buffers
#pragma unroll
        for (int st = 0; st < STORES; ++st) {
          const bool aux_pass = E == Epilogue::kBiasGeluAux && st == 0;  // this store writes AUX
          unsigned char* buf = stage_c + ((q * STORES + st) % EPI_BUFS) * EPI_BUF * 2;
          // Stores alternate buffers: if the previous store slot (of this chunk, the last chunk or the last tile)
          // issued a store, the newest store used the other buffer and all older ones must have finished reading;
          // after a skipped chunk the newest store may have used this buffer: wait for all of them.
          if (leader) {
            if (prev_stored)
              bulk_wait_read<1>();
            else
              bulk_wait_read<0>();
          }
          warpgroup_bar(1 + c);  // the buffer is free
#pragma unroll
          for (int jj = 0; jj < EPI_N / 8; ++jj) {
            const int j = q * (EPI_N / 8) + jj;  // accumulator column group: columns 8j .. 8j + 7 of the tile
            float v0 = d[4 * j], v1 = d[4 * j + 1], v2 = d[4 * j + 2], v3 = d[4 * j + 3];
            if (kBias && st == 0) {
              const int col = col0 + 8 * jj + 2 * (lane % 4);
              float b0 = 0.f, b1 = 0.f;
              if (col < N) {  // N % 8 == 0: col and col + 1 are both inside or both outside
                const float2 bb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + col));
                b0 = bb.x;
                b1 = bb.y;
              }
              v0 += b0;
              v1 += b1;
              v2 += b0;
              v3 += b1;
            }
            if (aux_pass) {  // keep the pre-activation for the C pass
              d[4 * j] = v0;
              d[4 * j + 1] = v1;
              d[4 * j + 2] = v2;
              d[4 * j + 3] = v3;
            } else if (kBias) {
              v0 = gelu_tanh(v0);
              v1 = gelu_tanh(v1);
              v2 = gelu_tanh(v2);
              v3 = gelu_tanh(v3);
            }
            const uint32_t off = ((jj ^ swz) << 4) + 4 * (lane % 4);
            *reinterpret_cast<uint32_t*>(buf + row * 128 + off) = pack_bf16x2(v0, v1);
            *reinterpret_cast<uint32_t*>(buf + (row + 8) * 128 + off) = pack_bf16x2(v2, v3);
          }
          fence_proxy_async_smem();  // each writer: its st.shared visible to the TMA engine
          warpgroup_bar(1 + c);      // all 128 writers done
          if (leader) {
            tma_store(aux_pass ? &map_aux : &map_c, buf, col0, row0);
            bulk_commit();
          }
          prev_stored = true;
        }
      }
    }
  }
  if (leader) bulk_wait_all();  // shared memory must outlive the stores reading it
}

// ---------------------------------------------------------------- host side
int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) !=
                                                cudaSuccess)
    return 0;
  return n;
}

template <Epilogue E>
const char* launch(const void* A, const void* B, const void* bias, const void* aux, void* C, float* dbias, int M,
                   int N, int K, cudaStream_t stream) {
  constexpr bool kAux = E == Epilogue::kBiasGeluAux || E == Epilogue::kDGelu;
  if (M <= 0 || N <= 0 || K <= 0) return "wgmma_persistent needs M, N, K > 0";
  if (N % 8 || K % 8) return "wgmma_persistent needs N % 8 == 0 and K % 8 == 0 (TMA: 16-byte row strides)";
  if ((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B) | reinterpret_cast<uintptr_t>(C) |
       reinterpret_cast<uintptr_t>(bias) | reinterpret_cast<uintptr_t>(aux)) % 16)
    return kAux ? "wgmma_persistent needs 16-byte aligned A, B, C, AUX (and bias)"
                : "wgmma_persistent needs 16-byte aligned A, B, C (and bias)";
  if (E == Epilogue::kBiasGelu && bias == nullptr) return "wgmma_persistent_bias_gelu needs a bias";
  if (E == Epilogue::kBiasGeluAux && (bias == nullptr || aux == nullptr))
    return "wgmma_persistent_bias_gelu_aux needs a bias and AUX";
  if (E == Epilogue::kDGelu && (aux == nullptr || dbias == nullptr))
    return "wgmma_persistent_dgelu needs AUX and DBIAS";
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return "cuTensorMapEncodeTiled is not available from the CUDA driver";
  CUtensorMap map_a, map_b, map_c, map_aux;
  if (!make_map(encode, &map_a, A, K, M, BK, BM) || !make_map(encode, &map_b, B, N, K, BOX_N, BK) ||
      !make_map(encode, &map_c, C, N, M, EPI_N, 64))
    return "cuTensorMapEncodeTiled rejected the A, B or C tensor map";
  if (!kAux)
    map_aux = map_c;  // unused
  else if (!make_map(encode, &map_aux, aux, N, M, EPI_N, 64))  // AUX: shaped, boxed and swizzled like C
    return "cuTensorMapEncodeTiled rejected the AUX tensor map";
  const int sms = sm_count();
  if (sms <= 0) return "cannot query the number of SMs";
  auto* kernel = wgmma_persistent_kernel<E>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES) != cudaSuccess)
    return "cannot raise the dynamic shared-memory limit for the wgmma_persistent kernel";
  const long long tiles = static_cast<long long>((M + BM - 1) / BM) * ((N + BN - 1) / BN);
  const int grid = static_cast<int>(tiles < sms ? tiles : sms);
  kernel<<<grid, THREADS, SMEM_BYTES, stream>>>(map_a, map_b, map_c, map_aux, static_cast<const bf16*>(bias), dbias,
                                                M, N, K);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* gemm_wgmma_persistent(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t stream) {
  return launch<Epilogue::kPlain>(A, B, nullptr, nullptr, C, nullptr, M, N, K, stream);
}

const char* gemm_wgmma_persistent_bias_gelu(const void* A, const void* B, const void* bias, void* C, int M, int N,
                                            int K, cudaStream_t stream) {
  return launch<Epilogue::kBiasGelu>(A, B, bias, nullptr, C, nullptr, M, N, K, stream);
}

const char* gemm_wgmma_persistent_bias_gelu_aux(const void* A, const void* B, const void* bias, void* C, void* AUX,
                                                int M, int N, int K, cudaStream_t stream) {
  return launch<Epilogue::kBiasGeluAux>(A, B, bias, AUX, C, nullptr, M, N, K, stream);
}

const char* gemm_wgmma_persistent_dgelu(const void* A, const void* B, const void* AUX, void* C, float* DBIAS, int M,
                                        int N, int K, cudaStream_t stream) {
  return launch<Epilogue::kDGelu>(A, B, nullptr, AUX, C, DBIAS, M, N, K, stream);
}
