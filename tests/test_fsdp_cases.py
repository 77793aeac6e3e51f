"""Scenarios the FSDP2 tests run inside spawned gloo ranks, and their single-process reference (helpers
only: no tests here; test_fsdp.py and test_checkpoint.py use it).

The model has uneven-row matrices (22 rows; 5 rows, which leaves rank 3 of 4 an empty shard), a
float64 block among float32 ones, biases and norms (AdamW, FSDP2-managed), and at step 1 block 1 is
skipped on every rank (no gradient anywhere). The global batch is SLOTS sequences whatever the world
size: rank r of W takes SLOTS / W of them, so runs at different world sizes train on the same data and
the reference is single-device `dmuon.Muon` on all slots.
"""

from __future__ import annotations

import time
import traceback
import warnings

import torch
from torch import nn

VOCAB, DIM, HIDDEN, SMALL, SEQ, SLOTS = 32, 16, 22, 5, 4, 4


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, h)  # 22 rows (uneven over 4 ranks), bias -> AdamW
        self.down = nn.Linear(h, d, bias=False)
        self.small = nn.Linear(d, SMALL, bias=False)  # 5 rows: shards 2, 2, 1, 0 over 4 ranks
        self.back = nn.Linear(SMALL, d, bias=False)
        self.norm = nn.RMSNorm(d)

    def forward(self, x):
        dtype = x.dtype
        x = x.to(self.attn.weight.dtype)
        y = self.down(torch.relu(self.up(torch.tanh(self.attn(self.norm(x))))))
        return (y + self.back(torch.tanh(self.small(x)))).to(dtype)


class Net(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM, HIDDEN) for _ in range(blocks)])
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, skip=()):
        x = self.embed(tokens)
        for i, b in enumerate(self.blocks):
            if i not in skip:
                x = x + b(x)
        return self.head(self.norm(x))


def make_model(case: dict) -> Net:
    torch.manual_seed(4321)
    model = Net()
    if case.get("mixed", True):
        model.blocks[2].to(torch.float64)
    return model


def slot_batch(step: int, slot: int):
    g = torch.Generator().manual_seed(7_000 * step + slot)
    return torch.randint(0, VOCAB, (1, SEQ), generator=g), torch.randint(0, VOCAB, (1, SEQ), generator=g)


def skip_of(case: dict, step: int) -> tuple[int, ...]:
    return (1,) if case.get("unused", True) and step == 1 else ()


def rank_loss(model, case, step: int, rank: int, world: int):
    per = SLOTS // world
    batches = [slot_batch(step, s) for s in range(rank * per, (rank + 1) * per)]
    tokens = torch.cat([t for t, _ in batches])
    targets = torch.cat([y for _, y in batches])
    logits = model(tokens, skip=skip_of(case, step))
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def reference(case: dict, steps) -> dict[str, torch.Tensor]:
    """Single-device Muon on all slots (mean of the per-slot-group losses = the global mean)."""
    import dmuon

    model = make_model(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = dmuon.Muon(model)
    for s in steps:
        rank_loss(model, case, s, 0, 1).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- inside the ranks ---------------------------------------------------------------------------
def setup(case: dict, world: int):
    """(model, optimizer) for a case: layout 'replicated' | 'fsdp2-owner' | 'fsdp2-sharded', cls
    'DMuon' | 'NaiveMuon', opts for the optimizer, hsdp (2 x world/2 mesh), reshard (FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    model = make_model(case)
    layout = case.get("layout", "fsdp2-owner")
    if layout != "replicated":
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
                if case.get("hsdp") else init_device_mesh("cpu", (world,)))
        dmuon.shard_model(model, layout, mesh=mesh, reshard_after_forward=case.get("reshard", True))
    cls = {"DMuon": dmuon.DMuon, "NaiveMuon": dmuon.NaiveMuon}[case.get("cls", "DMuon")]
    opt = cls(model, timeout_s=60.0, profile=None, **case.get("opts", {}))
    return model, opt


def train(model, opt, case, steps, rank: int, world: int, each=None) -> None:
    for s in steps:
        rank_loss(model, case, s, rank, world).backward()
        opt.step()
        opt.zero_grad()
        if each is not None:
            each(s)


def full_params(model, opt) -> dict[str, torch.Tensor]:
    opt.synchronize()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def run_plain(case: dict, rank: int, world: int) -> dict:
    model, opt = setup(case, world)
    peaks = []
    res = getattr(opt, "_residency", None)
    if res is not None:  # resident non-owned bytes seen at each Linear's forward, after DMuon's hooks
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(lambda *a: peaks.append(res.resident_bytes))
    after, kept = [], {}  # kept: each momentum buffer after step 1 (held, so no address is reused)

    def each(s):
        after.append(res.resident_bytes if res is not None else -1)
        if s == 1:
            kept.update({i: opt.state[opt.params[i]]["momentum_buffer"] for i in range(opt.n_muon)
                         if "momentum_buffer" in opt.state[opt.params[i]]})
    train(model, opt, case, range(5), rank, world, each=each)
    out = {"params": full_params(model, opt), "peaks": peaks, "after_step": after,
           "owners": list(opt.plan.owners), "names": opt.names[:opt.n_muon], "layout": opt.layout,
           "cls": type(opt).__name__, "ns_matrices": getattr(opt, "ns_matrices", -1),
           "momentum": sorted(opt.names[i] for i in range(opt.n_muon)
                              if "momentum_buffer" in opt.state[opt.params[i]]),
           "momentum_kept": [opt.state[opt.params[i]]["momentum_buffer"] is buf for i, buf in kept.items()],
           "unit_bytes": ([sum(p.numel() * p.element_size() for p in s.params) for s in res.units]
                          if res is not None else [])}
    opt.close()
    return out


def run_bytes(case: dict, rank: int, world: int) -> dict:
    """Two steps, then one step (forward, backward, step) with the byte counter on every thread."""
    from dmuon.runtime.bytecount import CollectiveBytes

    model, opt = setup(case, world)
    train(model, opt, case, [0, 2], rank, world)
    opt.synchronize_exchanges()
    counter = CollectiveBytes()
    for w in (opt._worker, opt._pub_worker):
        if w is not None:
            w.counter = counter
    with counter.active():
        train(model, opt, case, [3], rank, world)
        opt.synchronize_exchanges()
    for w in (opt._worker, opt._pub_worker):
        if w is not None:
            w.counter = None
    # per FSDP2 module: (reshards in backward, [(padded numel, itemsize, is a Muon matrix)])
    from torch.distributed.fsdp import FSDPModule

    fsdp_groups, seen = [], set()
    muon_ids = {id(opt.params[i]) for i in range(opt.n_muon)}
    for m in reversed(list(model.modules())):  # deepest first: a parent manages what is left
        if isinstance(m, FSDPModule):
            params = [p for p in m.parameters() if hasattr(p, "device_mesh") and id(p) not in seen]
            seen |= {id(p) for p in params}
            n = params[0].device_mesh.size(-1) if params else 1
            sizes = [(-(-p.shape[0] // n) * n * (p.numel() // p.shape[0]), p.element_size(),
                      id(p) in muon_ids) for p in params]
            fsdp_groups.append((case.get("reshard", True), sizes))  # the root too (explicit setting)
    owners = list(opt.plan.owners)
    muon = [(tuple(opt.params[i].shape), opt.params[i].element_size()) for i in range(opt.n_muon)]
    out = {"summary": counter.summary(), "fsdp_groups": fsdp_groups, "owners": owners, "muon": muon,
           "n_params": len(opt.params)}
    opt.close()
    return out


def run_checkpoint(case: dict, rank: int, world: int) -> dict:
    """Train steps 0-2, save (DCP) into case['dir'], train 3-4; then a fresh model and optimizer load
    the checkpoint and train 3-4 again. Returns both end states."""
    import torch.distributed as dist

    import dmuon

    model, opt = setup(case, world)
    train(model, opt, case, [0, 1, 2], rank, world)
    dmuon.save_checkpoint(case["dir"], model, opt)
    dist.barrier()
    train(model, opt, case, [3, 4], rank, world)
    straight = full_params(model, opt)
    opt.close()
    model2, opt2 = setup(case, world)
    dmuon.load_checkpoint(case["dir"], model2, opt2)
    train(model2, opt2, case, [3, 4], rank, world)
    resumed = full_params(model2, opt2)
    opt2.close()
    return {"straight": straight, "resumed": resumed}


def run_resume(case: dict, rank: int, world: int) -> dict:
    """Load a checkpoint written at another world size (case['dir']) and train steps 3-4."""
    import dmuon

    model, opt = setup(case, world)
    dmuon.load_checkpoint(case["dir"], model, opt)
    loaded_momentum = sorted(opt.names[i] for i in range(opt.n_muon)
                             if "momentum_buffer" in opt.state[opt.params[i]])
    train(model, opt, case, [3, 4], rank, world)
    out = {"params": full_params(model, opt), "loaded_momentum": loaded_momentum,
           "owners": list(opt.plan.owners), "muon_names": opt.names[:opt.n_muon]}
    opt.close()
    return out


def run_bad_load(case: dict, rank: int, world: int) -> dict:
    """Loading from a directory that holds no checkpoint, and the checkpoint's own metadata keys."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    import dmuon

    model, opt = setup(case, world)
    try:
        dmuon.load_checkpoint(tempfile.mkdtemp(), model, opt)
        err = ""
    except Exception as e:  # noqa: BLE001 - the test reads the message
        err = f"{type(e).__name__}: {e}"
    opt.close()
    meta = dcp.FileSystemReader(case["dir"]).read_metadata().state_dict_metadata
    return {"error": err, "keys": sorted(meta)}


def nonfinite_round(model, opt, case: dict, rank: int, world: int) -> tuple[str, bool]:
    """Steps 0, 1; at step 2 rank 1 (only) gets a NaN in blocks.0.up's gradient: step() must raise on
    every rank and change nothing; then steps 3, 4 train normally. Returns (error text, unchanged)."""
    from dmuon.runtime.guards import NonFiniteGradientError

    train(model, opt, case, [0, 1], rank, world)
    before = full_params(model, opt)
    # through the module's output gradient: FSDP2 computes with an unsharded copy of the weight
    def poison(module, args, output):
        output.register_hook(lambda g: g * float("nan"))

    handle = model.blocks[0].up.register_forward_hook(poison) if rank == 1 else None
    err = ""
    try:
        train(model, opt, case, [2], rank, world)
    except NonFiniteGradientError as e:
        err = str(e)
        opt.zero_grad()
    if handle is not None:
        handle.remove()
    after = full_params(model, opt)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    train(model, opt, case, [3, 4], rank, world)
    return err, unchanged


def run_nonfinite(case: dict, rank: int, world: int) -> dict:
    """`nonfinite_round` on the case's set-up."""
    model, opt = setup(case, world)
    err, unchanged = nonfinite_round(model, opt, case, rank, world)
    out = {"error": err, "unchanged": unchanged, "params": full_params(model, opt)}
    opt.close()
    return out


def catcher(out: dict):
    """catch(key, fn): out[key] = "" if fn() runs, else "ErrorType: message" (the tests read it)."""
    def catch(key, fn):
        try:
            fn()
            out[key] = ""
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out[key] = f"{type(e).__name__}: {e}"
    return catch


def run_errors(case: dict, rank: int, world: int) -> dict:
    """Bad set-ups: their error messages."""
    import dmuon

    out = {}
    catch = catcher(out)

    plain = make_model({})
    catch("layout_mismatch", lambda: dmuon.DMuon(plain, layout="fsdp2-owner", profile=None))
    catch("free_replicated", lambda: dmuon.DMuon(make_model({}), memory="free", profile=None))
    catch("bad_memory", lambda: dmuon.DMuon(make_model({}), memory="spill", profile=None))
    catch("free_checksums", lambda: setup({"opts": {"memory": "free", "check_consistency_every": 1}}, world))
    model, opt = setup({"layout": "fsdp2-owner"}, world)

    def twice():
        for _ in range(2):
            rank_loss(model, {}, 0, rank, world).backward()

    catch("two_exchanges", twice)
    opt.close()
    return out


def run_wire_returns(case: dict, rank: int, world: int) -> dict:
    """run_plain with ShardedDMuon's updates travelling in the wire's dtype, never the NS iteration's (as
    before the narrowing; `sharded_layout.lossless_narrower` answers False while it runs)."""
    import dmuon.runtime.sharded_layout as sl

    real = sl.lossless_narrower
    sl.lossless_narrower = lambda narrow, wide: False
    try:
        return run_plain(case, rank, world)
    finally:
        sl.lossless_narrower = real


RUNNERS = {"plain": run_plain, "bytes": run_bytes, "checkpoint": run_checkpoint, "resume": run_resume,
           "errors": run_errors, "bad_load": run_bad_load, "nonfinite": run_nonfinite,
           "wire_returns": run_wire_returns}


def run_cases(rank: int, world: int, cases: list[dict], runners: dict | None = None) -> dict:
    """Every case through its runner (`runners`, default this module's RUNNERS); a failure is reported
    per case, with its traceback, and every case is timed."""
    runners = RUNNERS if runners is None else runners
    out = {}
    for case in cases:
        start = time.perf_counter()
        try:
            res = runners[case.get("runner", "plain")](case, rank, world)
        except Exception as e:  # noqa: BLE001 - reported per case to the test
            res = {"failed": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        res["time_s"] = time.perf_counter() - start
        out[case["name"]] = res
    return out
