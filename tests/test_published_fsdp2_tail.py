"""system 'published', switch `fsdp2_tail`: the public Muon's NS waits FSDP2's reduce tail (FSDP2's root
post-backward callback, `FSDPParamGroup.finalize_backward` -> `_wait_for_post_backward`, makes the compute
stream wait every FSDP2 reduce before `optimizer.step()` runs)."""

from simulator.api import SimConfig, run
from simulator.programs.step_published import MECHANISMS

BASE = dict(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon", seq_len=512, micro_batch=1,
            system="published")


def _first_ns_and_tail(layout: str, off=()):
    """(earliest start of a step-1 owned NS batch, end of the step-1 FSDP2 reduce of layer 0) over ranks."""
    _, built = run(SimConfig(**BASE, layout=layout, published_off=off), all_ranks=False)
    cl = built.cluster
    first, tail = [], []
    for (r, st), ops in cl.queues.items():
        for op in ops:
            if op.step != 1 or op.start is None:
                continue
            if st == "compute" and op.name.startswith("batch"):
                first.append(op.start)
            elif op.coll is not None and op.phase == "bwd" and op.name.split("/")[-1] == "0" \
                    and op.name.startswith(("rs/", "ar/")):
                tail.append(op.end)
    return min(first), max(tail)


def test_ns_waits_the_fsdp2_reduce_tail():
    assert "fsdp2_tail" in MECHANISMS
    for layout in ("fsdp-keep", "hsdp-free"):
        start, tail = _first_ns_and_tail(layout)
        assert start >= tail
        start_off, tail_off = _first_ns_and_tail(layout, off=("fsdp2_tail",))
        assert start_off < tail_off  # without it an owner's NS overlaps the embedding's reduce
