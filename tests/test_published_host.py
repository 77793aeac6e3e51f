"""system 'published', host side (simulator.programs.published_host): the launch counts read from the public
code, the host loop's gating, the per-model tensor counts, and what the two switches do to a step."""

import pytest

from simulator.api import SimConfig, simulate
from simulator.programs.published_host import (ADAMW_LAUNCHES, EAGER_OP_S, LAUNCH_QUEUE, HostLoop,
                                               adamw_loop_tensors, ns_launches)
from simulator.programs.step_published import MECHANISMS

BASE = dict(workload="pi0", gpus=64, strategy="dmuon", seq_len=512, micro_batch=1, layout="fsdp-keep",
            system="published")


def test_launch_counts_from_the_public_code():
    assert ADAMW_LAUNCHES == 9  # mul_ (wd), mul_ + add_, mul_ + addcmul_, sqrt, /, add_, addcdiv_
    assert ns_launches(2) == 33  # bf16 gradients: X.float() and the cast to the fp32 master launch
    assert ns_launches(4) == 31


def test_host_loop_gates_past_the_queue_only():
    h = HostLoop()
    assert h.gate(1e-3, LAUNCH_QUEUE - 10) == 1e-3  # already queued when the GPU gets there
    assert h.gate(0.0, 110) == pytest.approx(100 * EAGER_OP_S)  # 10 still credited, 100 issued one by one
    assert h.gate(1.0, 50) == 1.0  # GPU-bound: the GPU time stands
    assert h.gate(0.0, 50) == pytest.approx(50 * EAGER_OP_S)


def test_tensor_counts_per_model():
    # 28 x (3 biases + 2 norms) + the final norm + embed + head
    assert adamw_loop_tensors("qwen2.5-7b", 2) == (143, None)
    assert adamw_loop_tensors("llama3.1-8b", 2) == (67, None)
    assert adamw_loop_tensors("pi0", 1) == (361, None)
    n, note = adamw_loop_tensors("my-model", 3)
    assert n == 3
    assert note == ("published adamw_unfused: no non-matrix tensor count for workload 'my-model' "
                    "(experiments/reference/published_nonmatrix_tensors.csv): its AdamW loop counts its 3 "
                    "listed AdamW tensors only")


def _opt(*on):
    return simulate(SimConfig(**BASE, published_off=tuple(m for m in MECHANISMS if m not in on))).optimizer_s


def test_switches_lengthen_the_optimizer_by_the_host_loop():
    base = _opt("ns_per_matrix")
    adamw = _opt("ns_per_matrix", "adamw_unfused")
    both = _opt("ns_per_matrix", "adamw_unfused", "ns_eager")
    # pi0 at 64 ranks: 361 tensors x 9 launches, the local shards small: host-bound past the queue, and the
    # loop takes max(the pass's GPU time, its host time), so it adds at most the host time past the queue
    assert 0 < adamw - base <= (361 * ADAMW_LAUNCHES - LAUNCH_QUEUE) * EAGER_OP_S + 1e-12
    # the NS calls' launches use up queue before the AdamW loop, which is then exposed further
    assert both > adamw
    assert _opt("ns_per_matrix", "ns_eager") == base  # 415 matrices / 64 ranks x 33 launches fit the queue
