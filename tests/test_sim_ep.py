"""Expert parallelism in the simulator (simulator.step_ep): groups, collective sizes, all-to-alls, errors."""

import json

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, run, simulate

TINY = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "moe_intermediate_size": 128,
        "intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 4, "tie_word_embeddings": False}
SEQ, GPUS = 128, 16
EXPERT_NUMEL = 16 * 3 * 128 * 256  # per MoE layer: 16 experts x (gate, up, down) of 128 x 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinymoe")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def _cfg(model, **kw):
    return SimConfig(**{"model": model, "gpus": GPUS, "seq_len": SEQ, "micro_batch": 1, **kw})


def _cfg_kw(model, kw):
    return SimConfig(**{"model": model, "gpus": GPUS, "seq_len": SEQ, "micro_batch": 1, **kw})


def _colls(built, step=1):
    return [c for c in built.cluster.collectives if c.step == step]


@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
def test_ep1_has_no_ep_ops(model, strategy):
    r, built = run(_cfg(model, strategy=strategy))
    assert r == simulate(_cfg(model, strategy=strategy, ep=1))
    assert not [c for c in _colls(built) if c.kind == "all_to_all" or c.group.startswith(("ep", "rep"))]
    assert {c.group for c in _colls(built)} == {"world0"}


@pytest.mark.parametrize("ep", [2, 4, 8, 16])
def test_all_to_alls_and_expert_groups(model, ep):
    _, built = run(_cfg(model, strategy="adamw", ep=ep))
    a2a = [c for c in _colls(built) if c.kind == "all_to_all"]
    # 2 MoE layers x 4 all-to-alls (dispatch, combine, their gradients) x gpus / ep EP groups
    assert len(a2a) == 2 * 4 * GPUS // ep
    sent = SEQ * 256 * 4 * 2  # tokens x hidden x top_k x bf16
    assert all(c.size == ep and c.bytes_per_rank == pytest.approx((ep - 1) / ep * sent) for c in a2a)
    names = sorted({c.name.split("/")[2] for c in a2a})
    assert names == ["combine", "combine_grad", "dispatch", "dispatch_grad"]
    # experts reduce-scattered over their replica group (gpus / ep ranks), ep / gpus of the layer's experts
    rs = [c for c in _colls(built) if c.kind == "reduce_scatter" and c.group.startswith("rep")]
    reps = GPUS // ep
    assert len(rs) == 2 * ep and all(c.size == reps for c in rs)
    assert all(c.bytes_per_rank == pytest.approx((reps - 1) / reps * EXPERT_NUMEL / ep * 2) for c in rs)
    # the dense world reductions no longer carry the experts
    world = [c for c in _colls(built) if c.kind == "reduce_scatter" and c.group == "world0"]
    _, base = run(_cfg(model, strategy="adamw"))
    base_rs = {c.name: c for c in _colls(base) if c.kind == "reduce_scatter"}
    for c in world:
        b = base_rs[c.name]
        moe = c.name.split("/")[-1] in ("1", "2")
        assert b.bytes_per_rank - c.bytes_per_rank == pytest.approx(15 / 16 * EXPERT_NUMEL * 2 if moe else 0)


def test_exposed_all_to_alls_cost_time(model):
    """The forward waits for the dispatch / combine: EP across nodes is slower than inside one node."""
    inside = simulate(_cfg(model, strategy="adamw", ep=8))
    across = simulate(_cfg(model, strategy="adamw", ep=16))
    assert across.forward_s > inside.forward_s


@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
def test_representatives_match_all_ranks(model, strategy):
    cfg = _cfg(model, strategy=strategy, ep=4)
    full, _ = run(cfg)
    assert simulate(cfg) == full


@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
@pytest.mark.parametrize("kw", [dict(ep=4), dict(ep=16, layout="fsdp-free"), dict(ep=8, gpu="cpu"),
                                dict(ep=4, layout="hsdp-free"), dict(ep=4, layout="ddp"),
                                dict(ep=8, layout="sharded")])
def test_fast_engine_matches_simpy(model, monkeypatch, strategy, kw, sim_engine):
    """Both event loops (engine_fast, engine_native) give every op the SimPy reference's times."""
    from simulator.engine import Cluster

    cfg = _cfg(model, strategy=strategy, **kw)
    orig = Cluster.run
    monkeypatch.setattr(Cluster, "run", lambda self: orig(self, reference=True))
    ref, ref_built = run(cfg, all_ranks=False)
    monkeypatch.setattr(Cluster, "run", orig)
    fast, fast_built = run(cfg, all_ranks=False)
    assert fast_built.cluster.engine == sim_engine
    assert fast == ref
    ops = [[(o.name, o.start, o.end) for q in b.cluster.queues.values() for o in q]
           for b in (ref_built, fast_built)]
    assert ops[0] and ops[0] == ops[1]


def test_dmuon_experts_exchanged_in_replica_group(model):
    r, built = run(_cfg(model, strategy="dmuon", ep=4))
    plan = built.spec.plan
    assert plan.ep == 4
    ex = [c for c in _colls(built) if c.name.startswith(("reduce/", "pub/")) and c.group.startswith("rep")]
    assert ex and all(c.size == GPUS // 4 for c in ex)
    # every expert matrix's owner is in the replica group of its EP rank
    from dmuon.plan.ep import expert_placement

    for m, w, o in zip(plan.matrices, expert_placement(plan.matrices, 4), plan.owners, strict=True):
        assert w is None or o % 4 == w, m.name
    # the dense matrices still go over the world group
    assert [c for c in _colls(built) if c.name.startswith("reduce/") and c.group == "world0"]
    # naive: expert gradients gathered over the replica group only, NS on the local experts only
    n1, n4 = simulate(_cfg(model, strategy="naive")), simulate(_cfg(model, strategy="naive", ep=4))
    assert n4.ns_makespan_s < n1.ns_makespan_s


@pytest.mark.parametrize("layout", ["hsdp-keep", "hsdp-free"])
@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
def test_hsdp_with_ep(model, layout, strategy):
    """HSDP with EP (2 nodes of 8, ep 4): dense parameters sharded in the node and all-reduced across nodes
    as without EP; the experts over their replica group only, which spans the nodes (no all-reduce across
    nodes carries them; dmuon: the experts' owner exchange in that group, as DMuon(model, ep=E) runs it)."""
    cfg = _cfg(model, strategy=strategy, layout=layout, ep=4)
    full, built = run(cfg)
    assert simulate(cfg) == full  # the representative ranks give every rank's result
    cs = _colls(built)
    rep = [c for c in cs if c.group.startswith("rep")]
    assert rep and all(c.size == GPUS // 4 for c in rep)
    if strategy == "dmuon":
        assert [c for c in rep if c.name.startswith(("reduce/", "pub/"))]
        assert [c for c in cs if c.name.startswith("reduce/") and c.group == "world0"]
    _, base = run(_cfg(model, strategy=strategy, layout=layout))
    base_inter = {(c.name, c.group): c.bytes_per_rank for c in _colls(base) if c.group.startswith("inter")}
    inter = [c for c in cs if c.group.startswith("inter")]
    assert inter and len(inter) == len(base_inter)
    for c in inter:  # an all-reduce over 2 nodes moves its size per rank: the experts' share / 8 is gone
        moe = c.name.split("/")[-1] in ("1", "2") and strategy != "dmuon"  # dmuon: AdamW parameters only
        assert base_inter[(c.name, c.group)] - c.bytes_per_rank == pytest.approx(
            EXPERT_NUMEL * 2 / 8 if moe else 0)


@pytest.mark.parametrize("kw, msg", [
    (dict(ep=3), "divide gpus=16"),
    (dict(ep=32), "divide gpus=16"),  # ep > gpus: not a divisor
    (dict(ep=0), "ep must be an integer >= 1"),
    (dict(ep=4, layout="zero3"), "layout fsdp-keep | fsdp-free | hsdp-keep | hsdp-free | ddp | sharded"),
    (dict(ep=4, max_split=2), "max_split"),
    (dict(workload="qwen2.5-7b", model=None, ep=2), "no routed experts"),
])
def test_bad_input(model, kw, msg):
    with pytest.raises(InputError, match=msg.replace("|", r"\|")):
        simulate(_cfg_kw(model, kw))


def test_ep_must_divide_experts(model, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_experts": 12}))
    with pytest.raises(InputError, match="does not divide the 12 experts"):
        simulate(_cfg(str(tmp_path), gpus=8, ep=8, strategy="adamw"))


A2A = SEQ * 256 * 4 * 2  # one all-to-all's send buffer per rank: tokens x hidden x top_k x bf16


def _numel(built) -> tuple[int, int]:
    """(all parameters' elements, the routed experts' of every EP rank)."""
    s = built.spec
    return sum(s.layer_adamw_numel) + sum(s.muon_numel), 2 * EXPERT_NUMEL


def _shard(built, layout: str) -> int:
    """Ranks a dense parameter is sharded over: all (FSDP), a node's (HSDP), none (ddp)."""
    return 1 if layout == "ddp" else built.spec.per_node if layout.startswith("hsdp") else GPUS


def _rank_muon(built, layout: str, ep: int) -> tuple[float, int]:
    """(Muon elements, Muon tensors) of one rank's adamw / naive optimizer, from the model's dense / expert
    split: its share of every dense matrix (`_shard`) and of its own experts only (experts / ep; FSDP and
    HSDP shard them over the gpus / ep replica group, so experts / gpus; ddp keeps them whole); one tensor
    per dense matrix and per own expert matrix."""
    s = built.spec
    n_ex = 2 * 16 * 3  # 2 MoE layers x 16 experts x (gate, up, down)
    shard = _shard(built, layout)
    experts = 2 * EXPERT_NUMEL
    own = experts / (shard if ep == 1 else ep if layout == "ddp" else GPUS)
    return (sum(s.muon_numel) - experts) / shard + own, len(s.muon_numel) - n_ex + n_ex // ep


def _assert_optimizer_pass(built, strategy: str, layout: str, ep: int) -> None:
    """Rank 0's AdamW pass (adamw) / momentum pass (naive) in step 1 is priced over `_rank_muon`'s
    elements and tensors (adamw: and the rank's share of the AdamW parameters, all dense)."""
    s = built.spec
    local, tensors = _rank_muon(built, layout, ep)
    name = "momentum" if strategy == "naive" else "adamw"
    op = next(o for o in built.cluster.queues[(0, "compute")] if o.step == 1 and o.name == name)
    if strategy == "naive":
        want = (s.elementwise_s(local, "muon_momentum", tensors)
                + s.elementwise_s(local, "grad_prep", sum(1 for ms in s.layer_muon if ms)))
    else:
        local += sum(s.layer_adamw_numel) / _shard(built, layout)
        want = (s.elementwise_s(local, "adamw", tensors + sum(s.layer_adamw_tensors))
                + s.elementwise_s(local, "grad_prep", s.n_layers))
    assert op.dur == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("layout", ["fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "sharded"])
@pytest.mark.parametrize("strategy", ["adamw", "naive"])
@pytest.mark.parametrize("ep", [1, 4, 16])
@pytest.mark.parametrize("gpu", [{}, {"gpu": "cpu"}])
def test_optimizer_pass_over_own_experts(model, layout, strategy, ep, gpu):
    """adamw / naive with EP: a rank's AdamW / momentum pass runs over its dense shards and only its own
    experts (not every EP rank's), the elements and tensors of `_rank_muon`; ep = 1: every matrix's
    shard, as before (ddp: test_ddp_with_ep). The cpu profile prices each extra tensor (its split rows:
    `CostTable.per_tensor_time`), the a800 one does not."""
    _, built = run(_cfg(model, strategy=strategy, layout=layout, ep=ep, **gpu), all_ranks=False)
    _assert_optimizer_pass(built, strategy, "fsdp-keep" if layout == "sharded" else layout, ep)


@pytest.mark.parametrize("strategy", ["adamw", "naive"])
@pytest.mark.parametrize("ep", [4, 8])
def test_ddp_with_ep(model, strategy, ep):
    """ddp with EP (adamw, naive): the dense gradients all-reduced over the world, each rank's experts over
    its replica group, nothing gathered; bytes per rank equal the closed form; the world all-reduces are
    ep = 1's less the experts."""
    cfg = _cfg(model, strategy=strategy, layout="ddp", ep=ep)
    r, built = run(cfg)
    assert simulate(cfg) == r
    cs = _colls(built)
    assert {c.kind for c in cs} == {"all_reduce", "all_to_all"}
    reps, (total, experts) = GPUS // ep, _numel(built)
    rep = [c for c in cs if c.group.startswith("rep")]
    assert len(rep) == 2 * ep and all(c.kind == "all_reduce" and c.size == reps for c in rep)
    expected = (2 * (GPUS - 1) / GPUS * (total - experts) * 2 + 2 * (reps - 1) / reps * experts / ep * 2
                + 2 * 4 * (ep - 1) / ep * A2A)
    assert r.comm_bytes_per_rank == pytest.approx(expected, rel=1e-12)
    _assert_optimizer_pass(built, strategy, "ddp", ep)  # every dense matrix and the rank's own experts
    _, base = run(_cfg(model, strategy=strategy, layout="ddp"))
    base_ar = {c.name: c.bytes_per_rank for c in _colls(base)}
    world = [c for c in cs if c.group == "world0"]
    assert len(world) == len(base_ar)
    for c in world:
        moe = c.name.split("/")[-1] in ("1", "2")
        assert base_ar[c.name] - c.bytes_per_rank == pytest.approx(
            2 * 15 / 16 * EXPERT_NUMEL * 2 if moe else 0)


@pytest.mark.parametrize("strategy", ["adamw", "naive"])
def test_sharded_with_ep_is_fsdp_keep(model, strategy):
    """Layout 'sharded' changes only dmuon's optimizer: adamw / naive with EP run as fsdp-keep with EP."""
    a, b = (simulate(_cfg(model, strategy=strategy, layout=lay, ep=4)) for lay in ("sharded", "fsdp-keep"))
    for f in ("step_s", "optimizer_s", "backward_s", "comm_bytes_per_rank", "muon_comm_bytes_per_rank"):
        assert getattr(a, f) == getattr(b, f), f


@pytest.mark.parametrize("layout", ["ddp", "sharded"])
def test_dmuon_expert_step(model, layout):
    """dmuon, ddp / sharded with EP (DMuon(model, ep=E), replicated / fsdp2-sharded): the experts are
    neither FSDP's nor in the per-bucket exchange; ExpertMuon.step's one packed reduce and one broadcast
    per replica group, inside it (each rank on its own EP rank's group); the dense matrices' exchange over
    the world (sharded: its all-to-alls and FSDP2's gathers without the experts); the next forward waits
    for the experts' broadcast."""
    ep = 4
    cfg = _cfg(model, strategy="dmuon", layout=layout, ep=ep)
    r, built = run(cfg)
    assert simulate(cfg) == r
    cs, reps, (total, experts) = _colls(built), GPUS // ep, _numel(built)
    rep = [c for c in cs if c.group.startswith("rep")]
    assert sorted(c.name for c in rep) == ["ex_broadcast/1"] * ep + ["ex_reduce/1"] * ep
    assert all(c.size == reps and c.bytes_per_rank == pytest.approx((reps - 1) / reps * experts / ep * 2)
               for c in rep)
    for (rank, _), ops in built.cluster.queues.items():
        for o in ops:
            if o.coll is not None and o.name.startswith("ex_"):
                assert o.coll.group == f"rep{rank % ep}"
            if o.name == "ex_broadcast/0":
                first = next(f for f in built.cluster.queues[(rank, "compute")] if f.step == 1)
                assert first.start >= o.end
    world = [c for c in cs if c.group == "world0"]
    muon = sum(built.spec.muon_numel)
    if layout == "ddp":
        assert [c for c in world if c.name.startswith("reduce/")]  # dense Muon gradients to their owners
        ar = sum(c.bytes_per_rank for c in world if c.kind == "all_reduce")
        assert ar == pytest.approx(2 * 15 / 16 * (total - muon) * 2)  # AdamW parameters only
    else:
        a2a = sum(c.bytes_per_rank for c in world if c.name.startswith("a2a_to/"))
        assert a2a == pytest.approx(15 / 16 * (muon - experts) / GPUS * 2)  # dense shards to their owners
        ag = sum(c.bytes_per_rank for c in world if c.kind == "all_gather")
        assert ag == pytest.approx(15 / 16 * (total - experts) * 2)  # FSDP2 gathers: dense parameters


@pytest.mark.parametrize("layout", ["ddp", "sharded"])
def test_dmuon_not_slower_than_naive_with_ep(layout):
    """Qwen3-30B-A3B on 64 A800s, ep 8, in both layouts: DMuon's step <= naive's."""
    kw = dict(model="qwen3-30b-a3b", gpus=64, ep=8, layout=layout, seq_len=1024, micro_batch=1)
    d, n = (simulate(SimConfig(**kw, strategy=s)) for s in ("dmuon", "naive"))
    assert d.step_s <= n.step_s
