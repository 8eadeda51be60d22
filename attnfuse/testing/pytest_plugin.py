"""The conformance kit as a pytest plugin (entry point ``pytest11``; it does nothing unless used).

A plugin author's whole test::

    def test_conforms(attnfuse_conformance):
        attnfuse_conformance("prefix_lm")

or, with no test file at all, ``pytest --attnfuse-conformance=prefix_lm`` (several: comma-separated).
Options: ``--attnfuse-examples=N`` (Hypothesis examples per check; default 8 under Triton's interpreter,
60 on a GPU), ``--attnfuse-installed`` (compose with every installed combinator, not only the built-ins),
``--attnfuse-seed=S`` (replay a failure). Kernels run on the GPU when CUDA is available.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import pytest

CPU_EXAMPLES, GPU_EXAMPLES = 8, 60


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnfuse", "AttnFuse conformance kit")
    group.addoption(
        "--attnfuse-conformance",
        default="",
        metavar="NAMES",
        help="check these combinators (comma-separated) against their float64 references",
    )
    group.addoption(
        "--attnfuse-examples",
        type=int,
        default=None,
        metavar="N",
        help=f"Hypothesis examples per check (default {CPU_EXAMPLES} on CPU, {GPU_EXAMPLES} on CUDA)",
    )
    group.addoption(
        "--attnfuse-installed",
        action="store_true",
        help="compose with every installed combinator, not only the built-ins",
    )
    group.addoption("--attnfuse-seed", type=int, default=None, metavar="S", help="Hypothesis seed (to replay)")


def _checker(config: pytest.Config) -> Callable[..., None]:
    def check(name: str, **options: Any) -> None:
        __tracebackhide__ = True
        import torch

        from .conformance import check_combinator

        cuda = torch.cuda.is_available()
        examples = config.getoption("attnfuse_examples") or (GPU_EXAMPLES if cuda else CPU_EXAMPLES)
        settings = dict(
            max_examples=examples,
            installed=config.getoption("attnfuse_installed"),
            seed=config.getoption("attnfuse_seed"),
        )
        if cuda:
            settings.update(max_n=300, head_dims=(16, 32, 64, 80, 96, 128, 256))
        check_combinator(name, **{**settings, **options})

    return check


@pytest.fixture
def attnfuse_conformance(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``attnfuse_conformance(name, **check_combinator_options)``: run the conformance kit on ``name``."""
    return _checker(request.config)


class ConformanceItem(pytest.Item):
    """One ``--attnfuse-conformance`` check."""

    def __init__(self, *, combinator: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.combinator = combinator

    def runtest(self) -> None:
        _checker(self.config)(self.combinator)

    def reportinfo(self):
        return "attnfuse-conformance", None, f"conformance of {self.combinator}"

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None):
        """The kit's own findings (a wrong value or fact, a broken plugin) as their message with its replay
        notes; anything else as a short traceback from here on, without pytest's own frames."""
        from ..errors import AttnFuseError

        if isinstance(excinfo.value, (AssertionError, AttnFuseError)):
            return "".join(traceback.format_exception_only(excinfo.type, excinfo.value)).rstrip()
        excinfo.traceback = excinfo.traceback.cut(path=__file__)
        return super().repr_failure(excinfo, style="short")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    names = [n.strip() for n in config.getoption("attnfuse_conformance").split(",") if n.strip()]
    items.extend(ConformanceItem.from_parent(session, name=f"attnfuse-conformance[{n}]", combinator=n) for n in names)
