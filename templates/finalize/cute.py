"""finalize in CuTe DSL: the same result as the CUDA C++ variants, bit for bit.

    out[t, :] = sum_{k ascending, 0 <= e2p[t,k] < rows} w[t,k] * g[e2p[t,k], :H]      (fp32, then DTYPE)

Each product and each sum is rounded separately (`mul.rn.f32`, then `add.rn.f32`, written as inline PTX):
an explicit rounding modifier keeps ptxas from contracting them into one FFMA, which would change the low bits
against the CUDA C++ kernels and the torch reference. The sum starts at +0 and adds in k order, exactly as
they do; a slot whose index is outside [0, rows) adds nothing.

Layout (row-major, element strides; T, rows and ld are runtime values, the rest compile-time):
    g       [rows, H] stride (ld, 1)  DTYPE   ld % 8 == 0, base 16-byte aligned
    e2p, w  [T, K]    compact         int32 / WDTYPE (fp32 or bf16)
    out     [T, H]    compact         DTYPE

K <= 32: the indices and weights of a token stay in registers. Beyond 16 loads in flight per thread the builds
spill (max_loads 32 at 256 threads: 72-80 bytes), so 8 and 16 are the useful max_loads.

Mapping: a row of H 16-bit values is NV = H / 8 vectors of 128 bits; `ctas` CTAs share one token (no cluster:
each owns a contiguous slice of ceil(NV / ctas) vectors), grid = T * ctas. Thread i of a CTA owns vectors
slice + i + j*NT, j < I (consecutive threads, consecutive 16 bytes). A thread reads the token's K indices and
weights, then, for `group` = max(1, max_loads // K) of its vectors at a time, issues their row loads before
adding any (memory-level parallelism): all K rows at once, or, for K > max_loads, max_loads rows at a time in k
order. Each finished vector leaves with one 128-bit store. Accumulating from registers the loads were issued
into, the rows of a chunk are summed in k order, so chunking changes nothing in the result.
With `pdl`, it waits for its predecessor grid before reading and lets its dependents launch at once.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

WARP = 32
MAX_K = 32
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


def thread_shape(num_vec: int, ctas: int, max_threads: int) -> tuple[int, int, int]:
    """(vectors per CTA, threads per CTA, vectors per thread) for num_vec vectors over `ctas` CTAs."""
    per_cta = math.ceil(num_vec / ctas)
    iters = max(1, math.ceil(per_cta / max_threads))
    threads = max(WARP, math.ceil(math.ceil(per_cta / iters) / WARP) * WARP)
    return per_cta, threads, iters


@cute.jit
def _axpy_rn(acc: Float32, w: Float32, x: Float32) -> Float32:
    """acc + w * x with the product and the sum each rounded to nearest (never one fused multiply-add)."""
    return cute.arch.inline_ptx("{\n\t.reg .f32 p;\n\tmul.rn.f32 p, {$r0}, {$r1};\n\tadd.rn.f32 {$w0}, {$r2}, p;\n\t}",
                                write_only_types=[Float32], read_only_args=[w, x, acc])


class MoeFinalize:
    def __init__(self, dtype, wdtype, hidden: int, topk: int, *, threads: int, ctas: int, pdl: bool,
                 max_loads: int):
        assert dtype.width == 16, "bf16 / fp16 activations"
        assert topk <= MAX_K, f"K={topk}: at most {MAX_K} (indices and weights stay in registers)"
        self.dtype, self.wdtype = dtype, wdtype
        self.vec = 128 // dtype.width
        assert hidden % self.vec == 0, f"H={hidden} must be a multiple of {self.vec}"
        self.hidden, self.topk, self.pdl = hidden, topk, pdl
        self.num_vec = hidden // self.vec
        self.ctas = max(1, min(ctas, self.num_vec))
        self.per_cta, self.threads, self.iters = thread_shape(self.num_vec, self.ctas, threads)
        # loads in flight per thread: `chunk` rows of `group` vectors (all K rows when K <= max_loads)
        self.chunk = max(1, min(topk, max_loads))
        self.group = max(1, min(self.iters, max_loads // topk))
        self.need_pred = self.threads * self.iters != self.per_cta or self.per_cta * self.ctas != self.num_vec

    def _owned(self, tidx, first, i):
        """(vector, whether it is this thread's) of the thread's i-th vector; a plain trace-time helper."""
        lv = tidx + i * self.threads
        v = first + lv
        if const_expr(not self.need_pred):
            return v, True
        return v, (lv < self.per_cta) & (v < self.num_vec)

    @cute.jit
    def __call__(self, mG: cute.Tensor, mE2p: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mG, mE2p, mW, mOut).launch(grid=[mE2p.shape[0] * self.ctas, 1, 1], block=[self.threads, 1, 1],
                                               stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mE2p: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor):
        VEC, K = self.vec, self.topk
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx // self.ctas
        first = (bidx % self.ctas) * self.per_cta          # this CTA's first vector
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        rows = mG.shape[0]
        rIdx = cute.make_rmem_tensor((K,), Int32)
        rWn = cute.make_rmem_tensor((K,), self.wdtype)
        cute.autovec_copy(mE2p[t, None], rIdx)
        cute.autovec_copy(mW[t, None], rWn)
        for k in cutlass.range_constexpr(K):
            if rIdx[k] >= rows:
                rIdx[k] = Int32(-1)

        KC = self.chunk
        rX = cute.make_rmem_tensor((VEC, KC, self.group), self.dtype)
        rO = cute.make_rmem_tensor((VEC,), self.dtype)
        acc = cute.make_rmem_tensor((VEC, self.group), Float32)
        rXf = cute.make_rmem_tensor((VEC,), Float32)
        for g0 in cutlass.range_constexpr(0, self.iters, self.group):
            acc.fill(0.0)
            for k0 in cutlass.range_constexpr(0, K, KC):
                # every row load of the group and chunk first ...
                for j in cutlass.range_constexpr(self.group):
                    if const_expr(g0 + j < self.iters):
                        v, in_range = self._owned(tidx, first, g0 + j)
                        if in_range:
                            for k in cutlass.range_constexpr(k0, min(K, k0 + KC)):
                                if rIdx[k] >= 0:
                                    cute.autovec_copy(cute.local_tile(mG[rIdx[k], None], (VEC,), (v,)),
                                                      rX[None, k - k0, j])
                # ... then the sums, k ascending, one rounding per product and per sum
                for j in cutlass.range_constexpr(self.group):
                    if const_expr(g0 + j < self.iters):
                        for k in cutlass.range_constexpr(k0, min(K, k0 + KC)):
                            if rIdx[k] >= 0:
                                rXf.store(rX[None, k - k0, j].load().to(Float32))
                                wk = rWn[k].to(Float32)
                                for e in cutlass.range_constexpr(VEC):
                                    acc[e, j] = _axpy_rn(acc[e, j], wk, rXf[e])
            for j in cutlass.range_constexpr(self.group):
                if const_expr(g0 + j < self.iters):
                    v, in_range = self._owned(tidx, first, g0 + j)
                    if in_range:
                        rO.store(acc[None, j].load().to(self.dtype))
                        cute.autovec_copy(rO, cute.local_tile(mOut[t, None], (VEC,), (v,)))


def compile_kernel(*, H: int, K: int, DTYPE: str, WDTYPE: str, threads: int = 128, ctas: int = 1,
                   pdl: bool = False, max_loads: int = 16, ARCH: str = ""):
    """Compile one specialization with TVM-FFI; the result is called as f(g, e2p, w, out) on torch's current
    stream, g being gemm2_out's first H columns (a [rows, H] view with its row stride)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
    from cutlass.runtime import make_fake_stream

    dt, wdt = DTYPES[DTYPE], DTYPES[WDTYPE]
    T = cute.sym_int32(symbol="T")
    rows = cute.sym_int32(symbol="rows")
    ld = cute.sym_int64(divisibility=8, symbol="ld")
    g = make_fake_tensor(dt, (rows, H), (ld, 1), assumed_align=16)
    # routing data is only element-aligned (a slice of a larger buffer is a valid argument); out is 16-byte aligned
    per_token = lambda d, n, align: make_fake_compact_tensor(d, (T, n), stride_order=(1, 0), assumed_align=align)
    op = MoeFinalize(dt, wdt, H, K, threads=threads, ctas=ctas, pdl=pdl, max_loads=max_loads)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {ARCH}" if ARCH else "")
    return cute.compile(op, g, per_token(Int32, K, 4), per_token(wdt, K, wdt.width // 8), per_token(dt, H, 16),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options=options)
