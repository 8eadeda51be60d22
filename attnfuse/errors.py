"""Exceptions AttnFuse raises, and its deprecation warnings. Each message names the argument or combinator and
what is allowed (or, deprecated, how to move)."""

from __future__ import annotations

import threading
import warnings


class AttnFuseError(Exception):
    """Base of every AttnFuse error."""


class PluginError(AttnFuseError):
    """A plugin is broken or two plugins clash."""


class DeclarationError(PluginError, TypeError, ValueError):
    """A combinator declaration (``Combinator``, ``Param`` ...) is invalid; raised when it is built.
    (Also a TypeError/ValueError, as attrs validators' errors are.)"""


class DeclarationViolation(PluginError, AssertionError):
    """A kernel found a plugin's declaration false as it ran (``NormaliserFragment.unit_weights``, checked where
    device assertions run). (Also an AssertionError: the conformance kit reports it as a finding.)"""


DECLARATION_CHECK = "declaration check: "  # how a kernel's device assertion of a declaration starts its message


class ProgramError(AttnFuseError, TypeError):
    """An ill-formed attention program, raised while tracing it."""


class InputError(AttnFuseError, ValueError):
    """A call with inputs the program cannot take (shapes, dtypes, devices, parameters)."""


class KernelCacheError(AttnFuseError):
    """A generated kernel's file in the on-disk cache could not be written, read or loaded."""


class UnsupportedError(AttnFuseError, RuntimeError):
    """An operation AttnFuse refuses rather than compute wrongly: differentiating a gradient of a program call
    again (double backward). (Also a RuntimeError, as torch's own refusals are.)"""


_deprecations_lock = threading.Lock()
_deprecations_warned: set[tuple] = set()


def deprecated(subject: tuple, message: str, stacklevel: int = 2) -> None:
    """Warn ``message`` as a DeprecationWarning the first time this process sees ``subject`` (a combinator,
    say): a deprecated form of the plugin contract keeps working for one release, and says how to move.
    ``stacklevel`` as for ``warnings.warn``, counted from the caller."""
    with _deprecations_lock:
        if subject in _deprecations_warned:
            return
        _deprecations_warned.add(subject)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
