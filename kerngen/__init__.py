"""kerngen: JIT-generated MoE kernels (routing, finalize, fused tail), compiled per shape and cached on disk.

Importing kerngen touches no GPU, imports no CuTe DSL and creates no directory.
"""
from .errors import CacheError, CacheMissError, CompileError, DeviceError, EnvError, InputError, KerngenError, TierError
from .adapters import select_experts
from .ops.experts import experts
from .ops.finalize import finalize
from .ops.finalize import prepare as finalize_prepare
from .ops.latent_tail import latent_tail
from .ops.permute import Routing, RoutingWorkspace, permute
from .ops.routing import route
from .ops.prerouting import PreRouting
from .ops.tail import moe_tail
from .plan import VERSION as __version__
from . import torch_ops  # noqa: F401,E402  (registers torch.ops.kerngen.*)
from . import jit as _jit

__all__ = ["route", "experts", "permute", "Routing", "RoutingWorkspace", "PreRouting", "finalize", "finalize_prepare", "moe_tail", "latent_tail", "select_experts", "models", "preload", "strict", "clear",
           "KerngenError", "InputError", "TierError", "CompileError", "CacheMissError", "DeviceError", "CacheError",
           "EnvError", "__version__"]


def models() -> dict:
    """Models known to the active tier table (shipped tiers.toml + KERNGEN_TIERS), by name."""
    from . import tiers
    return dict(tiers.load().models)


def preload(model: str, **kw) -> dict:
    """Load every kernel `model` needs on the current GPU at start-up; returns count, compiled, seconds."""
    from .ops._common import require_gpu
    from .warmup import preload as _preload
    require_gpu(f"kerngen.preload({model!r})")
    return _preload(model, **kw)


def _miss_command(spec) -> str:
    from .warmup import warmup_command
    return warmup_command(spec)


def clear() -> None:
    """Forget every resolved dispatch (kernels per shape, input signatures): the next call of each shape reads
    the tier table and the cache again. tiers.reload() calls it too."""
    from . import dispatch
    dispatch.clear()


def strict(on: bool | None = True) -> None:
    """Serving mode: a kernel missing from the cache raises CacheMissError instead of compiling."""
    from . import jit
    jit.set_strict(on)


_jit.set_miss_command(_miss_command)   # strict-mode misses name the model's warmup (jit never imports warmup)
