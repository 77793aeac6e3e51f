"""DMuon and NaiveMuon on tensor-parallel meshes (dmuon/runtime/tp.py) on 4 gloo ranks, one spawn for every
scenario (tests/tp_cases.py): TP alone (tp 4), the torchtitan FSDP2 x TP recipe (dp 2 x tp 2: Colwise /
RowwiseParallel, then fully_shard on mesh["dp"]) and HSDP x TP (replicate 2 x shard 1 x tp 2) agree with
single-process Muon within 1e-5 (fp32) in both TP modes; bf16 on the wire stays close; a NaN gradient on one
rank skips the step on every rank; a DCP checkpoint saved at dp 2 x tp 2 loads at tp 4 and the next
step there equals Muon's."""

from __future__ import annotations

import pytest
from dist_utils import run_distributed, scratch_dir
from tp_cases import KV, run_all

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_all, world_size=4, args=(scratch_dir("tp_dcp"),), timeout_s=240)


def test_tp_alone_and_fsdp_tp_equal_muon(results):
    r = results[0]
    for key in ("tp/DMuon/auto", "tp/NaiveMuon/auto", "fsdp_tp/DMuon/group", "fsdp_tp/NaiveMuon/auto",
                "hsdp_tp/DMuon/auto"):
        assert r[key] < TOL, (key, r[key])
    assert r["tp/DMuon/auto/type"] == "TPDMuon" and r["tp/NaiveMuon/auto/type"] == "TPNaiveMuon"
    # both modes ran: forced group takes the 12 matrices cut along the long side (wk, wk2 are gathered)
    assert r["fsdp_tp/DMuon/group/modes"] == (12, 4)
    assert r["tp/DMuon/auto/modes"][0] + r["tp/DMuon/auto/modes"][1] == 16
    # every rank agrees on every parameter (DTensors: the full tensors were compared on each rank)
    for k in ("tp/DMuon/auto", "fsdp_tp/DMuon/group", "hsdp_tp/DMuon/auto"):
        assert len({res[k] for res in results}) == 1


def test_dp_share_each_matrix_orthogonalized_once(results):
    """On dp 2 x tp 2 each matrix is orthogonalized by one TP group: NS calls summed over ranks (group
    mode counted on the TP group's lead) = matrices x steps."""
    total = sum(res["fsdp_tp/DMuon/group/ns"] for res in results)
    assert total == 16 * 2


def test_bf16_wire_close(results):
    r = results[0]
    assert r["fsdp_tp/DMuon/gather/bf16"] < 1e-2  # bf16 rounding of the NS input and the update
    assert r["fsdp_tp/DMuon/gather/bf16"] > TOL / 10  # it did travel in bf16


def test_nonfinite_skips_everywhere(results):
    for res in results:
        assert res["nan_skipped"] == 1
        assert res["nan_dev_vs_1_step"] < TOL


def test_dcp_reshards_dp2_tp2_to_tp4(results):
    for res in results:
        assert res["reshard_weights"] < TOL
        assert res["reshard_momentum_shape"] == (16, KV // 4)  # wk2 (16 x 8) row-parallel over tp 4
        assert res["reshard_then_step"] < TOL  # momentum and AdamW state came back re-sharded


def test_bad_input_one_line_errors(results):
    r = results[0]
    assert r["err_divide"].startswith("InputError: layers.0.weight: tp=4 does not divide dim 0 (30)")
    assert "accepted: a TP degree dividing the sharded dimension" in r["err_divide"]
    assert r["err_placement"].startswith("InputError: layers.0.weight: placements (Shard(dim=1), "
                                         "Shard(dim=0)) are not handled on a TP mesh; accepted: ")
    assert "\n" not in r["err_divide"] + r["err_placement"]
