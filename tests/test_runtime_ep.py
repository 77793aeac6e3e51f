"""DMuon with expert parallelism (`DMuon(model, ep=E)`, dmuon/runtime/ep.py) on gloo ranks: a tiny MoE whose
experts are 3-D parameters (E_local, out, in), trained by real forward and backward passes, with its dense
parameters replicated, under FSDP2 (fsdp2-owner keep / free, fsdp2-sharded) and on an HSDP mesh, gives
single-process Muon's weights (every expert its own matrix; dense gradients averaged over all ranks,
expert gradients over their replica group) over several steps; the per-rank state dict resumes a run,
and so does a sharded checkpoint at another ep and world size; bad set-ups fail with one-line errors
naming what is accepted.

Every case runs in one spawn per rank count (`_battery`: 4 ranks, then 2), each case with its own model,
optimizer and process sub-groups: a process start and the first step's imports cost seconds, a case a
fraction of one; a case that raises is reported by its own test."""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
from dist_utils import run_distributed, scratch_dir
from torch import nn

E, HID, INTER, LAYERS, VOCAB, SEQ, STEPS = 8, 16, 24, 2, 32, 6, 3
TOL = 1e-5


class Experts(nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.w_up = nn.Parameter(torch.randn(count, INTER, HID) * 0.3)
        self.w_down = nn.Parameter(torch.randn(count, HID, INTER) * 0.3)

    def forward(self, x, gate, lo: int, count: int):  # the experts lo .. lo + count - 1 of this parameter
        h = torch.relu(torch.einsum("td,eid->tei", x, self.w_up[lo:lo + count]))
        return (torch.einsum("tei,edi->ted", h, self.w_down[lo:lo + count]) * gate.unsqueeze(-1)).sum(1)


class FusedExperts(nn.Module):
    """transformers 5's layout: gate and up of each expert fused in one (count, 2 INTER, HID) parameter."""

    def __init__(self, count: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(count, 2 * INTER, HID) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(count, HID, INTER) * 0.3)

    def forward(self, x, gate, lo: int, count: int):
        gu = torch.einsum("td,eid->tei", x, self.gate_up_proj[lo:lo + count])
        h = torch.relu(gu[..., :INTER]) * gu[..., INTER:]
        return (torch.einsum("tei,edi->ted", h, self.down_proj[lo:lo + count]) * gate.unsqueeze(-1)).sum(1)


class Layer(nn.Module):
    def __init__(self, count: int, fused: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(HID)
        self.q = nn.Linear(HID, HID, bias=False)
        self.router = nn.Linear(HID, E, bias=False)
        self.mlp = nn.Module()
        self.mlp.experts = (FusedExperts if fused else Experts)(count)

    def forward(self, x, first: int, lo: int, count: int):
        h = self.norm(x)
        gate = torch.softmax(self.router(h), -1)[:, first:first + count]
        return x + self.q(h) + self.mlp.experts(h, gate, lo, count)


class TinyMoE(nn.Module):
    """`count` experts per layer; forward runs the global experts first .. first + count_used - 1, stored
    at lo .. of its expert parameters (the EP rank's own: lo = 0; the full reference model: lo = first)."""

    def __init__(self, count: int, fused: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HID)
        self.layers = nn.ModuleList(Layer(count, fused) for _ in range(LAYERS))
        self.probe = None  # called when backward reaches the embedding's output (every layer's is done)

    def forward(self, tokens, first: int, lo: int, count: int):
        x = self.embed(tokens)
        if self.probe is not None:
            x.register_hook(lambda g: self.probe())
        for layer in self.layers:
            x = layer(x, first, lo, count)
        return x.pow(2).mean()


def full_model(fused: bool = False) -> TinyMoE:
    torch.manual_seed(1234)
    return TinyMoE(E, fused)


def tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 * step + rank))


def local_model(k: int, e_local: int, fused: bool = False) -> TinyMoE:
    """EP rank k's model: the full model's dense parameters, its experts k E_local .. (k + 1) E_local - 1."""
    full, model = full_model(fused), TinyMoE(e_local, fused)
    with torch.no_grad():
        for p, q in zip(model.parameters(), full.parameters(), strict=True):
            p.copy_(q[k * e_local:(k + 1) * e_local] if p.dim() == 3 else q)
    return model


def setup(rank: int, world: int, ep: int, case: dict):
    import dmuon

    e_local, k = E // ep, rank % ep
    model = local_model(k, e_local, case.get("fused", False))
    layout = case.get("layout", "replicated")
    if layout != "replicated":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
                if case.get("hsdp") else init_device_mesh("cpu", (world,)))
        dmuon.shard_model(model, layout, mesh=mesh, ep=ep)
    cls = dmuon.NaiveMuon if case.get("naive") else dmuon.DMuon
    opt = cls(model, ep=ep, lr=0.05, weight_decay=0.01, profile="a800", timeout_s=60.0,
                      **case.get("opts", {}))
    return model, opt


def train_step(model, opt, step: int, rank: int, ep: int, counter=None, accumulate: bool = False) -> None:
    """accumulate: two backward passes of half the loss, the first inside no_sync() (the same gradient)."""
    import contextlib

    e_local = E // ep
    loss = model(tokens(step, rank), (rank % ep) * e_local, 0, e_local)
    if accumulate:
        with opt.no_sync():
            (loss / 2).backward(retain_graph=True)
        loss = loss / 2
    loss.backward()
    with counter.active() if counter is not None else contextlib.nullcontext():  # this thread's collectives
        opt.step()
    opt.zero_grad()


def probed_step(model, opt, step: int, rank: int, ep: int, counter, accumulate: bool = False) -> list[int]:
    """train_step counting the collectives of step() on the training thread and of the experts'
    communication thread; returns, per backward pass, how many expert buckets had their gradient exchange
    launched when it reached the first layer's input (before its end)."""
    opt.synchronize()  # the last step's publications are not counted
    units = getattr(opt.experts, "units", ())  # an exchange at step() only would have no units: 0 launched
    old = [u.reduce_handle for u in units]  # kept alive: their ids are not reused
    launched = []
    model.probe = lambda: launched.append(sum(u.reduce_handle is not None and u.reduce_handle not in old
                                              for u in units))
    worker = getattr(opt.experts, "worker", None)  # None where the replica group is one rank
    if worker is not None:
        worker.counter = counter
    train_step(model, opt, step, rank, ep, counter, accumulate)
    opt.synchronize()
    if worker is not None:
        worker.counter = None
    model.probe = None
    return launched


def weights(model, opt) -> dict[str, torch.Tensor]:
    opt.synchronize()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def run_case(rank: int, world: int, ep: int, case: dict) -> dict:
    model, opt = setup(rank, world, ep, case)
    out = {"layout": opt.layout, "plan_ep": opt.ep_plan.ep, "owned": sum(
        1 for j, o in enumerate(opt.ep_plan.owners) if o == rank and j >= opt.experts.n_dense)}
    for s in range(STEPS - 1):
        train_step(model, opt, s, rank, ep)
    if case.get("resume"):  # a fresh model and optimizer from the per-rank state dicts take the last step
        opt.synchronize()  # before a checkpoint (docs/runtime.md): the publications may still be in flight
        msd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        osd = opt.state_dict()
        model2, opt2 = setup(rank, world, ep, case)
        model2.load_state_dict(msd)
        opt2.load_state_dict(osd)
        train_step(model2, opt2, STEPS - 1, rank, ep)
        out["resumed"] = weights(model2, opt2)
    from dmuon.runtime.bytecount import CollectiveBytes

    counter = CollectiveBytes()
    out["launched"] = probed_step(model, opt, STEPS - 1, rank, ep, counter, case.get("accumulate", False))
    out["units"] = len(getattr(opt.experts, "units", ()))
    out["weights"] = weights(model, opt)
    # the expert exchange: reduces to / broadcasts from the owners of the replica group (world / ep ranks),
    # on the experts' communication thread ("dmuon"); step() on the training thread ("main") issues none
    out["expert_colls"] = {(kind, lab): [r.payload_bytes for r in counter.records
                                         if r.kind == kind and r.group_size == world // ep and r.label == lab]
                           for kind in ("reduce", "broadcast") for lab in ("main", "dmuon")}
    out["owners"] = [len({m.owner for m in u.members}) for u in getattr(opt.experts, "units", ())]
    experts = [p for p in model.parameters() if p.dim() == 3]
    out["expert_bytes"] = sum(p.numel() * p.element_size() for p in experts)
    out["momentum_rows"] = sum(opt.state[p]["momentum_buffer"].shape[0] for p in experts
                               if "momentum_buffer" in opt.state[p])
    opt.close()
    return out


def _blocks(name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """One expert slice's matrices: a fused gate / up is two (rows [0, INTER) and [INTER, 2 INTER))."""
    return [t[:INTER], t[INTER:]] if name.endswith("gate_up_proj") else [t]


def reference(world: int, ep: int, schedule=None, fused: bool = False) -> dict[str, torch.Tensor]:
    """Single-process Muon: every expert matrix its own (a fused gate / up two); the dense gradient is the
    mean over the ranks' losses, an expert's the mean over its replica group's (the ranks whose EP rank holds
    it). schedule: (world, ep) of each step (default: (world, ep) for all STEPS)."""
    import dmuon

    schedule = schedule or [(world, ep)] * STEPS
    model = full_model(fused)
    params = dict(model.named_parameters())
    routes = {r.name: r.use_muon for r in dmuon.route(model)}
    experts = {n: [nn.Parameter(b.detach().clone()) for e in range(E) for b in _blocks(n, p[e])]
               for n, p in params.items() if p.dim() == 3}
    muon = [(n, p) for n, p in params.items() if p.dim() != 3 and routes[n]]
    muon += [(f"{n}.{e}", t) for n, ts in experts.items() for e, t in enumerate(ts)]
    adamw = [(n, p) for n, p in params.items() if p.dim() != 3 and not routes[n]]
    opt = dmuon.Muon([{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}], lr=0.05,
                     weight_decay=0.01)
    for step, (world, ep) in enumerate(schedule):
        e_local, replicas = E // ep, world // ep
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        for r in range(world):
            first = (r % ep) * e_local
            gs = torch.autograd.grad(model(tokens(step, r), first, first, e_local), list(params.values()))
            for (n, p), g in zip(params.items(), gs, strict=True):
                grads[n] += g / (replicas if p.dim() == 3 else world)
        for n, p in params.items():
            if p.dim() == 3:
                gs = [b for e in range(E) for b in _blocks(n, grads[n][e])]
                for t, g in zip(experts[n], gs, strict=True):
                    t.grad = g.clone()
            else:
                p.grad = grads[n]
        opt.step()
        with torch.no_grad():
            for n, ts in experts.items():
                params[n].copy_(torch.cat([t.detach() for t in ts]).view(params[n].shape))
    return {n: p.detach().clone() for n, p in params.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def worst_error(got: dict, want: dict, rank: int, ep: int) -> float:
    e_local, k = E // ep, rank % ep
    return max(rel(g, want[n][k * e_local:(k + 1) * e_local] if g.dim() == 3 else want[n])
               for n, g in got.items())


CASES = [  # (world, ep, case)
    (2, 2, {"layout": "replicated", "resume": True}),
    (2, 2, {"layout": "fsdp2-owner", "resume": True}),
    (4, 2, {"layout": "fsdp2-owner", "opts": {"memory": "free"}}),
    (4, 4, {"layout": "fsdp2-sharded"}),
    (4, 2, {"layout": "fsdp2-sharded", "hsdp": True, "resume": True}),
    (4, 2, {"layout": "fsdp2-owner", "hsdp": True}),
    (4, 2, {"layout": "fsdp2-owner", "opts": {"comm_dtype": "bf16"}, "tol": 5e-2}),  # bf16 on the wire
    (4, 2, {"layout": "replicated", "accumulate": True}),  # the last step's gradient in two halves
    (4, 2, {"layout": "fsdp2-owner", "fused": True}),  # a fused gate / up expert parameter: 2 matrices each
]


def case_id(world: int, ep: int, case: dict) -> str:
    extra = ["hsdp"] * bool(case.get("hsdp")) + ["fused"] * bool(case.get("fused")) + [
        f"{k}={v}" for k, v in case.get("opts", {}).items()]
    return "-".join([f"{world}r", f"ep{ep}", case["layout"], *extra])


@pytest.mark.parametrize("world,ep,case", CASES, ids=[case_id(*c) for c in CASES])
def test_dmuon_ep_equals_single_process_muon(world, ep, case):
    results = _results(world, ("case", CASES.index((world, ep, case))))
    want = reference(world, ep, fused=case.get("fused", False))
    for rank, res in enumerate(results):
        assert res["layout"] == case["layout"] and res["plan_ep"] == ep
        assert worst_error(res["weights"], want, rank, ep) < case.get("tol", TOL), (rank, case)
        if case.get("resume"):  # resuming from the state dicts is the uninterrupted run
            assert max(rel(res["resumed"][n], w) for n, w in res["weights"].items()) < 1e-6
    # every expert matrix of every layer has exactly one owner, which alone holds its momentum
    assert sum(r["owned"] for r in results) == LAYERS * (3 if case.get("fused") else 2) * E
    assert [r["momentum_rows"] for r in results] == [r["owned"] for r in results]
    for r in results:  # per bucket one reduce and one broadcast per owner, together all the rank's experts
        colls = r["expert_colls"]
        assert colls["reduce", "main"] == colls["broadcast", "main"] == []  # not from step() itself
        # every bucket's exchange was launched from backward's hooks, before backward ended (none from the
        # backward inside no_sync())
        assert r["units"] == (LAYERS if world // ep > 1 else 0)
        assert r["launched"] == [0] * bool(case.get("accumulate")) + [r["units"]]
        if world // ep == 1:
            assert colls["reduce", "dmuon"] == colls["broadcast", "dmuon"] == []
        else:
            assert len(colls["reduce", "dmuon"]) == len(colls["broadcast", "dmuon"]) == sum(r["owners"])
            assert all(1 <= n <= world // ep for n in r["owners"])
            wire = 2 / 4 if case.get("opts", {}).get("comm_dtype") == "bf16" else 1  # gradients in bf16
            assert sum(colls["reduce", "dmuon"]) == wire * r["expert_bytes"]
            assert sum(colls["broadcast", "dmuon"]) == r["expert_bytes"]


def run_checkpoint(rank: int, world: int, ep: int, case: dict, path: str, save: bool) -> dict:
    """save: steps 0, 1, a sharded checkpoint, step 2; else: load the checkpoint, step 2."""
    import dmuon

    model, opt = setup(rank, world, ep, case)
    if save:
        for s in range(STEPS - 1):
            train_step(model, opt, s, rank, ep)
        dmuon.save_checkpoint(path, model, opt)
    else:
        dmuon.load_checkpoint(path, model, opt)
    train_step(model, opt, STEPS - 1, rank, ep)
    out = weights(model, opt)
    opt.close()
    return out


def test_sharded_checkpoint_resumes_at_any_ep_and_world_size():
    """Saved on 4 ranks (ep 2, fsdp2-owner): the same set-up resumes bitwise; 2 ranks (ep 2,
    fsdp2-sharded) and 4 ranks with ep 4 (replicated dense parameters) resume as single-process Muon does
    with the same schedule of ranks (experts re-sharded by DCP, momentum following each expert to its
    new owner)."""
    saved, same = _results(4, "ckpt_save"), _results(4, "ckpt_same")  # same: a fresh model and optimizer
    for a, b in zip(saved, same, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    for world, ep, layout in ((2, 2, "fsdp2-sharded"), (4, 4, "replicated")):
        got = _results(world, f"ckpt_{world}r_ep{ep}_{layout}")
        want = reference(world, ep, [(4, 2)] * (STEPS - 1) + [(world, ep)])
        for rank, res in enumerate(got):
            assert worst_error(res, want, rank, ep) < TOL, (world, ep, rank)


def run_errors(rank: int, world: int) -> dict:
    import dmuon
    from dmuon.errors import InputError
    from dmuon.runtime.guards import NonFiniteGradientError

    errs = {}

    def attempt(key, fn):
        try:
            fn()
        except InputError as e:
            errs[key] = str(e)

    attempt("ep_not_divisor", lambda: dmuon.DMuon(local_model(0, E // 2), ep=3, profile="a800"))
    attempt("ep_not_int", lambda: dmuon.DMuon(local_model(0, E // 2), ep=0, profile="a800"))
    attempt("naive", lambda: dmuon.NaiveMuon(local_model(rank % 2, E // 2), ep=2,
                                             process_group=torch.distributed.group.WORLD))
    attempt("dense", lambda: dmuon.DMuon(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ep=2,
                                         profile="a800"))
    attempt("split", lambda: dmuon.DMuon(local_model(rank % 2, E // 2), ep=2, max_split=2, profile="a800"))
    sharded = dmuon.shard_model(local_model(rank % 2, E // 2), "fsdp2-sharded")  # experts sharded too
    attempt("experts_sharded", lambda: dmuon.DMuon(sharded, ep=2, profile="a800"))
    # a NaN in one rank's expert gradient stops the step on every rank, nothing updated
    model, opt = setup(rank, world, 2, {"layout": "fsdp2-owner"})
    before = weights(model, opt)
    model(tokens(0, rank), (rank % 2) * (E // 2), 0, E // 2).backward()
    if rank == 1:
        model.layers[1].mlp.experts.w_down.grad[0, 0, 0] = float("nan")
    try:
        opt.step()
    except NonFiniteGradientError as e:
        errs["nonfinite"] = str(e)
    after = weights(model, opt)
    errs["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    opt.close()
    return errs


def test_bad_setups_say_what_is_accepted():
    results = _results(2, "errors")
    errs = results[0]
    assert "does not divide the 2 ranks; accepted: a divisor of the rank count" in errs["ep_not_divisor"]
    assert "ep must be an integer >= 1" in errs["ep_not_int"]
    assert "accepted: process_group=None with ep > 1" in errs["naive"]
    assert "no expert parameters" in errs["dense"] and "accepted: ep=1" in errs["dense"]
    assert "max_split is not supported with expert parallelism" in errs["split"]
    assert "ignored_params" in errs["experts_sharded"] and "shard_model(model, layout, ep=E)" in \
        errs["experts_sharded"]
    assert all("\n" not in m for k, m in errs.items() if k not in ("nonfinite", "unchanged"))
    for errs in results:  # every rank names the expert parameter and updates nothing
        assert "layers.1.mlp.experts.w_down" in errs["nonfinite"] and errs["unchanged"] is True


def run_naive(rank: int, world: int, ep: int, case: dict) -> dict:
    """NaiveMuon with EP: STEPS steps, the last one's collectives counted (probed_step)."""
    from dmuon.runtime.bytecount import CollectiveBytes

    model, opt = setup(rank, world, ep, {**case, "naive": True})
    for s in range(STEPS - 1):
        train_step(model, opt, s, rank, ep)
    counter = CollectiveBytes()
    launched = probed_step(model, opt, STEPS - 1, rank, ep, counter)
    experts = [p for p in model.parameters() if p.dim() == 3]
    colls = {(kind, lab): [r.payload_bytes for r in counter.records
                           if r.kind == kind and r.label == lab and r.group_size == world // ep]
             for kind in ("all_reduce", "reduce", "broadcast") for lab in ("main", "dmuon")}
    return {"layout": opt.layout, "ep_plan": opt.ep_plan, "launched": launched, "colls": colls,
            "units": len(opt.experts.units), "weights": weights(model, opt),
            "expert_bytes": sum(p.numel() * p.element_size() for p in experts),
            "momentum": [tuple(opt.state[p]["momentum_buffer"].shape) == tuple(p.shape) for p in experts]}


NAIVE_CASES = [(2, 2, {"layout": "replicated"}), (4, 2, {"layout": "replicated"}),
               (2, 2, {"layout": "fsdp2-sharded", "fused": True}),
               (4, 2, {"layout": "fsdp2-owner"}), (4, 2, {"layout": "fsdp2-sharded"}),
               (4, 2, {"layout": "fsdp2-owner", "hsdp": True}),
               (4, 2, {"layout": "fsdp2-sharded", "hsdp": True})]


@pytest.mark.parametrize("world,ep,case", NAIVE_CASES, ids=[case_id(*c) for c in NAIVE_CASES])
def test_naive_muon_ep_equals_single_process_muon(world, ep, case):
    """NaiveMuon(ep=2): each replica group all-reduces its experts' gradients (one all-reduce per layer,
    launched from backward), every rank runs momentum and NS on all of its local experts."""
    results = _results(world, ("naive", NAIVE_CASES.index((world, ep, case))))
    want = reference(world, ep, fused=case.get("fused", False))
    for rank, res in enumerate(results):
        assert res["layout"] == case["layout"] and res["ep_plan"] is None
        assert worst_error(res["weights"], want, rank, ep) < TOL, (rank, case)
        assert res["momentum"] and all(res["momentum"])  # every local expert's momentum, on every rank
        colls = res["colls"]
        assert colls["reduce", "dmuon"] == colls["broadcast", "dmuon"] == colls["all_reduce", "main"] == []
        if world // ep == 1:
            assert res["units"] == 0 and colls["all_reduce", "dmuon"] == []
        else:  # one all-reduce per layer over the replica group, launched before backward ended
            assert res["units"] == LAYERS and res["launched"] == [LAYERS]
            assert len(colls["all_reduce", "dmuon"]) == LAYERS
            assert sum(colls["all_reduce", "dmuon"]) >= res["expert_bytes"]  # padded to the group size


def test_naive_sharded_checkpoint_resumes_at_another_ep_and_layout():
    """NaiveMuon(ep=2) saved on 4 ranks (replicated): the same set-up resumes bitwise, 2 ranks (ep 2,
    fsdp2-sharded) as single-process Muon does with the same schedule of ranks (every rank's momentum of
    its local experts, whole)."""
    saved, same = _results(4, "naive_ckpt_save"), _results(4, "naive_ckpt_same")
    for a, b in zip(saved, same, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    got = _results(2, "naive_ckpt_2r")
    want = reference(2, 2, [(4, 2)] * (STEPS - 1) + [(2, 2)])
    for rank, res in enumerate(got):
        assert worst_error(res, want, rank, 2) < TOL, rank


# ---- one spawn per rank count runs every case (the module docstring) ---------------------------------
RUNNERS = {"case": run_case, "naive": run_naive, "ckpt": run_checkpoint, "errors": run_errors}


def jobs(world: int, ckpt: str, naive_ckpt: str) -> list:
    """(key, runner, args) in order: the 4-rank battery saves both checkpoints (and reloads them), the 2-rank
    one loads them at another world size; run_errors (a NaN step) goes last."""
    out = [(("case", i), "case", (ep, c)) for i, (w, ep, c) in enumerate(CASES) if w == world]
    out += [(("naive", i), "naive", (ep, c)) for i, (w, ep, c) in enumerate(NAIVE_CASES) if w == world]
    owner, naive = {"layout": "fsdp2-owner"}, {"layout": "replicated", "naive": True}
    sharded, naive_sharded = {"layout": "fsdp2-sharded"}, {"layout": "fsdp2-sharded", "naive": True}
    if world == 4:
        return out + [("ckpt_save", "ckpt", (2, owner, ckpt, True)),
                      ("ckpt_same", "ckpt", (2, owner, ckpt, False)),
                      ("ckpt_4r_ep4_replicated", "ckpt", (4, {"layout": "replicated"}, ckpt, False)),
                      ("naive_ckpt_save", "ckpt", (2, naive, naive_ckpt, True)),
                      ("naive_ckpt_same", "ckpt", (2, naive, naive_ckpt, False))]
    return out + [("ckpt_2r_ep2_fsdp2-sharded", "ckpt", (2, sharded, ckpt, False)),
                  ("naive_ckpt_2r", "ckpt", (2, naive_sharded, naive_ckpt, False)), ("errors", "errors", ())]


def run_battery(rank: int, world: int, todo: list) -> dict:
    out = {}
    for key, runner, args in todo:
        try:
            out[key] = RUNNERS[runner](rank, world, *args)
        except Exception:  # noqa: BLE001 - reported by the case's own test
            out[key] = {"failed": traceback.format_exc()}
    return out


@functools.cache
def _checkpoints() -> tuple[str, str]:
    return scratch_dir("dmuon-ep-ckpt-"), scratch_dir("dmuon-naive-ep-ckpt-")


@functools.cache
def _battery(world: int) -> tuple:
    if world == 2:
        _battery(4)  # writes the checkpoints the 2-rank battery loads
    return tuple(run_distributed(run_battery, world, (jobs(world, *_checkpoints()),), timeout_s=300))


def _results(world: int, key) -> list:
    per_rank = [r[key] for r in _battery(world)]
    for rank, res in enumerate(per_rank):
        assert not (isinstance(res, dict) and "failed" in res), f"{key} rank {rank}: {res['failed']}"
    return per_rank
