"""Scenarios the runtime tests run inside spawned gloo ranks, and their single-process references
(helpers only: this module defines no tests; test_runtime.py uses it).

A *case* is a dict (name, optimizer class, options, data scheme); `run_cases(rank, world_size, cases)`
runs them one after the other in one process group (process start-up dominates the test time) and
returns {case name: result or {"error": ...}}. `reference(case, world_size)` trains the same model with
single-device `dmuon.Muon` on the concatenation of every rank's batch: the loss is the mean over ranks
of each rank's loss, which is what averaging the ranks' gradients computes.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

VOCAB, DIM, HIDDEN, SEQ, BATCH = 32, 16, 24, 5, 2


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)  # square
        self.up = nn.Linear(d, h)  # tall (h, d), with a bias (AdamW)
        self.down = nn.Linear(h, d, bias=False)  # wide (d, h): batched with `up` (transposed)

    def forward(self, x):
        return self.down(torch.relu(self.up(torch.tanh(self.attn(x)))))


class TinyNet(nn.Module):
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


class OneMatrix(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, tokens, skip=()):
        x = torch.nn.functional.one_hot(tokens % DIM, DIM).float()
        return self.proj(x).repeat(1, 1, VOCAB // DIM)


class NoMatrix(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, skip=()):
        return self.head(self.embed(tokens))


MODELS = {"tiny": TinyNet, "one": OneMatrix, "none": NoMatrix}


def make_model(case: dict) -> nn.Module:
    torch.manual_seed(1234)
    model = MODELS[case.get("model", "tiny")]()
    for name in case.get("frozen", ()):
        model.get_parameter(name).requires_grad_(False)
    return model


def batch(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, targets


def skipped(case: dict, step: int, rank: int) -> tuple[int, ...]:
    """Blocks a rank leaves out of its forward at a step (scheme 'unused'): block 2 on every rank at
    step 1 (no gradient anywhere), block 1 on rank 0 at steps 2 and 3 (gradient on the others only)."""
    if case.get("scheme") != "unused":
        return ()
    out = []
    if step == 1:
        out.append(2)
    if step in (2, 3) and rank == 0:
        out.append(1)
    return tuple(out)


def loss_of(model, case, step, micro, rank):
    tokens, targets = batch(step, micro, rank)
    logits = model(tokens, skip=skipped(case, step, rank))
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def steps_of(case: dict) -> list[int]:
    return list(case.get("steps", range(5)))


def hparams_of(case: dict) -> dict:
    """The case's hyperparameters as optimizer arguments ("ns": a dict of NSConfig fields)."""
    import dmuon

    out = dict(case.get("hparams", {}))
    if isinstance(out.get("ns"), dict):
        out["ns"] = dmuon.NSConfig(**out["ns"])
    return out


def reference(case: dict, world_size: int) -> dict[str, torch.Tensor]:
    """Single-device Muon on every rank's batch (see the module docstring)."""
    import dmuon

    model = make_model(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = dmuon.Muon(model, **hparams_of(case))
    micro = case.get("micro", 1)
    for s in steps_of(case):
        for m in range(micro):
            loss = sum(loss_of(model, case, s, m, r) for r in range(world_size)) / (world_size * micro)
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def build(case: dict, model):
    from dmuon.distributed import DMuon, NaiveMuon

    cls = {"DMuon": DMuon, "NaiveMuon": NaiveMuon}[case.get("cls", "DMuon")]
    opts = dict(timeout_s=case.get("timeout_s", 60.0), profile=None)
    opts.update(case.get("opts", {}))
    opts.update(hparams_of(case))
    return cls(model, **opts)


def train(case: dict, rank: int, model, opt, steps) -> None:
    micro = case.get("micro", 1)
    for s in steps:
        for m in range(micro):
            ctx = opt.no_sync() if (case.get("no_sync") and m < micro - 1) else _null()
            with ctx:
                (loss_of(model, case, s, m, rank) / micro).backward()
        opt.step()
        opt.zero_grad()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_plain(case: dict, rank: int, world_size: int) -> dict:
    model = make_model(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = build(case, model)
    train(case, rank, model, opt, steps_of(case))
    opt.synchronize()
    out = {"params": params_of(model), "warnings": [str(w.message) for w in caught],
           "momentum_owned": sorted(opt.names[i] for i in range(opt.n_muon)
                                    if "momentum_buffer" in opt.state[opt.params[i]]),
           "owners": dict(zip(opt.names[:opt.n_muon], opt.plan.owners, strict=True)) if opt.plan else {},
           "state_bytes": opt.state_bytes}
    opt.close()
    return out


def run_nonfinite(case: dict, rank: int, world_size: int) -> dict:
    """Steps 0, 1 normal; at step 2 rank 1 (only) gets a NaN gradient in a matrix owned by rank 0;
    then steps 3, 4 normal. Returns the error seen at step 2 ('raise') or the state check ('skip')."""
    model = make_model(case)
    opt = build(case, model)
    train(case, rank, model, opt, [0, 1])
    opt.synchronize()
    target = next(i for i in range(opt.n_muon) if opt.plan.owners[i] == 0)
    name = opt.names[target]
    before = params_of(model)
    state_before = {opt.names[i]: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                    for i, p in enumerate(opt.params) if opt.state.get(p)}
    handle = opt.params[target].register_hook(lambda g: g * float("nan")) if rank == 1 else None
    err = None
    try:
        train(case, rank, model, opt, [2])
    except FloatingPointError as e:
        err = f"{type(e).__name__}: {e}"
        opt.zero_grad()
    if handle is not None:
        handle.remove()
    opt.synchronize()
    after = params_of(model)
    state_after = {opt.names[i]: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                   for i, p in enumerate(opt.params) if opt.state.get(p)}
    unchanged = (all(torch.equal(before[k], after[k]) for k in before)
                 and state_before.keys() == state_after.keys()
                 and all(torch.equal(state_before[n][k], state_after[n][k])
                         for n in state_before for k in state_before[n]))
    skipped_steps = opt.skipped_steps
    train(case, rank, model, opt, [3, 4])
    opt.synchronize()
    opt.close()
    return {"error": err, "name": name, "unchanged": unchanged, "skipped_steps": skipped_steps,
            "params": params_of(model)}


def run_divergence(case: dict, rank: int, world_size: int) -> dict:
    """check_consistency_every=1; after two steps rank 1 perturbs one matrix; the next step must raise."""
    model = make_model(case)
    opt = build(case, model)
    train(case, rank, model, opt, [0, 1])
    opt.synchronize()
    name = opt.names[0]
    if rank == 1:
        with torch.no_grad():
            opt.params[0].view(-1)[3] += 1e-3
    err = None
    try:
        train(case, rank, model, opt, [2])
    except RuntimeError as e:
        err = f"{type(e).__name__}: {e}"
    opt.close()
    return {"error": err, "name": name}


def run_resume(case: dict, rank: int, world_size: int) -> dict:
    """3 steps, save (model + optimizer state), 2 more; a fresh model/optimizer loaded from the save and
    trained the same 2 steps must match bitwise."""
    model = make_model(case)
    opt = build(case, model)
    train(case, rank, model, opt, [0, 1, 2])
    opt.synchronize()  # before a checkpoint (docs/runtime.md): the publications may still be in flight
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    saved_opt = {**saved_opt, "state": {n: {k: (v.clone() if torch.is_tensor(v) else v)
                                            for k, v in st.items()}
                                        for n, st in saved_opt["state"].items()}}
    train(case, rank, model, opt, [3, 4])
    opt.synchronize()
    straight = params_of(model)
    opt.close()
    model2 = make_model(case)
    model2.load_state_dict(saved_model)
    opt2 = build(case, model2)
    opt2.load_state_dict(saved_opt)
    train(case, rank, model2, opt2, [3, 4])
    opt2.synchronize()
    resumed = params_of(model2)
    opt2.close()
    return {"same": all(torch.equal(straight[k], resumed[k]) for k in straight), "params": resumed,
            "owned_state": sorted(saved_opt["state"])}


RUNNERS = {"plain": run_plain, "nonfinite": run_nonfinite, "divergence": run_divergence, "resume": run_resume}


def run_cases(rank: int, world_size: int, cases: list[dict]) -> dict:
    """Every case in turn; a case that raises is reported, the others still run."""
    import traceback

    out = {}
    for case in cases:
        start = time.perf_counter()
        try:
            res = RUNNERS[case.get("runner", "plain")](case, rank, world_size)
        except Exception as e:  # noqa: BLE001 - reported per case to the test
            res = {"failed": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        res["time_s"] = time.perf_counter() - start
        out[case["name"]] = res
    return out


def fail_mid_step(rank: int, world_size: int, timeout_s: float) -> dict:
    """Rank 1 raises between backward and step, and stays alive (no collective, no exit) for twice the
    timeout; the other ranks must fail in step() with a clear error within the timeout."""
    case = {"name": "fail", "timeout_s": timeout_s}
    model = make_model(case)
    opt = build(case, model)
    train(case, rank, model, opt, [0])
    loss_of(model, case, 1, 0, rank).backward()
    if rank == 1:
        try:
            raise RuntimeError("rank 1 fails on purpose")
        except RuntimeError:
            time.sleep(2 * timeout_s)
            raise
    start = time.perf_counter()
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"error_type": type(e).__name__, "error": str(e), "elapsed_s": time.perf_counter() - start}
    return {"error_type": "", "error": "step() returned", "elapsed_s": time.perf_counter() - start}
