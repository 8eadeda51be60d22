"""The GPU gate of a feature (runtime/gpu_gate.py): its kernels run by default on the architectures a run has
checked them on, elsewhere only when asked."""

import pytest
import torch

import attnfuse as af
from attnfuse.runtime import gpu_gate
from attnfuse.runtime.gpu_gate import Gate

GATE = Gate(
    "a feature", "ATTNFUSE_FEATURE_ON_GPU", "tests/test_feature.py::test_on_a_gpu", checked=("interpreter", "sm90")
)


@pytest.mark.parametrize("arch, opens", [("interpreter", True), ("sm90", True), ("sm80", False), ("sm100", False)])
def test_a_gate_opens_on_the_architectures_checked_and_elsewhere_when_asked(monkeypatch, arch, opens):
    monkeypatch.setattr(gpu_gate, "device_arch", lambda device: arch)
    monkeypatch.delenv(GATE.env, raising=False)
    device = torch.device("cpu" if arch == "interpreter" else "cuda")
    assert GATE.opens(device) is opens
    if not opens:
        with pytest.raises(af.UnsupportedError, match=rf"a feature on {arch}: .*interpreter, sm90.*{GATE.env}=1"):
            GATE.check(device)
    for asked, runs in (("1", True), ("0", opens), ("", opens)):
        monkeypatch.setenv(GATE.env, asked)
        assert GATE.opens(device) is runs
        if runs:
            GATE.check(device)


def test_the_cpu_is_an_interpreter_architecture_and_other_devices_their_type():
    assert gpu_gate.device_arch(torch.device("cpu")) == "interpreter"
    assert gpu_gate.device_arch(torch.device("meta")) == "meta"
    with pytest.raises(af.UnsupportedError, match=r"a feature on meta: .*ATTNFUSE_FEATURE_ON_GPU=1"):
        GATE.check(torch.device("meta"))
