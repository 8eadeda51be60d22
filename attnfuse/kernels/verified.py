"""Which template instances a GPU has verified, and so may run by default.

``verified.json`` beside this file is written by the GPU run (``python -m attnfuse.kernels.verify --write``),
never by hand: one entry per (instance, dtype, head dim) whose every case matched the float64 reference on the
GPU. An instance is named by ``instance_digest``, a hash of its code (its canonical source: programs whose
kernels differ only in names share one) and of the template library it imports, so any change to the template,
to a fragment it splices or to the library makes it a new, unverified instance: the record cannot drift from
the code.

``ATTNFUSE_TEMPLATES`` chooses: ``verified`` (the default) runs the verified instances and the generated kernels
elsewhere; ``all`` opts in to every instance the templates can run, verified or not; ``off`` runs none; a
comma-separated list of kernel kinds (``forward``, ``dkdv``, ``dq``) opts in to every instance of those kinds and
runs the verified ones of the others.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from ..errors import InputError
from ..plan import KernelSpec
from .instance import instance_digest

RECORD = Path(__file__).with_name("verified.json")
MODE_ENV = "ATTNFUSE_TEMPLATES"
MODES = ("verified", "all", "off")


def record_key(spec: KernelSpec, dtype: str, head_dim: int) -> str:
    """The record's name of ``spec``'s instance for inputs of ``dtype`` and ``head_dim``."""
    return f"{spec.kind}/{instance_digest(spec)}/{dtype}/{head_dim}"


@functools.lru_cache(maxsize=None)
def _verified(path: Path) -> frozenset[str]:
    if not path.exists():
        return frozenset()
    return frozenset(entry["key"] for entry in json.loads(path.read_text())["instances"])


def is_verified(key: str) -> bool:
    return key in _verified(RECORD)


KINDS = ("forward", "dkdv", "dq")  # the kernel kinds a list of ATTNFUSE_TEMPLATES may name


def mode() -> str:
    """``ATTNFUSE_TEMPLATES``, checked."""
    value = os.environ.get(MODE_ENV, "verified").strip() or "verified"
    if value not in MODES and not set(_kinds(value)) <= set(KINDS):
        raise InputError(
            f"{MODE_ENV} must be one of {', '.join(MODES)}, or a comma-separated list of the kernel kinds "
            f"{', '.join(KINDS)} (every instance of those, the verified ones of the others), got {value!r}"
        )
    return value


def _kinds(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


def chosen(key: str) -> bool:
    """Whether a call runs the template instance named ``key`` (when the templates can run it at all)."""
    m = mode()
    if m == "off":
        return False
    return m == "all" or key.split("/", 1)[0] in _kinds(m) or is_verified(key)
