"""Sharded checkpoints (torch.distributed.checkpoint) of DMuon on every layout: save after 3 steps with 4
ranks, resume with 4 ranks (bitwise the uninterrupted run) and with 2 ranks (new plan: momentum follows
its matrix to the new owner; <= 1e-5 of the uninterrupted run). The 4-rank runs are test_fsdp.py's
battery (shared, cached); the 2-rank resumes are one more spawn."""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import run_distributed
from test_fsdp import CHECKPOINTS, _resume, _run, assert_close, ref_for, results
from test_fsdp_cases import run_cases

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

NAMES = [c["name"] for c in CHECKPOINTS]
BAD = [{**CHECKPOINTS[0], "name": "bad_load", "runner": "bad_load"},
       {**CHECKPOINTS[3], "name": "bad_load_replicated", "runner": "bad_load"}]


@functools.cache
def _bad() -> tuple:
    _run(4)
    return tuple(run_distributed(run_cases, 2, (BAD,), timeout_s=120))


@pytest.mark.parametrize("name", NAMES)
def test_resume_with_the_same_ranks_is_bitwise(name):
    for rank, res in enumerate(results(4, name)):
        for k, v in res["straight"].items():
            assert torch.equal(v, res["resumed"][k]), f"{name}: rank {rank}: {k} differs after resuming"


@pytest.mark.parametrize("name", NAMES)
def test_uninterrupted_run_matches_single_device_muon(name):
    c = next(c for c in CHECKPOINTS if c["name"] == name)
    assert_close(results(4, name)[0]["straight"], ref_for(c), name)


@pytest.mark.parametrize("name", NAMES)
def test_resume_with_two_ranks_continues_the_trajectory(name):
    straight = results(4, name)[0]["straight"]
    resumed = results(2, name.replace("ckpt", "resume"), _resume())
    assert_close(resumed[0]["params"], straight, f"{name} resumed on 2 ranks")
    for res in resumed[1:]:
        for k, v in resumed[0]["params"].items():
            assert torch.equal(v, res["params"][k]), k


@pytest.mark.parametrize("name", [n for n in NAMES if "sharded" not in n])
def test_momentum_moves_to_the_new_owner(name):
    """Owner layouts: after loading at 2 ranks each rank holds the momentum of exactly the matrices the
    new plan gives it, including those saved at 4 ranks by ranks 2 and 3."""
    per_rank = results(2, name.replace("ckpt", "resume"), _resume())
    owners, names = per_rank[0]["owners"], per_rank[0]["muon_names"]
    assert max(results(4, "owner_keep")[0]["owners"]) >= 2  # the saving plan used ranks 2 and 3
    for rank, res in enumerate(per_rank):
        want = sorted(n for n, o in zip(names, owners, strict=True) if o == rank)
        assert want and res["loaded_momentum"] == want, f"rank {rank}"


def test_sharded_layout_loads_every_local_momentum_shard():
    per_rank = results(2, "resume_sharded", _resume())
    for res in per_rank:
        assert len(res["loaded_momentum"]) == 15


def test_checkpoint_writes_owner_state_once_and_zero_pieces_by_range():
    keys = results(2, "bad_load", _bad())[0]["keys"]
    assert "optim.meta.format" in keys
    assert "optim.state.blocks.0.up.weight.momentum_buffer" in keys
    assert "model.blocks.0.up.weight" in keys
    rep = results(2, "bad_load_replicated", _bad())[0]["keys"]
    pieces = [k for k in rep if "@" in k]  # ZeRO-1 AdamW state of the replicated layout: flat ranges
    assert any(k.startswith("optim.state.embed.weight.exp_avg@") for k in pieces), pieces
    spans = sorted(tuple(int(x) for x in k.split("@")[1].split(":")) for k in pieces
                   if k.startswith("optim.state.embed.weight.exp_avg@"))
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] == 32 * 16


def test_loading_a_directory_without_checkpoint_says_so():
    err = results(2, "bad_load", _bad())[0]["error"]
    assert err.startswith("InputError: ") and "no torch.distributed.checkpoint metadata" in err
    assert "accepted: a directory written by dmuon.save_checkpoint" in err
