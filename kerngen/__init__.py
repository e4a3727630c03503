"""kerngen: JIT-generated MoE inference kernels, compiled per shape and cached on disk: routing and permutation,
pre-routing, decode expert GEMMs (bf16, fp8, MXFP4), finalize, the fused tail (with tensor parallelism) and the
latent-MoE tail.

Importing kerngen touches no GPU, imports no CuTe DSL, creates no directory and imports no torch of its own: the
ops (`kerngen.route`, `permute`, `finalize`, ...) are imported on first use, so the command line checks its
arguments without loading torch. The torch custom ops `torch.ops.kerngen.*` (kerngen/torch_ops.py) are
registered by `import kerngen` when torch is already imported, else on first use of any name below, or by
`import kerngen.torch_ops`.
"""
import sys as _sys
from importlib import import_module as _import_module

from .errors import CacheError, CacheMissError, CompileError, DeviceError, EnvError, InputError, KerngenError, TierError
from .plan import VERSION as __version__
from . import jit as _jit
from . import ops as _ops

__all__ = [*_ops.public(), "select_experts", "models", "preload", "strict", "clear", "KerngenError", "InputError",
           "TierError", "CompileError", "CacheMissError", "DeviceError", "CacheError", "EnvError", "__version__"]


def _lazy() -> dict[str, str]:
    """The names imported on first access (PEP 562): public name -> "module.attribute" under kerngen; the ops' from
    their declarations (kerngen.ops.public(), read at each call)."""
    return {"select_experts": "adapters.select_experts", **{k: f"ops.{v}" for k, v in _ops.public().items()}}


# Submodules `import kerngen` has always made attributes (kerngen.tiers, kerngen.ops, ...): the ones not
# imported above are imported on first access too.
_SUBMODULES = ("adapters", "cache", "dispatch", "env", "errors", "jit", "launch", "ops", "plan", "render", "tiers",
               "torch_ops")


def _register_torch_ops() -> None:
    """Register torch.ops.kerngen.* (once; it imports the ops) wherever torch is imported."""
    if "torch" in _sys.modules:
        _import_module(".torch_ops", __name__)


def __getattr__(name: str):
    if name in (lazy := _lazy()):
        module, attr = lazy[name].rsplit(".", 1)
        value = getattr(_import_module(f".{module}", __name__), attr)
    elif name in _SUBMODULES:
        value = _import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _register_torch_ops()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_lazy(), *_SUBMODULES})


def models() -> dict:
    """Models known to the active tier table (shipped tiers.toml + KERNGEN_TIERS), by name."""
    from . import tiers
    return dict(tiers.load().models)


def preload(model: str, **kw) -> dict:
    """Load every kernel `model` needs on the current GPU at start-up; returns count, compiled, seconds."""
    from . import tiers
    from .ops._common import require_gpu
    from .warmup import preload as _preload
    if not isinstance(model, str):
        raise InputError("preload", "model", "a model name of the tier table (a str)", repr(model))
    tiers.load(kw.get("tiers_file")).model(model)   # an unknown name is its TierError, with or without a GPU
    require_gpu(f"kerngen.preload({model!r})")
    return _preload(model, **kw)


def _miss_command(spec) -> str:
    from .warmup import warmup_command
    return warmup_command(spec)


def clear() -> None:
    """Forget every resolved dispatch (kernels per shape, the buffers their calls keep, input signatures): the next
    call of each shape reads the tier table and the cache again. tiers.reload() calls it too."""
    from . import dispatch
    dispatch.clear()


def strict(on: bool | None = True) -> None:
    """Serving mode: a kernel missing from the cache raises CacheMissError instead of compiling."""
    from . import jit
    if on is not None and type(on) is not bool:
        raise InputError("strict", "on", "True, False or None (follow KERNGEN_STRICT)", repr(on))
    jit.set_strict(on)


_jit.set_miss_command(_miss_command)   # strict-mode misses name the model's warmup (jit never imports warmup)
_register_torch_ops()   # torch already imported (as wherever tensors are made): torch.ops.kerngen.* now
