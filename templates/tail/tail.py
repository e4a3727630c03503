"""Fused MoE tail (CuTe DSL): top-k combine + shared expert + residual + RMSNorm, one kernel.

    y[t]            = sum_{k ascending, 0 <= e2p[t,k] < rows} w[t,k] * g[e2p[t,k], :H]   (fp32)
                      + shared[t] (optional) + residual[t] (optional)
    residual_out[t] = y[t].to(DTYPE)                                                   (optional)
    n[t]            = y[t] * rsqrt(mean(y[t]^2) + eps) * norm_w                        (fp32)
    out[t]          = n[t].to(ODTYPE)                                                  (bf16 / fp16)
  or, with ODTYPE float8_e4m3fn, per 128-column block b (DeepSeek-V3 activation quantization):
    scales[t, b]    = max(amax(|n[t, 128b : 128b+128]|), 1e-12) / 448                  (fp32, NaN propagates)
    out[t, 128b+c]  = (n[t, 128b+c] / scales[t, b]).to(e4m3)        (round to nearest even, saturate to +-448)

y lives in registers only; the finalized [T, H] row is never written to global memory.

Layout (row-major, element strides; T, rows and ld are runtime values, everything else compile-time):
    g       [rows, H] stride (ld, 1)  DTYPE   ld % 8 == 0, base 16-byte aligned
    e2p, w  [T, K]    compact         int32 / WDTYPE (fp32 or bf16)
    shared, residual, residual_out [T, H] compact DTYPE;  norm_w [H] DTYPE;  out [T, H] compact ODTYPE
    scales  [T, H / 128] compact fp32 (fp8 output only; H % 128 == 0)
    eps     fp32 runtime scalar

Tiling and thread mapping:
* A token row of H 16-bit values is NV = H / 8 vectors of 128 bits. `cluster` = C CTAs share one token:
  grid = (T * C), cluster = (C), CTA rank r of token t = blockIdx.x / C owns vectors [r * NT * I, (r+1) * NT * I).
* Block = NT threads (a multiple of 32, at most `threads`), I = ceil(NV / (C * threads)) vectors per thread:
  thread i of the CTA owns vectors r*NT*I + tid + j*NT, j < I (consecutive threads -> consecutive 16 bytes,
  so each warp access is one coalesced 512-byte transaction); vectors >= NV are predicated off.
* Every thread reads the token's K indices and weights (broadcast loads), then issues the K 128-bit loads
  of up to GROUP = max(1, max_loads // K) owned vectors back to back (all in flight at once), then
  accumulates them in ascending k.
  Shared, residual and norm weight vectors are loaded in the same batch. A slot whose index is outside
  [0, rows) never leaks a NaN: with `branch_free` it loads row 0 instead (no branch around loads, so none
  waits for another: best for latency at few tokens; the host never passes rows == 0) and is left out of
  the sum; without, its load is skipped and it adds 0 * 0 (best for bandwidth at many tokens, measured).
* RMSNorm: thread sum of y^2 -> warp butterfly -> one fp32 per warp in shared memory -> CTA sum in warp
  order. With C > 1, thread p of each CTA stores the CTA's sum into CTA p's shared memory (distributed
  shared memory, st.shared::cluster), one cluster barrier, and every CTA adds the C partials in rank order
  (so all CTAs of a token use the same rstd). A cluster barrier at kernel start guarantees every peer runs.
  With `async_reduce` (C > 1) the partials travel by st.async, each counted by an mbarrier of the receiving CTA
  (thread 0 arms it for C * 4 bytes before the kernel-start arrive), so no second cluster barrier: its release
  semantics cost a GPU-wide fence (MEMBAR.ALL.GPU on sm_90a). The same partials, added in the same order.
* fp8 output: a 128-column block is 16 consecutive vectors, and each CTA's first vector and NT are multiples
  of 32, so for every j lanes 0-15 and lanes 16-31 of a warp each hold one whole block. Each lane takes the
  max |n| of its 8 values; a 16-lane butterfly (shfl.bfly 8, 4, 2, 1) gives the block amax. Every lane of
  the warp shuffles, outside any predicate: with H % 128 == 0 a half-warp is all in range or all out, and
  an out-of-range lane contributes 0. Each lane computes the same scale, divides its 8 values by it (IEEE
  division, as the reference does), converts them to e4m3 (cvt.rn.satfinite) and stores 8 bytes (64-bit
  store); the first lane of the half-warp stores the scale.
* With `pdl`, the kernel waits for its predecessor grid (griddepcontrol.wait) before reading any input
  and lets its dependents launch at once; they in turn wait for this grid to finish before reading.

Code: `MoeTail.kernel` is the sequence of phases: prologue, load_routing, then per group load_vector and
finalize_vector (combine_topk, shared, residual) for each owned vector, sum_squares -> warp_reduce -> cta_reduce
-> cluster_reduce, rstd, norm_store or quantize_store (block_amax). Each phase is a @cute.jit helper, traced
inline where it is called, whose docstring says what each thread does. Helpers take a tensor and the token
(mOut, t) rather than the token's row, so each row is sliced where the original inline code sliced it: the
kernels' SASS is what it was before the split.
"""
from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

VEC_BITS = 128
WARP = 32
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
          "float8_e4m3fn": cutlass.Float8E4M3FN}
FP8_BLOCK = 128     # columns per scale
FP8_MAX = 448.0     # largest finite e4m3fn
SCALE_FLOOR = 1e-12


def thread_shape(hidden: int, cluster: int, max_threads: int, vec: int = 8) -> tuple[int, int]:
    """(threads per CTA, vectors per thread) covering hidden / vec vectors with `cluster` CTAs."""
    per_cta = math.ceil(hidden // vec / cluster)
    iters = max(1, math.ceil(per_cta / max_threads))
    threads = max(WARP, math.ceil(math.ceil(per_cta / iters) / WARP) * WARP)
    return threads, iters


class MoeTail:
    def __init__(self, dtype, wdtype, odtype, hidden: int, topk: int, *, threads: int, cluster: int,
                 pdl: bool, max_loads: int, branch_free: bool, async_reduce: bool = False):
        assert dtype.width == 16 and odtype.width in (16, 8), "bf16/fp16 activations, bf16/fp16/e4m3 outputs"
        self.dtype, self.wdtype, self.odtype = dtype, wdtype, odtype
        self.vec = VEC_BITS // dtype.width
        assert hidden % self.vec == 0, f"H={hidden} must be a multiple of {self.vec}"
        self.fp8 = odtype is cutlass.Float8E4M3FN
        self.lanes_per_block = FP8_BLOCK // self.vec  # lanes that share one scale (16)
        assert not self.fp8 or hidden % FP8_BLOCK == 0, f"fp8 output needs H={hidden} a multiple of {FP8_BLOCK}"
        self.hidden, self.topk, self.cluster, self.pdl, self.branch_free = hidden, topk, cluster, pdl, branch_free
        self.num_vec = hidden // self.vec
        self.stride, self.iters = thread_shape(hidden, cluster, threads, self.vec)   # threads covering the row once
        self.threads = self.stride
        self.num_warps = self.threads // WARP
        self.need_pred = self.stride * self.iters * cluster != self.num_vec
        self.group = max(1, min(self.iters, max_loads // topk))  # owned vectors whose loads fly together
        self.async_reduce = async_reduce and cluster > 1

    @cute.jit
    def _vec(self, row: cute.Tensor, v: Int32) -> cute.Tensor:
        """Vector v (VEC consecutive elements, 16 bytes) of a row."""
        return cute.local_tile(row, (self.vec,), (v,))

    @cute.jit
    def _in_range(self, v: Int32):
        """Whether vector v lies inside the row (True at compile time when the tiling covers it exactly)."""
        in_range = True
        if const_expr(self.need_pred):
            in_range = v < self.num_vec
        return in_range

    @cute.jit
    def __call__(self, mG: cute.Tensor, mE2p: cute.Tensor, mW: cute.Tensor, mShared: Optional[cute.Tensor],
                 mRes: Optional[cute.Tensor], mNormW: cute.Tensor, mOut: cute.Tensor,
                 mScales: Optional[cute.Tensor], mResOut: Optional[cute.Tensor], eps: Float32, stream):
        num_tokens = mE2p.shape[0]
        if const_expr(self.cluster > 1):
            self.kernel(mG, mE2p, mW, mShared, mRes, mNormW, mOut, mScales, mResOut, eps).launch(
                grid=[num_tokens * self.cluster, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
                stream=stream, use_pdl=self.pdl)
        else:
            self.kernel(mG, mE2p, mW, mShared, mRes, mNormW, mOut, mScales, mResOut, eps).launch(
                grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mE2p: cute.Tensor, mW: cute.Tensor, mShared: Optional[cute.Tensor],
               mRes: Optional[cute.Tensor], mNormW: cute.Tensor, mOut: cute.Tensor,
               mScales: Optional[cute.Tensor], mResOut: Optional[cute.Tensor], eps: Float32):
        VEC, K, NT = self.vec, self.topk, self.stride
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((self.num_warps,)), 16)
        sPeer = smem.allocate_tensor(Float32, cute.make_layout((self.cluster,)), 16)
        sBar = None
        if const_expr(self.async_reduce):   # the mbarrier armed before the kernel-start cluster arrive
            sBar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((1,)), 8)
            if tidx == 0:
                cute.arch.mbarrier_init(sBar.iterator, 1)
                cute.arch.mbarrier_arrive_and_expect_tx(sBar.iterator, self.cluster * 4)
                cute.arch.mbarrier_init_fence()
        t, base = self.prologue(tidx)

        rIdx, rSafe, rW = self.load_routing(mE2p, mW, t, mG.shape[0])
        acc = cute.make_rmem_tensor((VEC, self.iters), Float32)   # y, fp32, owned vector i in acc[None, i]
        rNw = cute.make_rmem_tensor((VEC, self.iters), self.dtype)
        rX = cute.make_rmem_tensor((VEC, K, self.group), self.dtype)
        rS = rR = None   # shared and residual vectors, when given
        if const_expr(mShared is not None):
            rS = cute.make_rmem_tensor((VEC, self.group), self.dtype)
        if const_expr(mRes is not None):
            rR = cute.make_rmem_tensor((VEC, self.group), self.dtype)
        rTmp = cute.make_rmem_tensor((VEC,), self.dtype)
        for g0 in cutlass.range_constexpr(0, self.iters, self.group):
            # every load of the group in flight at once (memory-level parallelism), then the sums
            for j in cutlass.range_constexpr(min(self.group, self.iters - g0)):
                self.load_vector(mG, mShared, mRes, mNormW, t, base + (g0 + j) * NT, rIdx, rSafe, rX, rS, rR, j,
                                 rNw[None, g0 + j])
            for j in cutlass.range_constexpr(min(self.group, self.iters - g0)):
                self.finalize_vector(acc[None, g0 + j], mResOut, t, base + (g0 + j) * NT, rIdx, rW, rX, rS, rR, j,
                                     rTmp)

        total = self.cta_reduce(self.warp_reduce(self.sum_squares(acc)), sRed)
        if const_expr(self.async_reduce):
            total = self.cluster_reduce_async(total, sPeer, sBar, tidx)
        elif const_expr(self.cluster > 1):
            total = self.cluster_reduce(total, sPeer, tidx)
        rstd = cute.math.rsqrt(total / Float32(self.hidden) + eps)

        rO = cute.make_rmem_tensor((VEC,), self.odtype)
        rN = cute.make_rmem_tensor((VEC,), Float32)
        for i in cutlass.range_constexpr(self.iters):
            if const_expr(not self.fp8):
                self.norm_store(acc[None, i], rNw[None, i], rstd, mOut, t, base + i * NT, rO)
            else:
                self.quantize_store(acc[None, i], rNw[None, i], rstd, mOut, mScales, t, base + i * NT, tidx, rN, rO)

    @cute.jit
    def prologue(self, tidx: Int32):
        """Each thread: (its token t, its first owned vector); arrives on the cluster barrier, waits for the
        previous grid (pdl)."""
        bidx, _, _ = cute.arch.block_idx()
        t = bidx
        base = tidx
        if const_expr(self.cluster > 1):
            cute.arch.cluster_arrive_relaxed()  # paired with the wait before the first remote store
            t = bidx // self.cluster
            base = (bidx % self.cluster) * (self.stride * self.iters) + tidx
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        return t, base

    @cute.jit
    def load_routing(self, mE2p: cute.Tensor, mW: cute.Tensor, t: Int32, rows: Int32):
        """Each thread: the token's K row indices and fp32 weights (broadcast loads); an index outside [0, rows)
        becomes -1 with weight 0, and its safe index (the row branch-free loads read) 0."""
        K = self.topk
        rIdx = cute.make_rmem_tensor((K,), Int32)
        rWn = cute.make_rmem_tensor((K,), self.wdtype)
        cute.autovec_copy(mE2p[t, None], rIdx)
        cute.autovec_copy(mW[t, None], rWn)
        rW = cute.make_rmem_tensor((K,), Float32)
        rW.store(rWn.load().to(Float32))
        rSafe = cute.make_rmem_tensor((K,), Int32)
        for k in cutlass.range_constexpr(K):
            if rIdx[k] >= rows:
                rIdx[k] = Int32(-1)
            rSafe[k] = rIdx[k]
            if rIdx[k] < 0:
                rSafe[k] = Int32(0)
                rW[k] = Float32(0.0)
        return rIdx, rSafe, rW

    @cute.jit
    def load_vector(self, mG: cute.Tensor, mShared: Optional[cute.Tensor], mRes: Optional[cute.Tensor],
                    mNormW: cute.Tensor, t: Int32, v: Int32, rIdx: cute.Tensor, rSafe: cute.Tensor,
                    rX: cute.Tensor, rS: Optional[cute.Tensor], rR: Optional[cute.Tensor], j: int,
                    rNw: cute.Tensor):
        """Each thread: issues the K expert-row loads of its vector v (row 0 for a skipped slot when branch-free,
        else zeros), and the shared, residual and norm weight loads, into load slot j; none waits on another."""
        if self._in_range(v):
            for k in cutlass.range_constexpr(self.topk):
                if const_expr(self.branch_free):  # no branch: no load waits for another
                    cute.autovec_copy(self._vec(mG[rSafe[k], None], v), rX[None, k, j])
                else:
                    if rIdx[k] >= 0:
                        cute.autovec_copy(self._vec(mG[rIdx[k], None], v), rX[None, k, j])
                    else:
                        rX[None, k, j].fill(0.0)
            if const_expr(mShared is not None):
                cute.autovec_copy(self._vec(mShared[t, None], v), rS[None, j])
            if const_expr(mRes is not None):
                cute.autovec_copy(self._vec(mRes[t, None], v), rR[None, j])
            cute.autovec_copy(self._vec(mNormW, v), rNw)

    @cute.jit
    def finalize_vector(self, y: cute.Tensor, mResOut: Optional[cute.Tensor], t: Int32, v: Int32,
                        rIdx: cute.Tensor, rW: cute.Tensor, rX: cute.Tensor, rS: Optional[cute.Tensor],
                        rR: Optional[cute.Tensor], j: int, rTmp: cute.Tensor):
        """Each thread: y = sum_k w[k] * x[k] in ascending k (+ shared + residual) in fp32 for its vector v from
        load slot j, written rounded as the new residual (optional); y = 0 out of range."""
        y.fill(0.0)
        if self._in_range(v):
            self.combine_topk(y, rIdx, rW, rX, j)
            if const_expr(rS is not None):
                y.store(y.load() + rS[None, j].load().to(Float32))
            if const_expr(rR is not None):
                y.store(y.load() + rR[None, j].load().to(Float32))
            if const_expr(mResOut is not None):
                rTmp.store(y.load().to(self.dtype))
                cute.autovec_copy(rTmp, self._vec(mResOut[t, None], v))

    @cute.jit
    def combine_topk(self, y: cute.Tensor, rIdx: cute.Tensor, rW: cute.Tensor, rX: cute.Tensor, j: int):
        """Each thread: y += sum_k w[k] * x[k] over the K rows of load slot j in ascending k, skipped slots left
        out."""
        if const_expr(self.branch_free):
            for k in cutlass.range_constexpr(self.topk):
                if rIdx[k] >= 0:  # a skipped slot's row 0 stand-in (maybe NaN) never enters the sum
                    y.store(y.load() + rW[k] * rX[None, k, j].load().to(Float32))
        a = y.load()
        if const_expr(not self.branch_free):  # skipped slots hold x = 0 and w = 0
            for k in cutlass.range_constexpr(self.topk):
                a = a + rW[k] * rX[None, k, j].load().to(Float32)
        y.store(a)

    @cute.jit
    def sum_squares(self, acc: cute.Tensor) -> Float32:
        """Each thread: the sum of y^2 over its owned values."""
        y = acc.load()
        return (y * y).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)

    @cute.jit
    def warp_reduce(self, val: Float32) -> Float32:
        """Each lane: the sum of val over its warp (butterfly shuffle)."""
        return cute.arch.warp_reduction_sum(val)

    @cute.jit
    def cta_reduce(self, val: Float32, sRed: cute.Tensor) -> Float32:
        """Each thread: the CTA's sum; lane 0 of each warp stores its warp's sum in shared memory, all threads add
        them in warp order."""
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        if lane == 0:
            sRed[warp] = val
        cute.arch.sync_threads()
        total = Float32(0.0)
        for w in cutlass.range_constexpr(self.num_warps):
            total = total + sRed[w]
        return total

    @cute.jit
    def cluster_reduce(self, val: Float32, sPeer: cute.Tensor, tidx: Int32) -> Float32:
        """Each thread: the cluster's sum; thread p stores its CTA's sum into CTA p's shared memory (distributed
        shared memory), then every thread adds the C partials in rank order."""
        rank = cute.arch.block_idx_in_cluster()
        cute.arch.cluster_wait()  # every peer CTA is running: its shared memory may be written
        if tidx < self.cluster:
            self.store_peer(sPeer.iterator + rank, tidx, val)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        total = Float32(0.0)
        for p in cutlass.range_constexpr(self.cluster):
            total = total + sPeer[p]
        return total

    @cute.jit
    def cluster_reduce_async(self, val: Float32, sPeer: cute.Tensor, sBar: cute.Tensor, tidx: Int32) -> Float32:
        """Each thread: the cluster's sum; thread p sends its CTA's sum into CTA p's shared memory by st.async,
        counted by CTA p's mbarrier; every thread waits on its own CTA's mbarrier (all C partials arrived), then
        adds the C partials in rank order."""
        rank = cute.arch.block_idx_in_cluster()
        cute.arch.cluster_wait()  # every peer CTA runs and has armed its mbarrier
        if tidx < self.cluster:
            self.store_peer_async(sPeer.iterator + rank, sBar.iterator, tidx, val)
        cute.arch.mbarrier_wait(sBar.iterator, 0)
        total = Float32(0.0)
        for p in cutlass.range_constexpr(self.cluster):
            total = total + sPeer[p]
        return total

    @cute.jit
    def store_peer_async(self, ptr, bar, peer: Int32, val: Float32):
        """This thread: val at ptr's address in the shared memory of CTA `peer`, its 4 bytes counted by that CTA's
        mbarrier at bar's address (st.async ... mbarrier::complete_tx::bytes)."""
        cute.arch.inline_ptx("{\n\t.reg .b32 remote, rbar;\n\tmapa.shared::cluster.u32 remote, {$r0}, {$r1};\n\t"
                             "mapa.shared::cluster.u32 rbar, {$r2}, {$r1};\n\t"
                             "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [remote], {$r3}, [rbar];\n\t}",
                             read_only_args=[ptr.toint(), peer, bar.toint(), val])

    @cute.jit
    def store_peer(self, ptr, peer: Int32, val: Float32):
        """This thread: stores val at ptr's address in the shared memory of CTA `peer` of the cluster (inline PTX:
        the DSL's map_dsmem_ptr result takes neither a tensor store nor cute.arch.store)."""
        cute.arch.inline_ptx("{\n\t.reg .b32 remote;\n\tmapa.shared::cluster.u32 remote, {$r0}, {$r1};\n\t"
                             "st.shared::cluster.f32 [remote], {$r2};\n\t}",
                             read_only_args=[ptr.toint(), peer, val])

    @cute.jit
    def norm_store(self, y: cute.Tensor, nw: cute.Tensor, rstd: Float32, mOut: cute.Tensor, t: Int32, v: Int32,
                   rO: cute.Tensor):
        """Each thread: out[t, vector v] = y * rstd * norm_w rounded to ODTYPE, one 128-bit store."""
        if self._in_range(v):
            rO.store((y.load() * rstd * nw.load().to(Float32)).to(self.odtype))
            cute.autovec_copy(rO, self._vec(mOut[t, None], v))

    @cute.jit
    def quantize_store(self, y: cute.Tensor, nw: cute.Tensor, rstd: Float32, mOut: cute.Tensor,
                       mScales: cute.Tensor, t: Int32, v: Int32, tidx: Int32, rN: cute.Tensor, rO: cute.Tensor):
        """Each thread: n = y * rstd * norm_w, divided by its 128-column block's scale and rounded to e4m3 (one
        64-bit store); the first lane of the block also stores the scale."""
        in_range = self._in_range(v)
        amax = Float32(0.0)
        if in_range:
            rN.store(y.load() * rstd * nw.load().to(Float32))
            for e in cutlass.range_constexpr(self.vec):
                amax = cute.arch.fmax(amax, abs(rN[e]), nan=True)
        amax = self.block_amax(amax)  # every lane shuffles (out-of-range lanes add 0)
        if in_range:
            scale = cute.arch.fmax(amax, Float32(SCALE_FLOOR), nan=True) / Float32(FP8_MAX)
            rO.store((rN.load() / scale).to(self.odtype))  # cvt.rn.satfinite: RNE, saturates to 448
            cute.autovec_copy(rO, self._vec(mOut[t, None], v))
            if tidx % self.lanes_per_block == 0:
                mScales[t, v // self.lanes_per_block] = scale

    @cute.jit
    def block_amax(self, val: Float32) -> Float32:
        """Each lane: the max of val over its half-warp, the 16 lanes of one 128-column block (NaN propagates)."""
        return cute.arch.warp_reduction(val, lambda a, b: cute.arch.fmax(a, b, nan=True),
                                        threads_in_group=self.lanes_per_block)


def compile_kernel(*, H: int, K: int, DTYPE: str, WDTYPE: str, ODTYPE: str, SHARED: bool, RESIDUAL: bool,
                   RESIDUAL_OUT: bool, threads: int, cluster: int = 1, pdl: bool = False, max_loads: int = 32,
                   branch_free: bool = True, async_reduce: bool = False, ARCH: str = ""):
    """Compile one specialization with TVM-FFI. The result is called as
    f(g, e2p, w, shared|None, residual|None, norm_w, out, scales|None, residual_out|None, eps) on torch's
    current stream; None goes exactly where the flags say it does (scales: with ODTYPE float8_e4m3fn)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
    from cutlass.runtime import make_fake_stream

    dt, wdt, odt = DTYPES[DTYPE], DTYPES[WDTYPE], DTYPES[ODTYPE]
    T = cute.sym_int32(symbol="T")
    rows = cute.sym_int32(symbol="rows")
    ld = cute.sym_int64(divisibility=8, symbol="ld")

    def per_token(d, n):
        return make_fake_compact_tensor(d, (T, n), stride_order=(1, 0), assumed_align=16)

    g = make_fake_tensor(dt, (rows, H), (ld, 1), assumed_align=16)
    args = (g, per_token(Int32, K), per_token(wdt, K), per_token(dt, H) if SHARED else None,
            per_token(dt, H) if RESIDUAL else None, make_fake_compact_tensor(dt, (H,), assumed_align=16),
            per_token(odt, H),
            make_fake_compact_tensor(Float32, (T, H // FP8_BLOCK), stride_order=(1, 0), assumed_align=4)
            if odt is cutlass.Float8E4M3FN else None,
            per_token(dt, H) if RESIDUAL_OUT else None, Float32(1e-6),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    op = MoeTail(dt, wdt, odt, H, K, threads=threads, cluster=cluster, pdl=pdl, max_loads=max_loads,
                 branch_free=branch_free, async_reduce=async_reduce)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {ARCH}" if ARCH else "")
    return cute.compile(op, *args, options=options)
