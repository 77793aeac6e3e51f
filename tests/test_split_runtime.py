"""DMuon executing split batches (owner groups, `dmuon/runtime/split_exec.py`) on gloo ranks (2 and 4):
every layout against single-device Muon, momentum on the lead only, DCP checkpoints saved with splits
loaded without them and the other way round, and bad split set-ups. Each world size runs its cases in
one spawned process group; case definitions: test_split_runtime_cases.py."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
from dist_utils import run_distributed, scratch_dir
from test_fsdp import assert_close, ref_for
from test_split_runtime_cases import run_cases

from dmuon.errors import InputError
from dmuon.plan.types import Batch, MatrixSpec, Plan
from dmuon.runtime.split_exec import check_split_plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

REL_TOL = 1e-5  # fp32 / fp64 model, 5 steps: split NS is exact to rounding (measured ~2e-7)
CKPT_DIR = scratch_dir("dmuon-split-ckpt-")

REPL, OWNER, SHARDED = ({"layout": x} for x in ("replicated", "fsdp2-owner", "fsdp2-sharded"))


def case(name, **kw):
    return {"name": name, **kw}


def ckpt(name, save_k, load_k, **kw):
    return case(name, runner="checkpoint", save_k=save_k, load_k=load_k, dir=f"{CKPT_DIR}/{name}", **kw)


W2 = [
    case("replicated_k2", k=2, **REPL),
    case("replicated_k2_no_overlap", k=2, opts={"overlap": False}, **REPL),
    case("owner_k2", k=2, **OWNER),
    case("replicated_k2_descending", k=2, descending=True, **REPL),  # group (1, 0): lead 1 is group rank 1
    case("owner_free_k2", k=2, opts={"memory": "free"}, **OWNER),
    case("sharded_k2", k=2, **SHARDED),
    case("sharded_rows", rows=[0, 1], **SHARDED),  # square matrices: their local rows are the blocks
    case("replicated_max_split2", opts={"max_split": 2}, **REPL),  # the balancer: tiny matrices, no split
    ckpt("ckpt_repl_split_to_plain", 2, 1, **REPL),
    ckpt("ckpt_repl_plain_to_split", 1, 2, **REPL),
    ckpt("ckpt_sharded_split_to_plain", 2, 1, **SHARDED),
    ckpt("ckpt_owner_plain_to_split", 1, 2, **OWNER),
    case("errors", runner="errors"),
    # the batch of blocks.0.up (its gradient gets the NaN) is the one split
    *[case(f"nonfinite_{n}", runner="nonfinite", k=2, split_first="blocks.0.up.weight", **lay)
      for n, lay in (("replicated", REPL), ("owner", OWNER), ("sharded", SHARDED))],
]
W4 = [
    case("replicated_k2", k=2, **REPL),
    case("replicated_k4", k=4, **REPL),
    case("owner_k4", k=4, **OWNER),
    case("sharded_k4_descending", k=4, descending=True, **SHARDED),  # group (3, 2, 1, 0)
    case("sharded_k2", k=2, **SHARDED),
    case("sharded_k4", k=4, **SHARDED),
    case("hsdp_sharded_k2", k=2, hsdp=True, **SHARDED),
    case("sharded_rows", rows=[0, 1, 2, 3], **SHARDED),
    case("hsdp_sharded_rows", rows=[2, 3], hsdp=True, **SHARDED),  # replica 1's shard ranks
    case("hsdp_owner_k4", k=4, hsdp=True, **OWNER),
    ckpt("ckpt_sharded_k4_to_plain", 4, 1, **SHARDED),
    ckpt("ckpt_repl_k2_to_k4", 2, 4, **REPL),
    case("errors", runner="errors"),
]
BATTERIES = {2: W2, 4: W4}


@functools.cache
def _run(world: int) -> tuple:
    return tuple(run_distributed(run_cases, world, (BATTERIES[world],), timeout_s=280))


def results(world: int, name: str) -> list[dict]:
    per_rank = [r[name] for r in _run(world)]
    for rank, res in enumerate(per_rank):
        assert "failed" not in res, f"rank {rank}: {res['failed']}"
    return per_rank


PLAIN = [(w, c) for w, cs in BATTERIES.items() for c in cs if c.get("runner", "plain") == "plain"]
SPLIT = [(w, c) for w, c in PLAIN if c.get("k")]
ROWS = [(w, c) for w, c in PLAIN if c.get("rows")]
CKPTS = [(w, c) for w, cs in BATTERIES.items() for c in cs if c.get("runner") == "checkpoint"]


@pytest.mark.parametrize("world,c", PLAIN, ids=[f"w{w}-{c['name']}" for w, c in PLAIN])
def test_split_training_matches_single_device_muon(world, c):
    per_rank = results(world, c["name"])
    want = ref_for(c)
    for rank, res in enumerate(per_rank):
        assert_close(res["params"], want, f"rank {rank} {c['name']}", REL_TOL)
        assert res["layout"] == c["layout"]


@pytest.mark.parametrize("world,c", SPLIT, ids=[f"w{w}-{c['name']}" for w, c in SPLIT])
def test_groups_run_and_only_the_lead_holds_momentum(world, c):
    per_rank = results(world, c["name"])
    groups = per_rank[0]["groups"]
    assert groups and all(len(g) == c["k"] for g in groups), groups  # the forced plan really splits
    if c.get("descending"):  # led by its highest rank, members listed downwards
        assert groups[0] == sorted(groups[0], reverse=True), groups
    for rank, res in enumerate(per_rank):
        assert res["groups"] == groups
        in_group = any(rank in g for g in groups)
        assert (res["gram_bytes"] > 0) == in_group, (rank, res["gram_bytes"])
        in_lead_split = any(rank in g for g in groups if g not in res["row_splits"])
        assert (res["split_bytes"] > 0) == in_lead_split, (rank, res["split_bytes"])
        if c["layout"] != "fsdp2-sharded":  # owner layouts: momentum of the matrices it leads, no more
            mine = sorted(n for n, o in zip(res["names"], res["owners"], strict=True) if o == rank)
            assert res["momentum"] == mine, (rank, res["momentum"], mine)


@pytest.mark.parametrize("world,c", ROWS, ids=[f"w{w}-{c['name']}" for w, c in ROWS])
def test_sharded_row_splits_use_the_local_rows_without_the_lead(world, c):
    for rank, res in enumerate(results(world, c["name"])):
        assert res["groups"] == [c["rows"]] and res["row_splits"] == [c["rows"]]
        assert res["split_bytes"] == 0  # no scatter / gather through the lead
        assert (res["gram_bytes"] > 0) == (rank in c["rows"])  # only the group's all-reduces


def test_the_balancer_does_not_split_tiny_matrices():
    for res in results(2, "replicated_max_split2"):
        assert res["groups"] == []


@pytest.mark.parametrize("world,c", CKPTS, ids=[f"w{w}-{c['name']}" for w, c in CKPTS])
def test_checkpoints_load_across_split_and_plain_plans(world, c):
    want = ref_for(c)
    for rank, res in enumerate(results(world, c["name"])):
        assert bool(res["saved_groups"]) == (c["save_k"] > 1)
        assert bool(res["loaded_groups"]) == (c["load_k"] > 1)
        assert_close(res["straight"], want, f"rank {rank} straight", REL_TOL)
        assert_close(res["resumed"], want, f"rank {rank} resumed", REL_TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_split_setups_are_one_line_errors_on_every_rank(world):
    per_rank = results(world, "errors")
    first = {k: v for k, v in per_rank[0].items() if k != "time_s"}
    for res in per_rank:
        assert {k: v for k, v in res.items() if k != "time_s"} == first
        for key, text in (("max_split_too_big", f"to the number of ranks ({world}), got {2 * world}"),
                          ("max_split_zero", "max_split must be an integer from 1"),
                          ("group_too_big", f"a group of {world + 1} ranks but the optimizer runs on "
                                            f"{world}"),
                          ("plan_world", f"the plan is for {world + 1} ranks")):
            assert res[key].startswith("InputError") and text in res[key], (key, res[key])
            assert "\n" not in res[key]


NONFINITE = [c["name"] for c in W2 if c.get("runner") == "nonfinite"]


@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_gradient_stops_a_split_step_everywhere(name):
    per_rank = results(2, name)
    for rank, res in enumerate(per_rank):
        assert "non-finite gradient" in res["error"] and "blocks.0.up.weight" in res["error"], (rank, res)
        assert res["unchanged"], f"rank {rank}: parameters changed in the skipped step"
    assert per_rank[0]["split_of_up"] == [[0, 1]] or per_rank[0]["split_of_up"] == [[1, 0]], per_rank[0]
    for res in per_rank[1:]:
        for k, v in per_rank[0]["params"].items():
            assert bool((v == res["params"][k]).all()), k


def _plan(batches, owners, shapes, world=4) -> Plan:
    mats = tuple(MatrixSpec(f"m{i}", r, c) for i, (r, c) in enumerate(shapes))
    return Plan(world_size=world, matrices=mats, owners=tuple(owners), batches=tuple(batches), buckets=(),
                balancer="lpt", method="standard", dtype="fp32", cost_source="test", makespan_s=1.0,
                lower_bound_s=1.0, solve_time_s=0.0)


def test_check_split_plan_names_what_is_accepted():
    b = Batch(owner=0, rows=3, cols=8, members=(0,), time_s=1.0, group=(0, 1))
    check_split_plan(_plan([b], [0], [(3, 8)]), 4)  # fine
    cases = [
        (dataclasses.replace(b, cols=3, group=(0, 1, 2, 3)), "3 columns along its long side, fewer than its "
                                                             "group of 4; accepted: k <= 3"),
        (dataclasses.replace(b, group=(1, 0)), "must be the batch's owner"),
        (dataclasses.replace(b, group=(0, 7)), "accepted: ranks of the optimizer's process group"),
        (dataclasses.replace(b, group=(0, 0)), "distinct ranks"),
        (dataclasses.replace(b, group=(0, 1, 2, 3, 4)), "groups of 2 .. 4 ranks"),
    ]
    for bad, text in cases:
        with pytest.raises(InputError, match=None) as e:
            check_split_plan(_plan([bad], [0], [(3, bad.cols)]), 4)
        assert text in str(e.value), str(e.value)
    two = [b, Batch(owner=2, rows=3, cols=8, members=(1,), time_s=1.0, group=(2, 1))]
    with pytest.raises(InputError, match="rank 1 is in split batches 0 and 1"):
        check_split_plan(_plan(two, [0, 2], [(3, 8), (3, 8)]), 4)


def test_plan_json_with_groups_is_what_dmuon_executes():
    b = Batch(owner=0, rows=3, cols=8, members=(0,), time_s=1.0, group=(0, 1), comm_s=0.1)
    plan = _plan([b], [0], [(3, 8)])
    again = Plan.from_json(json.dumps(plan.to_dict()))
    assert again == plan
    check_split_plan(again, 4)
