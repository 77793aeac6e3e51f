"""Split Newton-Schulz (`dmuon.orthogonalize_distributed`) against single-process `dmuon.orthogonalize`.

One spawn per world size (1, 2, 4 gloo ranks); every rank runs many cases inside it and returns, per case,
its block's error relative to the whole reference matrix. Cases: both forms, Jordan and Polar Express,
restarts, odd sizes, wide and tall, square, uneven blocks, k not dividing n, batched (3-D and 4-D) stacks,
fp64 / fp32 / bf16, subgroups of the world (k = 2, 3 inside 4 ranks); then the bad-input errors (the same
one-line InputError on every rank) and a peer that never calls (a timeout, not a hang).
"""

from __future__ import annotations

import pytest
import torch

from dmuon.errors import InputError
from dmuon.split_ns import local_block, split_sizes
from tests.dist_utils import run_distributed

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (full shape, blocks along the long side or None = even split over the group)
SHAPES = [
    ((7, 23), None),
    ((23, 7), None),
    ((9, 9), None),
    ((5, 31), "uneven"),
    ((31, 5), "uneven"),
    ((3, 6, 17), None),
    ((2, 2, 5, 13), "uneven"),
]
FORMS = [
    dict(method="gram", coefficients="jordan"),
    dict(method="standard", coefficients="jordan"),
    dict(method="gram", coefficients="polar_express"),
    dict(method="standard", coefficients="polar_express"),
    dict(method="gram", coefficients="polar_express", restart=()),
    dict(method="gram", coefficients="jordan", restart=(1, 3), steps=6),
    dict(method="auto", coefficients="jordan"),
]


def _blocks(n: int, k: int, kind) -> tuple[int, ...]:
    if kind != "uneven" or k == 1 or n < 2 * k:
        return split_sizes(n, k)
    sizes = [1] * (k - 1) + [n - (k - 1)]  # as uneven as it gets: one column on all but the last rank
    return tuple(sizes[1:] + sizes[:1])


def _matrix(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _run_cases(group, me: int, k: int, tag: str):
    import dmuon

    out = []
    seed = 0
    for shape, kind in SHAPES:
        rows, cols = shape[-2:]
        tall = rows > cols
        long_dim = -2 if tall else -1
        sizes = _blocks(max(rows, cols), k, kind)
        start = sum(sizes[:me])
        for form in FORMS:
            for dtype in (torch.float64, torch.float32):
                seed += 1
                G = _matrix(shape, dtype, seed)
                ref = dmuon.orthogonalize(G, kernels="torch", dtype=dtype, **form)
                mine = dmuon.orthogonalize_distributed(G.narrow(long_dim, start, sizes[me]), group=group,
                                                       tall=tall, kernels="torch", dtype=dtype, **form)
                err = (mine - ref.narrow(long_dim, start, sizes[me])).double().norm() / ref.double().norm()
                out.append((f"{tag} {shape} {sizes} {form} {dtype}", dtype, float(err)))
    for dtype, it in ((torch.bfloat16, None), (torch.float32, "bf16")):  # bf16 input; bf16 iteration
        G = _matrix((6, 40), dtype, 99)
        sizes = split_sizes(40, k)
        part = G.narrow(-1, sum(sizes[:me]), sizes[me])
        ref = dmuon.orthogonalize(G, method="gram", dtype=it)
        mine = dmuon.orthogonalize_distributed(part, group=group, method="gram", dtype=it)
        assert mine.dtype == dtype and mine.shape == part.shape
        err = (mine - ref.narrow(-1, sum(sizes[:me]), sizes[me])).double().norm() / ref.double().norm()
        out.append((f"{tag} bf16 input={dtype} iteration={it}", torch.bfloat16, float(err)))
    zero = dmuon.orthogonalize_distributed(torch.zeros(4, split_sizes(9, k)[me]), group=group)
    out.append((f"{tag} zero matrix", torch.float64, float(zero.abs().max())))
    return out


def _bad_inputs(me: int, k: int, group):
    import dmuon

    def outcome(fn):
        try:
            fn()
        except InputError as e:
            return str(e)
        return "no error"

    f = dmuon.orthogonalize_distributed
    return {
        "rows": outcome(lambda: f(torch.randn(5 + me, 8), group=group)),
        "batch": outcome(lambda: f(torch.randn(2 + me, 5, 8), group=group)),
        "empty block": outcome(lambda: f(torch.randn(2, 1 if me else 0), group=group)),
        "short side": outcome(lambda: f(torch.randn(20, 2), group=group)),
        "settings": outcome(lambda: f(torch.randn(3, 8), group=group, steps=5 + me)),
        "tall flag": outcome(lambda: f(torch.randn(4, 8), group=group, tall=me == 0)),
        "local": outcome(lambda: f(torch.randn(3, 8), group=group, timeout_s=0)),
    }


def _world(rank: int, world_size: int):
    import datetime

    import torch.distributed as dist

    results = _run_cases(None, rank, world_size, f"k={world_size}")
    extra = {}
    if world_size == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # two k = 2 groups at the same time
        results += _run_cases(pairs[rank // 2], rank % 2, 2, f"pair {rank // 2}")
        trio = dist.new_group([0, 1, 2])  # k = 3, rank 3 outside
        if rank < 3:
            results += _run_cases(trio, rank, 3, "k=3 subgroup")
        else:
            try:
                dmuon_f()(torch.randn(3, 8), group=trio)
                extra["outsider"] = "no error"
            except InputError as e:
                extra["outsider"] = str(e)
    if world_size > 1:
        extra["bad"] = _bad_inputs(rank, world_size, None)
        late = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=30))
        if rank == 0:  # the others never call: rank 0 fails within its timeout instead of hanging
            import time

            t0 = time.perf_counter()
            try:
                dmuon_f()(torch.randn(3, 8), group=late, timeout_s=2.0)
                extra["timeout"] = "no error"
            except RuntimeError as e:
                extra["timeout"] = f"{type(e).__name__}: {e}"
            extra["timeout_s"] = time.perf_counter() - t0
        else:  # alive (the connection stays open) but never calling: only the timeout ends rank 0's wait
            import time

            time.sleep(4.0)
    return results, extra


def dmuon_f():
    import dmuon

    return dmuon.orthogonalize_distributed


@pytest.fixture(scope="module", params=[1, 2, 4])
def world(request):
    return request.param, run_distributed(_world, request.param, timeout_s=150, pg_timeout_s=60)


def test_split_ns_equals_single_process_ns(world):
    k, per_rank = world
    bad = [(name, err) for results, _ in per_rank for name, dtype, err in results if not err <= TOL[dtype]]
    assert not bad, f"{len(bad)} cases above tolerance, e.g. {bad[:5]}"
    names = {name.split(" (")[0] for results, _ in per_rank for name, _, _ in results}
    assert len(names) > 1
    count = len(per_rank[0][0])
    assert count >= len(SHAPES) * len(FORMS) * 2


def test_bad_input_is_one_line_on_every_rank_and_no_hang(world):
    k, per_rank = world
    if k == 1:
        pytest.skip("bad splits need a group of >= 2 ranks")
    expected = {
        "rows": "disagree on the short side",
        "batch": "disagree on batch shape",
        "empty block": "leaves group ranks [0] with none; accepted: every rank holds >= 1",
        "short side": "the blocks split the short side",
        "settings": "disagree on the NS settings",
        "tall flag": "disagree on tall=",
        "local": "timeout_s must be a positive number",
    }
    for rank, (_, extra) in enumerate(per_rank):
        for case, message in expected.items():
            got = extra["bad"][case]
            assert message in got and "\n" not in got, (rank, case, got)
        if rank:
            assert extra["bad"] == per_rank[0][1]["bad"]  # the same verdict everywhere
    timeout = per_rank[0][1]
    assert timeout["timeout"].startswith("RuntimeError") and 1.9 < timeout["timeout_s"] < 4, timeout
    if k == 4:
        assert "rank 3 is not a member of the process group" in per_rank[3][1]["outsider"]


def test_split_helpers():
    assert split_sizes(23, 4) == (6, 6, 6, 5) and split_sizes(3, 3) == (1, 1, 1)
    with pytest.raises(InputError, match="cannot split 3 columns into 4 blocks"):
        split_sizes(3, 4)
    G = torch.arange(2 * 7.0).reshape(2, 7)
    assert torch.equal(torch.cat([local_block(G, i, 3) for i in range(3)], dim=-1), G)
    assert torch.equal(torch.cat([local_block(G.T, i, 3) for i in range(3)], dim=-2), G.T)
