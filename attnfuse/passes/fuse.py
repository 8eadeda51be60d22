"""Pass 1, fuse: recognise score -> mods/masks -> normaliser -> @ v, and verify it is fusible."""

from __future__ import annotations

from attrs import frozen

from .. import ir
from ..combinator import Role
from ..errors import ProgramError


@frozen(kw_only=True)
class FusedProgram:
    """A graph in the one shape the kernel template implements.

    ``mods`` are score modifications in program order; ``masks`` are kept apart because a mask excludes
    keys whatever comes after it, so the template applies every mask once, after the modifications.
    """

    graph: ir.MatMulPV
    signature: str
    transforms: tuple[ir.Apply, ...]
    source: ir.Apply
    mods: tuple[ir.Apply, ...]
    masks: tuple[ir.Apply, ...]
    normaliser: ir.Apply

    def applications(self) -> tuple[ir.Apply, ...]:
        """Every combinator application, in the order the kernel runs them."""
        return (*self.transforms, self.source, *self.mods, *self.masks, self.normaliser)


def _expect(app: ir.Apply, role: Role, where: str) -> None:
    comb = app.declaration
    if comb.role is not role:
        raise ProgramError(
            f"{app.combinator} is a {comb.role.value}, but the graph uses it as a {role.value} ({where})"
        )


def fuse(graph: ir.MatMulPV) -> FusedProgram:
    """Check the graph's structure and roles and flatten it."""
    if not isinstance(graph, ir.MatMulPV):
        raise ProgramError(f"a program's graph ends with MatMulPV, got {type(graph).__name__}")
    nodes = ir.chain(graph)
    score: ir.ScoreOp = nodes[0]
    if (score.q.kind, score.k.kind, graph.v.kind) != ("q", "k", "v"):
        raise ProgramError("the score must be computed from q and k, and the weights must multiply v")
    for t in score.transforms:
        _expect(t, Role.QK_TRANSFORM, "a transform of q and k")
    _expect(score.source, Role.SCORE_SOURCE, "the score source")
    mods, masks = [], []
    for node in nodes[1:-2]:
        if isinstance(node, ir.MaskOp):
            _expect(node.apply, Role.MASK, "a mask")
            masks.append(node.apply)
        else:
            _expect(node.apply, Role.SCORE_MOD, "a score modification")
            mods.append(node.apply)
    _expect(graph.weights.apply, Role.NORMALISER, "the normaliser")
    return FusedProgram(
        graph=graph,
        signature=ir.signature(graph),
        transforms=score.transforms,
        source=score.source,
        mods=tuple(mods),
        masks=tuple(masks),
        normaliser=graph.weights.apply,
    )
