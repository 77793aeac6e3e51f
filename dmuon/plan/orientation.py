"""Shape classes by NS shape, optionally by orientation too (`balance.build_work_model`'s grouping).

A matrix and its transpose cost the same (the cost table is symmetric in (n, m)), so by default they share
a class and may share a batch. Where the runtime's NS iterates tall matrices as they are (standard NS with
torch ops: `dmuon.newton_schulz.iterates_tall_as_is`), a batch of tall and wide members runs as two calls,
one per orientation (`dmuon.runtime.planning.own_orientation_stacks`); with `orientation` the plan keeps
the two orientations in classes of their own, so every batch it prices is one call of the runtime."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..errors import InputError
from .types import MatrixSpec

BOTH = -1  # the class key's orientation where orientations share a class


def check_orientation(orientation) -> bool | frozenset[tuple[int, int]]:
    """True / False, or the set of NS shapes (n, m), 0 < n <= m, whose orientations are kept apart."""
    if isinstance(orientation, bool):
        return orientation
    try:
        shapes = frozenset(tuple(x) for x in orientation)
    except TypeError:
        shapes = None
    if shapes is None or any(len(x) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                     for v in x) or x[0] > x[1] for x in shapes):
        raise InputError(f"orientation must be True, False or a collection of NS shapes (n, m) with "
                         f"0 < n <= m, got {orientation!r}")
    return shapes


def shape_groups(matrices: Sequence[MatrixSpec], orientation: bool | Collection[tuple[int, int]] = False
                 ) -> dict[tuple[int, int, int], list[int]]:
    """Matrix indices (in (layer, index) order) per class key (n, m, tall): tall = 1 (rows > cols) or 0
    where the shape's orientations are kept apart, else BOTH."""
    oriented = check_orientation(orientation)
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i in sorted(range(len(matrices)), key=lambda i: (matrices[i].layer, i)):
        mat = matrices[i]
        n, m = min(mat.shape), max(mat.shape)
        keep = oriented is True or (oriented is not False and (n, m) in oriented)
        groups.setdefault((n, m, int(mat.rows > mat.cols) if keep else BOTH), []).append(i)
    return groups


def class_groups(matrices: Sequence[MatrixSpec], orientation: bool | Collection[tuple[int, int]] = False
                 ) -> dict[tuple[int, int, int, int], list[int]]:
    """`shape_groups` split by matrices per member (MatrixSpec.count): a balancer's classes, keyed (n, m,
    tall, count); a batch of b members of a class is one NS call of b x count matrices."""
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for (n, m, tall), members in shape_groups(matrices, orientation).items():
        for i in members:
            groups.setdefault((n, m, tall, matrices[i].count), []).append(i)
    return groups
