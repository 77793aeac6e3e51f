"""Template replays in C (simulator/engine/engine_native_replay.h) build the programs the Python loop builds:
every op's fields, collective and dependencies, for every simulated rank; and the same results. The metric
scans in C (engine_native_measure.h) read the same numbers as simulator.engine.metrics' Python loops."""

import json

import pytest

from simulator.api import SimConfig, run
from simulator.engine import engine_native, metrics
from simulator.engine.engine import Op
from simulator.engine.symmetry import result_digest
from simulator.programs import step_template

TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "moe_intermediate_size": 128,
            "intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 4,
            "tie_word_embeddings": False}
CONFIGS = [  # (label, SimConfig fields; "moe": the tiny MoE above), all ranks and one per class
    ("moe/dmuon/ep8/64", dict(moe=True, gpus=64, ep=8)),
    ("moe/dmuon/ep4/hsdp-free/32", dict(moe=True, gpus=32, ep=4, layout="hsdp-free")),
    ("dmuon/fsdp-free/16/nooverlap", dict(workload="qwen2.5-1.5b", seq_len=256, gpus=16, layout="fsdp-free",
                                          overlap=False)),
]


@pytest.fixture(scope="module")
def native():
    mod = engine_native.load()
    if mod is None:
        pytest.skip("the compiled event loop cannot be built here (no C compiler or Python headers)")
    return mod


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinymoe")
    (d / "config.json").write_text(json.dumps(TINY_MOE))
    return str(d)


def _programs(built) -> dict:
    """Per simulated (rank, stream) every op as (name, phase, step, dur, its collective's index, its
    dependencies as (rank, stream, position)), times left out: what the build made."""
    cl = built.cluster
    where = {id(o): (r, st, i) for (r, st), ops in cl.queues.items() for i, o in enumerate(ops)}
    coll = {id(c): k for k, c in enumerate(cl.collectives)}
    return {key: [(o.name, o.phase, o.step, repr(o.dur), coll.get(id(o.coll)), tuple(where[id(d)] for d in o.deps),
                   o.rank, o.stream, o.start, o.end, o.done, o.slowed_s) for o in ops]
            for key, ops in cl.queues.items() if ops}


@pytest.mark.parametrize("all_ranks", [False, True], ids=["classes", "all"])
@pytest.mark.parametrize("label,kw", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_native_replay_builds_the_python_programs(native, moe, monkeypatch, label, kw, all_ranks):
    kw = dict(kw)
    if kw.pop("moe", False):
        kw.update(model=moe, seq_len=128, micro_batch=1)
    cfg = SimConfig(**kw)
    calls = []
    real = native.replay

    class Counting:  # the module, counting its replays (the test must not pass without any)
        def replay(self, *a):
            got = real(*a)
            calls.append(got is not None)  # None: the rank's instance lacks a collective (no replay)
            return got

    with monkeypatch.context() as m:
        m.setattr(step_template.TemplatePrograms, "_native_replay", lambda self: Counting())
        _, c_built = run(cfg, all_ranks=all_ranks, _execute=False)
    assert any(calls), "no template was replayed: the comparison would be empty"
    python_loop = []
    monkeypatch.setitem(step_template.REPLAY, "mode", "python")
    real_loop = step_template.TemplatePrograms._replay_ops
    monkeypatch.setattr(step_template.TemplatePrograms, "_replay_ops",
                        staticmethod(lambda *a: python_loop.append(1) or real_loop(*a)))
    _, py_built = run(cfg, all_ranks=all_ranks, _execute=False)
    assert len(python_loop) == sum(calls)
    assert _programs(c_built) == _programs(py_built)
    if not all_ranks:  # and the same simulated numbers, against the Python-built programs' run
        monkeypatch.setitem(step_template.REPLAY, "mode", "auto")
        res_c, _ = run(cfg, all_ranks=False)
        monkeypatch.setitem(step_template.REPLAY, "mode", "python")
        res_py, _ = run(cfg, all_ranks=False)
        assert result_digest(res_c) == result_digest(res_py)


def test_native_replay_rejects_a_template_that_does_not_fit(native):
    seq = [(0, 0, 0, "fwd0", "fwd", 0, 1.0, -1, ()), (1, 0, 1, "fwd1", "fwd", 0, 1.0, -1, (0,)),
           (2, 1, 0, "ag", "fwd", 0, 0.0, 0, (0,))]
    one = ["compute", "comm"], [[], [(0, 7)]]
    flat, lists = native.replay(Op, seq, 3, *one, [{7: "coll"}], {}, 3, [2, 1])
    assert [o.name for o in lists[0]] == ["fwd0", "fwd1"] and flat[1].deps == (flat[0],)
    assert (flat[1].rank, flat[1].start, flat[1].end, flat[1].done, flat[1].slowed_s) == (3, None, None, None, 0.0)
    assert (lists[1][0].coll, lists[1][0].stream, flat[0].coll) == ("coll", "comm", None)
    assert native.replay(Op, seq, 3, *one, [{8: "coll"}], {}, 3, [2, 1]) is None  # the instance lacks it
    with pytest.raises(ValueError, match="one item per stream"):
        native.replay(Op, seq, 3, *one, [{7: "coll"}], {}, 3, [2])
    with pytest.raises(IndexError, match="position or collective out of range"):
        native.replay(Op, seq, 3, *one, [{7: "coll"}], {}, 3, [1, 1])
    with pytest.raises(ValueError, match="every op of its record"):
        native.replay(Op, seq, 3, *one, [{7: "coll"}], {}, 4, [2, 1])
    with pytest.raises(KeyError):  # a placeholder the rank has no ops for
        native.replay(Op, [(0, 0, 0, "x", "fwd", 0, 1.0, -1, (-1,))], 3, ["compute"], [[]], [], {}, 1, [1])


@pytest.mark.parametrize("label,kw", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
def test_native_metric_scans_read_what_the_python_ones_read(native, moe, monkeypatch, label, kw):
    """simulator.engine.metrics.measure with its phase ends from the compiled loop (engine_native.c: op_times)
    and its scans in C (engine_native_measure.h), and with the Python scans: the same dict, floats bit for
    bit, on a finished run (all ranks, so idle ranks and every stream count)."""
    kw = dict(kw)
    if kw.pop("moe", False):
        kw.update(model=moe, seq_len=128, micro_batch=1)
    _, built = run(SimConfig(**kw), all_ranks=True)
    cl = built.cluster
    assert cl.phase_ends is not None  # the compiled loop's phase ends, which `measure` reads first
    assert native.phase_ends(Op, [(ops, st == "compute") for (_, st), ops in cl.queues.items()], 1) is not None
    assert native.compute_gaps(Op, cl.queues[(0, "compute")], 0.0, 1e9, 1) is not None
    got = {s: repr(sorted(metrics.measure(built, s).items())) for s in (0, 1)}
    monkeypatch.setitem(metrics.SCANS, "mode", "python")
    assert got == {s: repr(sorted(metrics.measure(built, s).items())) for s in (0, 1)}
    cl.queues[(0, "compute")][0].end = 1  # an int time: the C scans hand over to the Python ones
    assert native.phase_ends(Op, [(cl.queues[(0, "compute")], True)], 1) is None

