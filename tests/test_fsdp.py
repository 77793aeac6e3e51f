"""DMuon / NaiveMuon on FSDP2 (gloo, 2 and 4 CPU ranks): every layout against single-device Muon, the
memory='free' residency, the byte counts of muon.md's table, and bad set-ups. Each world size runs its
cases in one spawned process group; case definitions and the reference: test_fsdp_cases.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from dist_utils import run_distributed, scratch_dir
from test_fsdp_cases import reference, run_cases

from dmuon import NSConfig

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

REL_TOL = 1e-5
CKPT_DIR = scratch_dir("dmuon-fsdp-ckpt-")


def case(name, **kw):
    return {"name": name, **kw}


OWNER = {"layout": "fsdp2-owner"}
SHARDED = {"layout": "fsdp2-sharded"}
LAYOUTS = [
    case("owner_keep", **OWNER),
    case("owner_free", **OWNER, opts={"memory": "free"}),
    case("sharded", **SHARDED),
    case("naive", **SHARDED, cls="NaiveMuon"),
]
BYTES = [
    case("bytes_owner_keep", runner="bytes", reshard=False, **OWNER),
    case("bytes_owner_free", runner="bytes", reshard=False, **OWNER, opts={"memory": "free"}),
    case("bytes_sharded", runner="bytes", reshard=False, **SHARDED),
    case("bytes_sharded_z3", runner="bytes", reshard=True, **SHARDED),
    case("bytes_naive", runner="bytes", reshard=False, **SHARDED, cls="NaiveMuon"),
    case("bytes_naive_z3", runner="bytes", reshard=True, **SHARDED, cls="NaiveMuon"),
]
CHECKPOINTS = [
    case("ckpt_owner_keep", runner="checkpoint", **OWNER),
    case("ckpt_owner_free", runner="checkpoint", **OWNER, opts={"memory": "free"}),
    case("ckpt_sharded", runner="checkpoint", **SHARDED),
    case("ckpt_replicated", runner="checkpoint", layout="replicated"),
]
for c in CHECKPOINTS:
    c["dir"] = f"{CKPT_DIR}/{c['name']}"

W2 = [
    *LAYOUTS,
    case("owner_free_no_overlap", **OWNER, opts={"memory": "free", "overlap": False}),
    case("owner_keep_reduce_scatter", **OWNER, opts={"exchange": "reduce_scatter"}),
    case("owner_naive", **OWNER, cls="NaiveMuon"),
    case("replicated", layout="replicated"),
    # bf16 on the wire (comm_dtype): gradients to owners / the all-to-alls' inputs and updates
    case("sharded_comm_bf16", **SHARDED, opts={"comm_dtype": "bf16"}, tol=5e-2),
    case("naive_comm_bf16", **SHARDED, cls="NaiveMuon", opts={"comm_dtype": "bf16"}, tol=5e-2),
    case("owner_comm_bf16", **OWNER, opts={"comm_dtype": "bf16"}, tol=5e-2),
    # bf16 NS of fp32 matrices: the updates come back in bf16 (lossless), or in fp32 as before
    case("sharded_ns_bf16", **SHARDED, opts={"ns": NSConfig(dtype="bf16")}, tol=5e-2),
    case("sharded_ns_bf16_fp32_returns", runner="wire_returns", **SHARDED,
         opts={"ns": NSConfig(dtype="bf16")}),
    case("bytes_sharded_ns_bf16", runner="bytes", reshard=False, **SHARDED,
         opts={"ns": NSConfig(dtype="bf16")}),
    *BYTES,
    case("errors", runner="errors"),
    *[case(f"nonfinite_{c['name']}", runner="nonfinite", **{k: v for k, v in c.items() if k != "name"})
      for c in LAYOUTS],
]
W4 = [
    *LAYOUTS,
    *[{**c, "name": "hsdp_" + c["name"], "hsdp": True} for c in LAYOUTS],
    *BYTES[:3], BYTES[4],
    *CHECKPOINTS,
]
W2_RESUME = [{**c, "name": c["name"].replace("ckpt", "resume"), "runner": "resume"} for c in CHECKPOINTS]
BATTERIES = {2: W2, 4: W4}


@functools.cache
def _run(world: int) -> tuple:
    return tuple(run_distributed(run_cases, world, (BATTERIES[world],), timeout_s=220))


@functools.cache
def _resume() -> tuple:
    _run(4)  # writes the checkpoints
    return tuple(run_distributed(run_cases, 2, (W2_RESUME,), timeout_s=120))


@functools.cache
def _reference(case_json: str) -> dict:
    return reference(json.loads(case_json), range(5))


def results(world: int, name: str, runs=None) -> list[dict]:
    runs = runs if runs is not None else _run(world)
    per_rank = [r[name] for r in runs]
    for rank, res in enumerate(per_rank):
        assert "failed" not in res, f"rank {rank}: {res['failed']}"
    return per_rank


def assert_close(got: dict, want: dict, what: str, tol: float = REL_TOL) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert got[k].dtype == w.dtype, f"{what}: {k} is {got[k].dtype}, expected {w.dtype}"
        rel = ((got[k] - w).norm() / w.norm().clamp_min(1e-12)).item()
        assert rel <= tol, f"{what}: {k} differs from the reference by {rel:.2e} (relative)"


def ref_for(c: dict) -> dict:
    return _reference(json.dumps({"mixed": c.get("mixed", True)}, sort_keys=True))


PLAIN = [(ws, c) for ws, cs in BATTERIES.items() for c in cs if c.get("runner", "plain") == "plain"]


@pytest.mark.parametrize("world,c", PLAIN, ids=[f"w{ws}-{c['name']}" for ws, c in PLAIN])
def test_matches_single_device_muon(world, c):
    per_rank = results(world, c["name"])
    assert_close(per_rank[0]["params"], ref_for(c), c["name"], c.get("tol", REL_TOL))
    for rank, res in enumerate(per_rank[1:], start=1):
        for k, v in per_rank[0]["params"].items():
            assert torch.equal(v, res["params"][k]), f"{c['name']}: rank {rank} holds a different {k}"


def test_bf16_wire_rounds_the_sharded_exchange_like_the_baseline():
    """The sharded all-to-alls in bf16 round the NS inputs exactly as the baseline's bf16 all-gather
    does; DMuon's updates also come back in bf16 (half an ulp, 2e-3 relative, of an update that moves
    the weights ~3% a step), so the two agree to ~1e-4 while both move away from the fp32-wire run."""
    dm, nv = results(2, "sharded_comm_bf16")[0]["params"], results(2, "naive_comm_bf16")[0]["params"]
    fp32 = results(2, "sharded")[0]["params"]
    assert max(((dm[k] - fp32[k]).norm() / fp32[k].norm()).item() for k in dm) > 1e-6
    assert_close(dm, nv, "sharded DMuon vs NaiveMuon, both with comm_dtype='bf16'", 1e-3)


def test_bf16_ns_updates_come_back_in_bf16_with_the_same_bits():
    """bf16 NS of fp32 matrices: the owners send the updates back in bf16 (the NS result as it is, half the
    bytes) and every rank ends with the bits of the fp32 return (which converted the same bf16 values)."""
    narrow = results(2, "sharded_ns_bf16")
    wide = results(2, "sharded_ns_bf16_fp32_returns")
    fp32 = results(2, "sharded")[0]["params"]
    for rank in range(2):
        for k, v in wide[rank]["params"].items():
            assert torch.equal(narrow[rank]["params"][k], v), f"rank {rank}: {k}"
    assert max(((narrow[0]["params"][k] - fp32[k]).norm() / fp32[k].norm()).item() for k in fp32) > 1e-6


def test_layouts_are_detected_and_dispatched():
    got = {c["name"]: (r["layout"], r["cls"]) for c in LAYOUTS for r in [results(2, c["name"])[0]]}
    assert got == {"owner_keep": ("fsdp2-owner", "DMuon"), "owner_free": ("fsdp2-owner", "DMuon"),
                   "sharded": ("fsdp2-sharded", "ShardedDMuon"),
                   "naive": ("fsdp2-sharded", "ShardedNaiveMuon")}


@pytest.mark.parametrize("world", [2, 4])
def test_owner_layout_keeps_momentum_on_the_owner_only(world):
    per_rank = results(world, "owner_keep")
    owners, names = per_rank[0]["owners"], per_rank[0]["names"]
    for i, name in enumerate(names):
        holders = [r for r, res in enumerate(per_rank) if name in res["momentum"]]
        assert holders == [owners[i]], f"{name}: momentum on ranks {holders}, owner {owners[i]}"


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layout_updates_momentum_in_place(world):
    """ShardedDMuon runs the momentum once the flags are agreed, in place: the buffer of step 1 is still
    the buffer after step 4 (no per-step copy of 1/N of the matrices)."""
    for rank, res in enumerate(results(world, "sharded")):
        assert res["momentum_kept"] and all(res["momentum_kept"]), f"rank {rank}: {res['momentum_kept']}"


@pytest.mark.parametrize("world", [2, 4])
def test_memory_free_holds_at_most_two_units_of_non_owned_matrices(world):
    for rank, res in enumerate(results(world, "owner_free")):
        units = res["unit_bytes"]
        assert res["after_step"] == [0] * 5, f"rank {rank}: non-owned matrices resident after step()"
        two = max(a + b for a, b in zip(units, units[1:], strict=False))  # own unit + the prefetched one
        assert res["peaks"] and max(res["peaks"]) <= two
        assert sum(units) > 0 and max(res["peaks"]) < sum(units), f"rank {rank}: everything was resident"


@pytest.mark.parametrize("world,name,per_rank_all", [(4, "hsdp_sharded", False), (4, "sharded", False),
                                                     (4, "hsdp_naive", True)])
def test_each_matrix_is_orthogonalized_once_per_step_in_the_whole_job(world, name, per_rank_all):
    """Sharded layout, also on HSDP (2 replicas x 2 shards): 15 matrices, 5 steps, block 1 (5 matrices)
    without gradients at step 1 -> 70 NS in total over all ranks, not once per replica; the naive
    baseline runs all 70 on every rank."""
    counts = [res["ns_matrices"] for res in results(world, name)]
    if per_rank_all:
        assert counts == [70] * world
    else:
        assert sum(counts) == 70 and max(counts) < 70, counts


# ---- bytes -----------------------------------------------------------------------------------
def fsdp_bytes(res: dict, world: int, which=None) -> dict[str, float]:
    """FSDP2's own collectives: an all-gather per group in forward (and in backward if it reshards),
    one reduce-scatter; padded payloads. which: True / False = only the Muon / other parameters."""
    f = (world - 1) / world
    ag = rs = 0.0
    for reshard, sizes in res["fsdp_groups"]:
        b = sum(n * size for n, size, muon in sizes if which is None or muon == which)
        ag += (2 if reshard else 1) * f * b
        rs += f * b
    return {"all_gather": ag, "reduce_scatter": rs}


def muon_bytes(res: dict, padded_to: int = 1) -> int:
    return sum(-(-r // padded_to) * padded_to * (c if len(s) == 2 else 1) * b
               for s, b in res["muon"] for r, c in [s])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("memory,factor", [("keep", 2), ("free", 3)])
def test_owner_layout_bytes_match_the_table(world, memory, factor):
    """Owner-centric: reduce to owner + broadcast (x2 with memory='free') = 2 or 3 (N-1)/N P per rank."""
    f = (world - 1) / world
    for rank, res in enumerate(results(world, f"bytes_owner_{memory}")):
        s, p = res["summary"], muon_bytes(res)
        mine = s.get(("dmuon", "reduce"), 0) + s.get(("dmuon", "broadcast"), 0)
        assert mine == pytest.approx(factor * f * p), f"rank {rank}: {s}"
        assert s[("dmuon", "reduce")] == pytest.approx(f * p)
        assert s[("dmuon", "all_reduce")] == pytest.approx(2 * f * 2 * res["n_params"] * 4)  # the flags
        want = fsdp_bytes(res, world)  # FSDP2 moves only the AdamW parameters
        assert s[("main", "all_gather")] == pytest.approx(want["all_gather"])
        assert s[("main", "reduce_scatter")] == pytest.approx(want["reduce_scatter"])


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layout_all_to_all_bytes(world):
    """Each rank sends the shards it does not own and, as an owner, the rows it computed for the others:
    summed over ranks 2 sum_i (numel_i - owner's shard_i), about 2 (N-1)/N^2 P per rank."""
    from dmuon.runtime.fsdp import chunk_rows

    per_rank = results(world, "bytes_sharded")
    total = 0.0
    for rank, res in enumerate(per_rank):
        want = 0
        for (shape, b), o in zip(res["muon"], res["owners"], strict=True):
            rows, cols = shape
            mine = chunk_rows(rows, world)[rank] * cols
            want += (mine if o != rank else rows * cols - mine) * b
        got = res["summary"].get(("dmuon", "all_to_all"), 0)
        assert got == pytest.approx(want), f"rank {rank}"
        fsdp = fsdp_bytes(res, world)
        assert res["summary"][("main", "all_gather")] == pytest.approx(fsdp["all_gather"])
        total += got
    owner_shards = sum(chunk_rows(s[0], world)[o] * s[1] * b
                       for (s, b), o in zip(per_rank[0]["muon"], per_rank[0]["owners"], strict=True))
    assert total == pytest.approx(2 * (muon_bytes(per_rank[0]) - owner_shards))


def test_sharded_bf16_ns_returns_carry_two_bytes_per_element():
    """With bf16 NS the inputs travel in the matrices' dtype (fp32, some fp64) and the updates come back in
    bf16 (2 bytes)."""
    from dmuon.runtime.fsdp import chunk_rows

    for rank, res in enumerate(results(2, "bytes_sharded_ns_bf16")):
        want = 0
        for (shape, b), o in zip(res["muon"], res["owners"], strict=True):
            rows, cols = shape
            mine = chunk_rows(rows, 2)[rank] * cols
            want += mine * b if o != rank else (rows * cols - mine) * 2
        got = res["summary"].get(("dmuon", "all_to_all"), 0)
        assert got == pytest.approx(want), f"rank {rank}"


@pytest.mark.parametrize("world,name,n_gathers", [(2, "bytes_naive", 1), (2, "bytes_naive_z3", 2),
                                                  (4, "bytes_naive", 1)])
def test_naive_on_fsdp2_bytes(world, name, n_gathers):
    """Naive: FSDP2's all-gather(s) + reduce-scatter + one all-gather of every Muon input: for the Muon
    matrices 3 (N-1)/N P with params kept after forward, 4 (N-1)/N P when FSDP2 reshards (P padded to
    FSDP2's equal shards)."""
    f = (world - 1) / world
    for res in results(world, name):
        s = res["summary"]
        p_pad = muon_bytes(res, padded_to=world)
        assert s[("optimizer", "all_gather")] == pytest.approx(f * p_pad)
        want = fsdp_bytes(res, world)
        assert s[("main", "all_gather")] == pytest.approx(want["all_gather"])
        assert s[("main", "reduce_scatter")] == pytest.approx(want["reduce_scatter"])
        other = fsdp_bytes(res, world, which=False)
        muon = (s[("main", "all_gather")] + s[("main", "reduce_scatter")] + s[("optimizer", "all_gather")]
                - other["all_gather"] - other["reduce_scatter"])
        assert muon == pytest.approx((n_gathers + 2) * f * p_pad)


def test_owner_keep_moves_two_thirds_of_naive_for_the_muon_matrices():
    """Same model, 2 ranks, params kept after forward: owner-centric Muon bytes / naive Muon bytes = 2/3
    (naive's Muon share = its total minus the AdamW share FSDP2 moves in the owner layout)."""
    own = results(2, "bytes_owner_keep")[0]["summary"]
    nai = results(2, "bytes_naive")[0]["summary"]
    adamw = own[("main", "all_gather")] + own[("main", "reduce_scatter")]
    naive_muon = (nai[("main", "all_gather")] + nai[("main", "reduce_scatter")]
                  + nai[("optimizer", "all_gather")] - adamw)
    owner_muon = own[("dmuon", "reduce")] + own[("dmuon", "broadcast")]
    # uneven rows: FSDP2 pads (22 rows, 5 rows over 2 ranks), the owner layout does not
    res = results(2, "bytes_owner_keep")[0]
    assert owner_muon / naive_muon == pytest.approx(2 / 3 * muon_bytes(res) / muon_bytes(res, padded_to=2))


def test_bad_setups_say_what_is_accepted():
    errs = results(2, "errors")[0]
    assert "fully_shard with ignored_params=set(dmuon.muon_params(model))" in errs["layout_mismatch"]
    assert errs["layout_mismatch"].startswith("InputError: layout='fsdp2-owner'")
    assert "memory='free' is for layout 'fsdp2-owner'" in errs["free_replicated"]
    assert errs["bad_memory"] == "InputError: unknown memory 'spill'; accepted: keep, free"
    assert "only one backward per step may exchange" in errs["two_exchanges"]
    assert "no_sync()" in errs["two_exchanges"]
    assert "memory='free' only the owner keeps one" in errs["free_checksums"]


@pytest.mark.parametrize("name", [c["name"] for c in LAYOUTS])
def test_nonfinite_gradient_on_one_rank_stops_the_step_everywhere(name):
    """The NaN is in one rank's gradient (owner layout) or, after FSDP2's reduce-scatter, in one rank's
    shard (sharded layouts): the flag agreement makes every rank raise, naming the matrix."""
    per_rank = results(2, f"nonfinite_{name}")
    for rank, res in enumerate(per_rank):
        assert "non-finite gradient" in res["error"] and "blocks.0.up.weight" in res["error"], (rank, res)
        assert res["unchanged"], f"rank {rank}: parameters changed in the skipped step"
    for res in per_rank[1:]:
        for k, v in per_rank[0]["params"].items():
            assert torch.equal(v, res["params"][k]), k
