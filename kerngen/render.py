"""Render a KernelSpec's template to source text (Jinja2, StrictUndefined: a missing value is an error; tier
rules and --spec are checked against the variant's params before they get here)."""
from __future__ import annotations

from functools import lru_cache

import jinja2

from . import env
from .errors import TierError
from .plan import KernelSpec
from .tiers import BACKENDS


@lru_cache(maxsize=1)
def _jinja() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(env.templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              trim_blocks=True, lstrip_blocks=True)


def render(spec: KernelSpec) -> str:
    try:
        if not BACKENDS[spec.backend].jinja:   # a CuTe DSL module, specialized at compile time
            return (env.templates_dir() / spec.template).read_text()
        return _jinja().get_template(spec.template).render(**spec.values())
    except (OSError, jinja2.TemplateNotFound) as e:
        raise TierError(f"{spec.op} variant '{spec.variant}' ({spec.backend}): template {spec.template} cannot be "
                        f"read under {env.templates_dir()} ({getattr(e, 'strerror', None) or e})") from None
