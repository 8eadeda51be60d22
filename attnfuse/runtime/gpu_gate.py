"""Features whose kernels a GPU runs by default only on the architectures where a GPU run has checked them:
elsewhere (another GPU) only when the user asks with the feature's environment variable, until the GPU test
named here has passed there and the architecture joins ``checked``. The CPU runs them always (Triton's
interpreter checked them against the float64 reference). A kernel no GPU has checked is never a user's default
path."""

from __future__ import annotations

import functools
import os

import torch
from attrs import frozen

from ..errors import UnsupportedError


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> str:
    """The architecture the kernels are compiled for on ``device``: "interpreter" (the CPU), "sm90"-style (CUDA),
    else the device's type ("meta", ...), which no gate has checked."""
    if device.type == "cpu":
        return "interpreter"
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


@frozen
class Gate:
    """``what`` (in words), its ``env`` variable ("1" opts in), the architectures its kernels were ``checked``
    on (``device_arch``: "interpreter" for the CPU, "sm90" for Hopper) and the ``test`` that checks them on a
    GPU."""

    what: str
    env: str
    test: str
    checked: tuple[str, ...] = ("interpreter",)

    def opens(self, device: torch.device) -> bool:
        """Whether the feature runs on ``device``."""
        return self.opens_on(device_arch(device))

    def opens_on(self, arch: str) -> bool:
        """Whether the feature runs on a device of ``arch`` (``device_arch``'s names)."""
        return arch in self.checked or os.environ.get(self.env, "").strip() == "1"

    def check(self, device: torch.device) -> None:
        """An UnsupportedError unless the feature runs on ``device``, saying how to ask for it."""
        if not self.opens(device):
            arch = device_arch(device)
            raise UnsupportedError(
                f"{self.what} on {arch}: no run has checked the kernels there (checked on: "
                f"{', '.join(self.checked) or 'none'}), so they run there only when asked: set {self.env}=1 "
                f"({self.test} checks them)"
            )
