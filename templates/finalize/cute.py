"""finalize in CuTe DSL: gather each token's top-k expert rows, weight them, reduce in fp32 (k ascending).

    out[t, :] = sum_{k ascending, 0 <= e2p[t,k] < rows} w[t,k] * g[e2p[t,k], :H]    -> DTYPE

Layout: g [rows, H] stride (ld, 1) with ld % 8 == 0 and a 16-byte aligned base; e2p [T, K] int32 and
w [T, K] fp32/bf16 compact; out [T, H] compact. T, rows and ld are runtime values.

Thread mapping: grid = (T), one CTA per token; block = NT threads (multiple of 32, at most `threads`);
a row is H / 8 vectors of 128 bits and thread tid owns vectors tid + j*NT, j < I = ceil(H / 8 / threads).
Every thread reads the token's K indices and weights (broadcast), issues the K 128-bit loads of up to
GROUP owned vectors back to back, then accumulates in ascending k and stores 128 bits. Same call
convention as the CUDA C++ variants minus `hidden`: f(g, e2p, w, out) on torch's current stream.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

WARP = 32
MAX_IN_FLIGHT = 32
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


class MoeFinalize:
    def __init__(self, dtype, wdtype, hidden: int, topk: int, *, threads: int, pdl: bool):
        self.dtype, self.wdtype, self.hidden, self.topk, self.pdl = dtype, wdtype, hidden, topk, pdl
        self.vec = 128 // dtype.width
        self.num_vec = hidden // self.vec
        self.iters = max(1, math.ceil(self.num_vec / threads))
        self.threads = max(WARP, math.ceil(math.ceil(self.num_vec / self.iters) / WARP) * WARP)
        self.need_pred = self.threads * self.iters != self.num_vec
        self.group = max(1, min(self.iters, MAX_IN_FLIGHT // topk))

    @cute.jit
    def _vec(self, row: cute.Tensor, v: Int32) -> cute.Tensor:
        return cute.local_tile(row, (self.vec,), (v,))

    @cute.jit
    def __call__(self, mG: cute.Tensor, mE2p: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mG, mE2p, mW, mOut).launch(grid=[mE2p.shape[0], 1, 1], block=[self.threads, 1, 1],
                                               stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mE2p: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor):
        VEC, K, NT = self.vec, self.topk, self.threads
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        rows = mG.shape[0]
        rIdx = cute.make_rmem_tensor((K,), Int32)
        rWn = cute.make_rmem_tensor((K,), self.wdtype)
        cute.autovec_copy(mE2p[t, None], rIdx)
        cute.autovec_copy(mW[t, None], rWn)
        rW = cute.make_rmem_tensor((K,), Float32)
        rW.store(rWn.load().to(Float32))
        for k in cutlass.range_constexpr(K):
            if rIdx[k] >= rows:
                rIdx[k] = Int32(-1)
            if rIdx[k] < 0:
                rW[k] = Float32(0.0)
        rX = cute.make_rmem_tensor((VEC, K, self.group), self.dtype)
        rO = cute.make_rmem_tensor((VEC,), self.dtype)
        for g0 in cutlass.range_constexpr(0, self.iters, self.group):
            for j in cutlass.range_constexpr(self.group):
                if const_expr(g0 + j < self.iters):
                    v = tidx + (g0 + j) * NT
                    in_range = True
                    if const_expr(self.need_pred):
                        in_range = v < self.num_vec
                    if in_range:
                        for k in cutlass.range_constexpr(K):
                            row = rIdx[k]
                            if row >= 0:
                                cute.autovec_copy(self._vec(mG[row, None], v), rX[None, k, j])
                            else:
                                rX[None, k, j].fill(0.0)
            for j in cutlass.range_constexpr(self.group):
                if const_expr(g0 + j < self.iters):
                    v = tidx + (g0 + j) * NT
                    in_range = True
                    if const_expr(self.need_pred):
                        in_range = v < self.num_vec
                    if in_range:
                        a = cute.zeros_like(rX[None, 0, j].load().to(Float32))
                        for k in cutlass.range_constexpr(K):
                            a = a + rW[k] * rX[None, k, j].load().to(Float32)
                        rO.store(a.to(self.dtype))
                        cute.autovec_copy(rO, self._vec(mOut[t, None], v))


def compile_kernel(*, H: int, K: int, DTYPE: str, WDTYPE: str, threads: int, pdl: bool = False, ARCH: str = ""):
    """Compile one specialization with TVM-FFI: f(g, e2p, w, out) on torch's current stream."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
    from cutlass.runtime import make_fake_stream

    dt, wdt = DTYPES[DTYPE], DTYPES[WDTYPE]
    T = cute.sym_int32(symbol="T")
    rows = cute.sym_int32(symbol="rows")
    ld = cute.sym_int64(divisibility=8, symbol="ld")

    def per_token(d, n):
        return make_fake_compact_tensor(d, (T, n), stride_order=(1, 0), assumed_align=16)

    args = (make_fake_tensor(dt, (rows, H), (ld, 1), assumed_align=16), per_token(Int32, K), per_token(wdt, K),
            per_token(dt, H), make_fake_stream(use_tvm_ffi_env_stream=True))
    op = MoeFinalize(dt, wdt, H, K, threads=threads, pdl=pdl)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {ARCH}" if ARCH else "")
    return cute.compile(op, *args, options=options)
