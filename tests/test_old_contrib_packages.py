"""softcap and softmax_with_sinks moved from contrib/attnfuse-softcap and contrib/attnfuse-sinks into the
built-ins. A user who still has the old distributions installed gets the built-ins, each old combinator
skipped with a PluginWarning naming both distributions, and programs using them run as before.

The old distributions are simulated as in tests/test_plugin_clash.py: a dist-info folder on PYTHONPATH with
their entry points (``softcap = attnfuse_softcap``, ``softmax_with_sinks = attnfuse_sinks``) and modules
declaring the same names, in a subprocess (the plugin manager loads once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from attnfuse.plugin_manager import DISABLE_AUTOLOAD_ENV

OLD = {  # distribution: (entry point, module, combinator, role, fragment)
    "attnfuse-softcap": ("softcap", "attnfuse_softcap", "softcap", "SCORE_MOD", 'ScoreModFragment(body="s = s")'),
    "attnfuse-sinks": (
        "softmax_with_sinks",
        "attnfuse_sinks",
        "softmax_with_sinks",
        "NORMALISER",
        'NormaliserFragment(init="", update="p = s", finalize="out = acc")',
    ),
}
REPORT = textwrap.dedent("""
    import json, warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import attnfuse as af
        from attnfuse.plugin_manager import PluginWarning

        @af.attention
        def program(q, k, v, sinks):
            return af.softmax_with_sinks(af.softcap(af.causal(af.scaled_dot_product(q, k)), 2.0), sinks) @ v

        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 24, 16, generator=g) * 3 for _ in range(3))
        sinks = torch.randn(2, generator=g)
        error = (program(q, k, v, sinks).double() - program.reference(q, k, v, sinks, dtype=torch.float64)).abs().max()
    print(json.dumps({
        "registry": {n: r.distribution for n, r in af.combinators().items()},
        "warnings": [str(w.message) for w in caught if issubclass(w.category, PluginWarning)],
        "error": error.item(),
    }))
""")


def old_distributions(root: Path) -> None:
    for dist, (entry, module, name, role, fragment) in OLD.items():
        (root / f"{module}.py").write_text(
            textwrap.dedent(f"""
            import attnfuse
            from attnfuse.combinator import Combinator, NormaliserFragment, Role, ScoreModFragment

            COMBINATOR = Combinator(name={name!r}, role=Role.{role}, doc="The old package's (test).",
                                    reference=lambda *args: args[0], fragment={fragment})

            @attnfuse.hookimpl
            def attnfuse_combinators():
                return [COMBINATOR]
        """)
        )
        info = root / f"{dist.replace('-', '_')}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[attnfuse]\n{entry} = {module}\n")


def test_old_contrib_packages_yield_to_the_builtins_with_a_warning(tmp_path):
    old_distributions(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != DISABLE_AUTOLOAD_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", REPORT], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["registry"]["softcap"] == report["registry"]["softmax_with_sinks"] == "attnfuse"
    for dist, (entry, _, name, _, _) in OLD.items():
        [warning] = [w for w in report["warnings"] if f"skipped combinator {name!r}" in w]
        assert f"plugin 'attnfuse:{name}' of distribution 'attnfuse'" in warning
        assert f"plugin '{dist}:{entry}' of distribution '{dist}'" in warning
        assert "the built-in keeps its name" in warning
    assert report["error"] < 1e-5  # the built-ins ran, not the old packages' stand-ins
