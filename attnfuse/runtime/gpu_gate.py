"""Features whose kernels no GPU run has checked yet: the CPU runs them (Triton's interpreter checked them against
the float64 reference); a GPU only when the user asks with the feature's environment variable, until the GPU
test named here has passed there and the device joins ``checked``. A kernel no GPU has checked is never a user's
default path."""

from __future__ import annotations

import os

import torch
from attrs import frozen

from ..errors import UnsupportedError


@frozen
class Gate:
    """``what`` (in words), its ``env`` variable ("1" opts in), the devices its kernels were ``checked`` on and
    the ``test`` that checks them on a GPU."""

    what: str
    env: str
    test: str
    checked: tuple[str, ...] = ("cpu",)

    def opens(self, device: torch.device) -> bool:
        """Whether the feature runs on ``device``."""
        return device.type in self.checked or os.environ.get(self.env, "").strip() == "1"

    def check(self, device: torch.device) -> None:
        """An UnsupportedError unless the feature runs on ``device``, saying how to ask for it."""
        if not self.opens(device):
            raise UnsupportedError(
                f"{self.what} on {device.type}: the kernels have been checked on the CPU only (Triton's interpreter), "
                f"so a GPU runs them only when asked: set {self.env}=1 ({self.test} checks them there)"
            )
