"""Errors a user can act on: each names the argument, what was expected, and the fix."""


class KerngenError(Exception):
    """Base class of every error kerngen raises on purpose."""


class InputError(KerngenError, ValueError):
    """A tensor or scalar argument does not meet the op's contract."""

    def __init__(self, op: str, arg: str, expected: str, got: str):
        self.op, self.arg, self.expected, self.got = op, arg, expected, got
        super().__init__(f"{op}: argument '{arg}' must be {expected}, got {got}")


class TierError(KerngenError):
    """tiers.toml is malformed, or no tier rule matches a shape."""


class EnvError(KerngenError, ValueError):
    """An environment variable kerngen reads has a value it cannot use."""

    def __init__(self, var: str, expected: str, got: str):
        self.var, self.expected, self.got = var, expected, got
        super().__init__(f"environment variable {var}={got!r}: expected {expected}; fix it or unset it")


class CacheError(KerngenError):
    """The kernel cache cannot do what was asked (a foreign directory, a lock that never came free)."""


class CompileError(KerngenError):
    """NVRTC or CuTe DSL rejected a rendered kernel; carries the log and the source path."""

    def __init__(self, key: str, log: str, source_path: str | None):
        self.key, self.log, self.source_path = key, log, source_path
        super().__init__(
            f"compiling {key} failed\n--- compiler log ---\n{log.strip()}\n"
            f"--- rendered source: {source_path or '(not written)'}"
        )


class CacheMissError(KerngenError):
    """Strict mode is on and a kernel is not in the cache."""

    def __init__(self, key: str, command: str):
        self.key, self.command = key, command
        super().__init__(
            f"strict mode: kernel {key} is not in the cache. Build it with:\n    {command}\n"
            "or unset KERNGEN_STRICT to compile on first use."
        )


class DeviceError(KerngenError):
    """A CUDA driver call failed while loading or launching a kernel."""
