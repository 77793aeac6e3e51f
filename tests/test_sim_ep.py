"""Expert parallelism in the simulator (simulator.programs.step_ep): groups, collective sizes, all-to-alls, errors."""

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
    from simulator.engine.engine import Cluster

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


def _rank_muon(built, layout: str, ep: int, strategy: str = "adamw") -> tuple[float, int]:
    """(Muon elements, Muon tensors) of one rank's adamw / naive optimizer, from the model's dense / expert
    split: its share of every dense matrix (`_shard`) and of its own experts only (experts / ep; adamw on
    FSDP and HSDP shards them over the gpus / ep replica group, so experts / gpus; ddp, and naive in every
    layout as `NaiveMuon(model, ep=E)`, keep them whole); one tensor per dense matrix and per own expert
    matrix."""
    s = built.spec
    n_ex = 2 * 16 * 3  # 2 MoE layers x 16 experts x (gate, up, down)
    shard = _shard(built, layout)
    experts = 2 * EXPERT_NUMEL
    own = experts / (shard if ep == 1 else ep if layout == "ddp" or strategy == "naive" else GPUS)
    return (sum(s.muon_numel) - experts) / shard + own, len(s.muon_numel) - n_ex + n_ex // ep


def _assert_optimizer_pass(built, strategy: str, layout: str, ep: int) -> None:
    """Rank 0's AdamW pass (adamw) / momentum pass (naive) in step 1 is priced over `_rank_muon`'s
    elements and tensors (adamw: and the rank's share of the AdamW parameters, all dense)."""
    s = built.spec
    local, tensors = _rank_muon(built, layout, ep, strategy)
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


@pytest.mark.parametrize("layout", ["fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "sharded"])
def test_naive_experts_whole_in_every_layout(model, layout):
    """naive with EP runs its experts as `NaiveMuon(model, ep=E)` does in every layout
    (`dmuon.runtime.ep.NaiveExperts`): never gathered nor reduce-scattered; per MoE layer one all-reduce of
    the rank's whole experts over its replica group in backward, the bytes of the closed form, the same
    collectives as ddp's; the optimizer gathers only dense matrices; momentum over the whole own experts."""
    ep = 4
    cfg = _cfg(model, strategy="naive", layout=layout, ep=ep)
    r, built = run(cfg)
    assert simulate(cfg) == r
    cs = _colls(built)
    rep = [c for c in cs if c.group.startswith("rep")]
    reps = GPUS // ep
    assert len(rep) == 2 * ep  # 2 MoE layers x ep replica groups
    assert all(c.kind == "all_reduce" and c.size == reps and c.name.startswith("ar/") for c in rep)
    for c in rep:
        assert c.bytes_per_rank == pytest.approx(2 * (reps - 1) / reps * EXPERT_NUMEL / ep * 2, rel=1e-12)
    _, ddp = run(_cfg(model, strategy="naive", layout="ddp", ep=ep))
    assert sorted((c.name, c.group, c.bytes_per_rank) for c in rep) == sorted(
        (c.name, c.group, c.bytes_per_rank) for c in _colls(ddp) if c.group.startswith("rep"))
    s = built.spec
    n_dense = len(s.muon_numel) - 2 * 16 * 3
    opt = [c for c in cs if c.name.startswith("ag/1/opt/")]
    assert len({c.name for c in opt}) == n_dense and all(not c.group.startswith("rep") for c in opt)
    ns = [o for o in built.cluster.queues[(0, "compute")] if o.step == 1 and o.name.startswith("ns")]
    assert len(ns) == n_dense + 2 * 16 * 3 // ep  # NS of every dense matrix and the rank's own experts
    _assert_optimizer_pass(built, "naive", "fsdp-keep" if layout == "sharded" else layout, ep)


@pytest.mark.parametrize("strategy", ["adamw", "naive"])
def test_sharded_with_ep_is_fsdp_keep(model, strategy):
    """Layout 'sharded' changes only dmuon's optimizer: adamw / naive with EP run as fsdp-keep with EP."""
    a, b = (simulate(_cfg(model, strategy=strategy, layout=lay, ep=4)) for lay in ("sharded", "fsdp-keep"))
    for f in ("step_s", "optimizer_s", "backward_s", "comm_bytes_per_rank", "muon_comm_bytes_per_rank"):
        assert getattr(a, f) == getattr(b, f), f


def _expert_parts(plan, ep: int) -> dict:
    """(bucket, EP rank) -> (elements, largest owner's share) of the bucket's experts on that EP rank."""
    from dmuon.plan.ep import expert_placement

    where, out = expert_placement(plan.matrices, ep), {}
    for b in plan.buckets:
        for k in range(ep):
            owned: dict = {}
            for i in b.members:
                if where[i] == k:
                    owned[plan.owners[i]] = owned.get(plan.owners[i], 0) + plan.matrices[i].numel
            if owned:
                out[(b.index, k)] = (sum(owned.values()), max(owned.values()))
    return out


@pytest.mark.parametrize("layout", ["ddp", "sharded"])
def test_dmuon_experts_per_bucket(model, layout):
    """dmuon, ddp / sharded with EP (DMuon(model, ep=E), replicated / fsdp2-sharded), as the runtime's
    ExpertMuon runs it in every layout: per bucket each EP rank's experts reduced to their owners over its
    replica group, issued in backward once the bucket's layers are done; the owners' expert batches wait
    for the reduces; per bucket a publication over the replica group after its batches; each layer of
    the next forward waits for its buckets' publications (not for all of them). Bytes per rank: the
    closed form of the mode picked (one reduce per owner: the payload; one reduce-scatter of padded
    chunks: group size x the largest share). The dense half over the world (ddp: owner exchange, AdamW
    parameters all-reduced; sharded: FSDP2 and per-bucket all-to-alls of the dense matrices only)."""
    ep = 4
    cfg = _cfg(model, strategy="dmuon", layout=layout, ep=ep)
    r, built = run(cfg)
    assert simulate(cfg) == r
    plan, reps, (total, experts) = built.spec.plan, GPUS // ep, _numel(built)
    parts = _expert_parts(plan, ep)
    assert sum(n for (_, k), (n, _) in parts.items() if k == 0) == experts / ep  # every own expert once
    first_layer = {b.index: min(plan.matrices[i].layer for i in b.members) for b in plan.buckets}
    expert_batch = {f"batch{k}" for k, bt in enumerate(plan.batches) if ".experts." in plan.matrices[
        bt.members[0]].name}
    q, pubs = built.cluster.queues, {}
    for (rank, stream), ops in q.items():
        if stream != "comm":
            continue
        red = {}
        for o in ops:
            if o.coll is None or not o.coll.group.startswith("rep"):
                continue
            tag, st, b, ep_tag = o.name.split("/")
            b, st = int(b), int(st)
            assert ep_tag == "ep" and o.coll.group == f"rep{rank % ep}" and o.coll.size == reps
            n, most = parts[(b, rank % ep)]
            rs = o.coll.kind in ("reduce_scatter", "all_gather")
            kinds = ("reduce_scatter", "reduce") if tag == "reduce" else ("all_gather", "broadcast")
            assert o.coll.kind in kinds
            assert o.coll.bytes_per_rank == pytest.approx((reps - 1) / reps * (reps * most if rs else n) * 2)
            if tag == "reduce":  # in backward, after the bucket's first layer
                assert o.phase == "bwd" and [d.name for d in o.deps] == [f"bwd{first_layer[b]}"]
                assert o.start >= o.deps[0].end
                red[(st, b)] = o
            else:
                pubs[(rank, st, b)] = o
        assert {b for _, b in red} == {b for b, k in parts if k == rank % ep}
        for st in range(built.spec.steps):  # the owner's expert batches after every expert sum is in
            for o in q[(rank, "compute")]:
                if o.step == st and o.name in expert_batch:
                    assert all(o.start >= x.end for (s2, _), x in red.items() if s2 == st)
    # publications after the owners' batches; the next forward's layers wait for their buckets' only
    later = 1  # step 0's update, published at the end of step 0 (ExpertMuon.step) as step 1's weights
    for (rank, _), ops in q.items():
        for o in ops:
            if o.step == 0 and o.name in expert_batch:
                bks = {b for b in range(len(plan.buckets)) if any(plan.owners[i] == rank for i in
                       plan.buckets[b].members) and (b, rank % ep) in parts}
                for b in bks:
                    assert pubs[(rank, later, b)].start >= o.end
    buckets_of = {}
    for b in first_layer:
        for i in plan.buckets[b].members:
            buckets_of.setdefault(plan.matrices[i].layer, set()).add(b)
    for rank in range(GPUS):
        for o in q[(rank, "compute")]:
            if o.step == 1 and o.phase == "fwd" and o.name.startswith("fwd") and "." not in o.name:
                l = int(o.name[3:])
                want = {pubs[(rank, later, b)] for b in buckets_of.get(l, ()) if (b, rank % ep) in parts}
                got = {d for d in o.deps if d.coll is not None and d.coll.group.startswith("rep")}
                assert got == want, (rank, l)
                assert all(o.start >= d.end for d in want)
    cs = _colls(built)
    world = [c for c in cs if c.group == "world0"]
    muon = sum(built.spec.muon_numel)
    if layout == "ddp":
        assert [c for c in world if c.name.startswith("reduce/")]  # dense Muon gradients to their owners
        ar = sum(c.bytes_per_rank for c in world if c.kind == "all_reduce")
        assert ar == pytest.approx(2 * 15 / 16 * (total - muon) * 2)  # AdamW parameters only
    else:
        assert not [c for c in world if c.name.startswith(("reduce/", "pub/"))]
        a2a = sum(c.bytes_per_rank for c in world if c.name.startswith("a2a_to/"))
        assert a2a == pytest.approx(15 / 16 * (muon - experts) / GPUS * 2)  # dense shards to their owners
        ag = sum(c.bytes_per_rank for c in world if c.kind == "all_gather")
        assert ag == pytest.approx(15 / 16 * (total - experts) * 2)  # FSDP2 gathers: dense parameters


@pytest.mark.parametrize("layout", ["ddp", "sharded", "fsdp-keep"])
def test_expert_exchange_is_flat(model, layout):
    """The experts' replica-group exchange is flat whatever `hierarchical` says (ExpertMuon's process
    groups have no node_size): the same collectives, kinds and times either way (ep 4 on nodes of 8: two
    replica-group ranks per node, where two-level would differ)."""
    def rep(h):
        _, built = run(_cfg(model, strategy="dmuon", layout=layout, ep=4, hierarchical=h), all_ranks=False)
        return sorted((c.name, c.group, c.kind, c.cost_s) for c in built.cluster.collectives
                      if c.group.startswith("rep"))

    flat = rep(False)
    assert flat and rep(True) == flat


@pytest.mark.parametrize("layout", ["ddp", "sharded"])
def test_dmuon_not_slower_than_naive_with_ep(layout):
    """Qwen3-30B-A3B on 64 A800s, ep 8, in both layouts: DMuon's step <= naive's."""
    kw = dict(model="qwen3-30b-a3b", gpus=64, ep=8, layout=layout, seq_len=1024, micro_batch=1)
    d, n = (simulate(SimConfig(**kw, strategy=s)) for s in ("dmuon", "naive"))
    assert d.step_s <= n.step_s


@pytest.mark.parametrize("layout, ep", [("ddp", 4), ("sharded", 4), ("hsdp-free", 2), ("fsdp-keep", 16)])
def test_expert_mode_is_the_runtimes(model, layout, ep):
    """Every bucket's expert exchange is simulated in the mode ExpertMuon's units pick (`units.auto_mode`
    over the replica group: no node_size, its ranks per node = GPUs per node / ep, owners as positions in
    the group), given the fabric estimate the simulator prices with."""
    from dmuon.runtime.groups import CommGroups
    from dmuon.runtime.units import auto_mode
    from simulator.programs import step_comm

    seen, orig = [], step_comm.CommPrograms.owner_coll

    def spy(self, r, key, b, kind, elem_bytes, group, step, part=None):
        col = orig(self, r, key, b, kind, elem_bytes, group, step, part)
        if group == "rep":
            g, inst = self._instance(group, r)
            shape = self._owner_shapes[(b, kind, group, inst)]
            groups = CommGroups(group=None, rank=0, world_size=g.size, global_ranks=tuple(range(g.size)),
                                backend=self.s.network.backend)
            owned = part[2]
            want = auto_mode(list(owned.values()), [o // self.ep for o in owned], groups, links=self._links(),
                             elem_bytes=elem_bytes, per_node=max(1, self.s.per_node // self.ep))
            seen.append((want, "reduce" if shape[0] in ("reduce", "broadcast") else "reduce_scatter"))
        return col

    step_comm.CommPrograms.owner_coll = spy
    try:
        run(_cfg(model, strategy="dmuon", layout=layout, ep=ep), all_ranks=False)
    finally:
        step_comm.CommPrograms.owner_coll = orig
    assert seen and all(a == b for a, b in seen)


@pytest.mark.parametrize("layout", ["fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "ddp", "sharded"])
def test_expert_batches_after_dense_update(model, layout):
    """The owner's order in `DMuon.step` with ep > 1 (every layout): its dense batches in plan order, the
    AdamW pass, then `ExpertMuon.step`: the expert batches in plan order, then each bucket's expert
    publication over the replica group, after that bucket's expert batches. Checked on every owner rank
    holding both dense and expert batches, every step."""
    ep = 4
    cfg = _cfg(model, strategy="dmuon", layout=layout, ep=ep)
    _, built = run(cfg)
    plan, q = built.spec.plan, built.cluster.queues
    is_expert = [".experts." in plan.matrices[bt.members[0]].name for bt in plan.batches]
    bucket_of = {i: b.index for b in plan.buckets for i in b.members}
    checked = 0
    for rank in range(GPUS):
        mine = [k for k, bt in enumerate(plan.batches) if bt.owner == rank]
        dense = [k for k in mine if not is_expert[k]]
        experts = [k for k in mine if is_expert[k]]
        if not dense or not experts:
            continue
        for st in range(built.spec.steps):
            ops = [o for o in q[(rank, "compute")] if o.step == st and o.phase == "opt"]
            by_name = {o.name: o for o in ops}
            adamw = by_name["adamw"]
            d_ops = [by_name[f"batch{k}"] for k in dense]
            e_ops = [by_name[f"batch{k}"] for k in experts]
            order = [o.name for o in ops if o.name.startswith("batch")]
            assert order == [f"batch{k}" for k in dense + experts]
            for o in e_ops:
                assert o.start >= adamw.end and all(o.start >= d.end for d in d_ops), (layout, rank, o.name)
            pubs = {int(o.name.split("/")[2]): o for o in q[(rank, "comm")]
                    if o.coll is not None and o.coll.group.startswith("rep") and o.name.startswith("pub/")
                    and o.name.split("/")[1] == str(st + 1)}
            for k, o in zip(experts, e_ops, strict=True):
                for b in {bucket_of[i] for i in plan.batches[k].members}:
                    assert pubs[b].start >= o.end, (layout, rank, st, b)
            checked += 1
    assert checked
