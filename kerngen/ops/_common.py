"""Input checks and kernel resolution shared by the ops."""
from __future__ import annotations

import torch

from .. import tiers
from ..errors import DeviceError, InputError
from ..launch import resident, resolve  # noqa: F401  (resolve: re-exported for the ops, which the tests stub)
from ..occupancy import Launch
from ..plan import sm_count, target_arch   # sm_count: re-exported for the ops

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "f32"}


KERNEL_DEVICES = ("cuda",)   # device types whose tensors take the kernels' path (tests add "cpu" with stub launchers)
# The CPU rule, one for every op that launches kernels: CUDA tensors only, a CPU tensor an InputError naming the
# argument and where the same semantics run on the CPU (its torch op and reference: the kernels' checks, then the
# reference); by op name as the errors give it
CPU_ENTRY = {
    "routing": "torch.ops.kerngen.route / route_permute, kerngen.select_experts or kerngen.ops.routing.reference",
    "permute": "kerngen.ops.permute.reference",
    "moe_align_block_size": "torch.ops.kerngen.moe_align_block_size or kerngen.adapters.moe_align_block_size",
    "experts": "torch.ops.kerngen.moe_experts or kerngen.ops.experts.reference",
    "finalize": "torch.ops.kerngen.finalize or kerngen.ops.finalize.reference",
    "tail": "torch.ops.kerngen.moe_tail or kerngen.ops.tail.reference",
    "latent_tail": "torch.ops.kerngen.latent_tail or kerngen.ops.latent_tail.reference"}


def check_tensor(op: str, name: str, t, *, dtypes=None, ndim=None, device=None, contiguous=False):
    if not isinstance(t, torch.Tensor):
        raise InputError(op, name, "a torch.Tensor", type(t).__name__)
    if dtypes is not None and t.dtype not in dtypes:
        raise InputError(op, name, f"of dtype {' or '.join(str(d) for d in dtypes)}", str(t.dtype))
    if ndim is not None and t.dim() != ndim:
        raise InputError(op, name, f"{ndim}-dimensional", f"shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise InputError(op, name, f"on {device} (same device as the other inputs)", str(t.device))
    elif device is None and t.device.type not in KERNEL_DEVICES:
        raise InputError(op, name, "a CUDA tensor (kerngen's kernels run on the GPU; on the CPU: "
                         f"{CPU_ENTRY.get(op, 'torch.ops.kerngen.* and the references')})", f"a tensor on {t.device}")
    if contiguous and not t.is_contiguous():
        raise InputError(op, name, "contiguous", f"strides {t.stride()}")


def check_eps(op: str, eps) -> None:
    """A norm's eps: a finite number >= 0 (a bool is not one)."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < float("inf"):
        raise InputError(op, "eps", "a finite number >= 0", repr(eps))


def check_int(op: str, name: str, v, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InputError(op, name, f"an integer in [{lo}, {hi}]", repr(v))


def check_local(op: str, local_experts, E: int) -> tuple[int, int]:
    """An expert-parallel range (local_start, num_local) inside [0, E), or all E experts for None."""
    if local_experts is None:
        return 0, E
    if (not isinstance(local_experts, (tuple, list)) or len(local_experts) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in local_experts)):
        raise InputError(op, "local_experts", "a pair (local_start, num_local) of integers", repr(local_experts))
    ls, nl = local_experts
    if ls < 0 or nl < 1 or ls + nl > E:
        raise InputError(op, "local_experts", f"a range inside [0, {E}) with num_local >= 1", repr(local_experts))
    return ls, nl


def require_gpu(what: str) -> None:
    """A kerngen error, not torch's, when `what` needs a CUDA GPU and torch sees none."""
    if torch.cuda.is_available():
        return
    why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
    raise DeviceError(f"{what} needs a CUDA GPU, and {why}. Kernels can still be built without one "
                      "(kerngen warmup --model NAME --arch sm_90a); the CPU entry points (torch.ops.kerngen.*, "
                      "select_experts, the references) run on CPU tensors.")


def check_aligned(op: str, name: str, t: torch.Tensor, nbytes: int = 16, why: str = "128-bit loads"):
    if type(t) is not torch.Tensor and _fake(t):   # torch.compile's tracing: no address to check yet
        return
    if t.data_ptr() % nbytes:
        raise InputError(op, name, f"{nbytes}-byte aligned ({why})", f"address offset {t.data_ptr() % nbytes}")


def _fake(t) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def check_buffer(op: str, name: str, t, dtype, shape: tuple, device, align: int = 0) -> None:
    """An output buffer: a contiguous tensor of `dtype` on `device` (`align`-byte aligned if given) of `shape`."""
    check_tensor(op, name, t, dtypes=(dtype,), ndim=len(shape), device=device, contiguous=True)
    if align:
        check_aligned(op, name, t, align)
    if tuple(t.shape) != tuple(shape):
        raise InputError(op, name, f"of shape {tuple(shape)}", f"shape {tuple(t.shape)}")


def check_gather_inputs(op: str, g, e2p, w, acts, weights, max_k: int, *, cuda: bool = True) -> tuple[int, int]:
    """gemm2_out / expanded_to_permuted / topk_weights of the ops that combine top-k rows; returns (T, K).
    cuda=False takes tensors on any one device (the CPU entry points that run the reference)."""
    check_tensor(op, "gemm2_out", g, dtypes=acts, ndim=2, device=None if cuda else getattr(g, "device", None))
    check_tensor(op, "expanded_to_permuted", e2p, dtypes=(torch.int32,), ndim=2, device=g.device, contiguous=True)
    check_tensor(op, "topk_weights", w, dtypes=weights, ndim=2, device=g.device, contiguous=True)
    T, K = e2p.shape
    if tuple(w.shape) != (T, K):
        raise InputError(op, "topk_weights", f"of shape {(T, K)} like expanded_to_permuted", f"{tuple(w.shape)}")
    if not 1 <= K <= max_k:
        raise InputError(op, "expanded_to_permuted", f"[T, K] with 1 <= K <= {max_k}", f"K = {K}")
    return T, K


def check_rows(op: str, g, H: int) -> None:
    """gemm2_out's row layout for 16-byte loads of the first H columns of each row."""
    if g.stride(1) != 1 or g.stride(0) % 8 or g.stride(0) < H:
        raise InputError(op, "gemm2_out", "row-major with a contiguous last dim and a row stride that is a "
                         f"multiple of 8 and >= {H}", f"strides {g.stride()}")
    if g.shape[0] >= 2**31 or g.stride(0) >= 2**31:
        raise InputError(op, "gemm2_out", "fewer than 2**31 rows and row stride", f"shape {tuple(g.shape)}")


def identity_rows(kept: dict, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """finalize's arguments for T rows already summed (the TP tails' all-reduced rows): expanded_to_permuted
    arange(T) [T, 1] int32 and weights ones [T, 1] fp32, kept per T in `kept` (the dispatch object's that serves
    the call, as Dispatch.kept)."""
    hit = kept.get(("identity", T))
    if hit is None:
        hit = kept[("identity", T)] = (torch.arange(T, dtype=torch.int32, device=device).view(T, 1),
                                       torch.ones((T, 1), dtype=torch.float32, device=device))
    return hit


def table() -> tiers.Table:
    return tiers.load()


def arch(device: int) -> str:
    return target_arch(device)


def persistent_ctas(op: str, module, name: str, device: int, launch: Launch) -> int:
    """The CTAs of a persistent grid of kernel `name` on `device`: the rule's CTAs an SM (launch.per_sm), but no more
    than one SM holds at once (the driver's count: a grid of more runs as two waves), times the SMs. Device -1 (CPU
    tensors with stub launchers, tools): per_sm times tiers.SMS."""
    if device < 0:
        return launch.per_sm * tiers.SMS
    fits = resident(module.function(name, device), launch.threads, launch.dynamic_smem)
    if fits < 1:
        raise InputError(op, "tier params", f"a launch shape whose CTA of {name} fits an SM",
                         f"{launch.threads} threads and {launch.dynamic_smem} B of dynamic shared memory a CTA, of "
                         "which the driver says no SM holds one")
    return min(launch.per_sm, fits) * sm_count(device)
