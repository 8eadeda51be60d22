"""benchmarks/kernel_resources.py: a generated kernel compiled for sm90 here, with no GPU, and ptxas'
resource report read back."""

import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_resources  # noqa: E402


def test_reports_registers_spills_and_shared_memory(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["kernel_resources.py", "gpt2", "--head-dim", "64", "--tiles", "64,64,4,3"])
    kernel_resources.main()
    out = capsys.readouterr().out
    line = re.search(
        r"BM64 BN64 w4 s3: (\d+) registers, spills (\d+) B stored / (\d+) B loaded, "
        r"shared memory (\d+) B",
        out,
    )
    assert line, out
    registers, _, _, shared = map(int, line.groups())
    assert 0 < registers <= 255 and shared > 0
