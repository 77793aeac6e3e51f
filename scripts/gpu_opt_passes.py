"""Do DMuon's optimizer passes pay the simulator's ~8 ms elementwise intercept? One GPU, one command.

The simulator prices every elementwise pass (AdamW, Muon momentum) with the a800 cost table, whose
AdamW rows are the four published 8 x A800 FSDP2 + torch.optim.AdamW optimizer times: their fit has a
~7.85 ms per-call intercept (docs/simulator.md, issue 17). This script times, on one device, a
Qwen-shaped model (the workload's matrices, plus Qwen2's q/k/v biases and RMSNorm scales) wrapped with
FSDP2 `fully_shard` on a world of 1, after one forward/backward:
  (a) torch.optim.AdamW(foreach=True) and (fused=True) over the FSDP2 (DTensor) parameters: the path the
      published rows ran;
  (b) DMuon (layout fsdp2-owner) as the runtime runs it: its momentum pass over the owner stacks
      (`DMuon._speculate` with the NS call replaced by the identity), momentum + NS, its AdamW pass over the
      FSDP2 shards (`_adamw_update`), and the whole `step()` with and without NS;
  (c) the same elementwise work on plain tensors: one tensor of the same total size, and as many tensors
      as the pass has (views of one flat buffer, as FSDP2's shards are): per-call and per-tensor host
      costs apart from the bandwidth term;
and prices each pass with the simulator's own function (`simulator.setup.profile_pricer`, default
profile a800) for the same element and tensor counts. Device time is CUDA events (median over
--repeats after --warmup, synchronized around each); host_ms is the wall time of the same calls.
Writes <prefix>_opt_passes.csv and .md (atomically) to --out, else $OUT, else results/gpu/, and prints
the verdict: a pass "pays the intercept" when it takes at least half the table's intercept longer than
the same elements in one plain tensor.

GPU (one H200: < 3 min; each part under --step-timeout s):
    PYTHONPATH=. python scripts/gpu_opt_passes.py
CPU dry run (gloo, tiny shapes, no verdict worth reading):
    PYTHONPATH=. .venv/bin/python scripts/gpu_opt_passes.py --cpu --scale 32 --tokens 16 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import platform
import signal
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLUMNS = ("pass", "group", "op", "elements", "tensors", "measured_ms", "host_ms", "predicted_ms", "note")
# each pass of (a) / (b) against the plain one-tensor pass of the same elements (the verdict)
PASSES = ("fsdp2_torch_adamw_foreach", "fsdp2_torch_adamw_fused", "dmuon_momentum", "dmuon_momentum_batch",
          "dmuon_momentum_ns", "dmuon_adamw", "dmuon_step_no_ns", "dmuon_step", "plain_adamw_fused_1",
          "plain_adamw_fused_k", "plain_adamw_all_fused_1", "plain_adamw_all_fused_k", "plain_momentum_1",
          "plain_momentum_k", "plain_momentum_batch_1", "plain_momentum_batch_k",
          "plain_torch_adamw_foreach_1", "plain_torch_adamw_foreach_k")  # the CSV's rows, in order
BASELINES = {"fsdp2_torch_adamw_foreach": "plain_torch_adamw_foreach_1",
             "fsdp2_torch_adamw_fused": "plain_adamw_all_fused_1",
             "dmuon_momentum": "plain_momentum_1", "dmuon_momentum_batch": "plain_momentum_batch_1",
             "dmuon_adamw": "plain_adamw_fused_1"}


# ---- the model ---------------------------------------------------------------------------------------
def qwen_dims(workload: str, scale: int) -> dict:
    """hidden, kv, inter, vocab, blocks and the head's tying of a Qwen/Llama-shaped workload of
    simulator.models.workload, each dimension divided by `scale` (at least 1)."""
    from dmuon.errors import InputError
    from simulator.models.workload import load_workload

    params = load_workload(workload).params
    first = {}
    for p in params:
        first.setdefault(p.matrix, p)
    missing = [r for r in ROLES + ("embed_tokens",) if r not in first]
    if missing:
        raise InputError(f"workload {workload!r} lacks {missing}; accepted: a Qwen/Llama-shaped LM workload "
                         "(q/k/v/o/gate/up/down_proj and embed_tokens), e.g. qwen2.5-1.5b")
    s = lambda v: max(1, v // scale)  # noqa: E731
    return dict(hidden=s(first["q_proj"].rows), kv=s(first["k_proj"].rows), inter=s(first["gate_proj"].rows),
                vocab=s(first["embed_tokens"].rows), blocks=sum(p.matrix == "q_proj" for p in params),
                head="lm_head" in first)


class Block(nn.Module):
    """One decoder block's parameters as Qwen2 has them (q/k/v with biases, two RMSNorm scales); the
    forward touches every parameter (a stand-in for attention: only the optimizer is timed)."""

    def __init__(self, hidden: int, kv: int, inter: int):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, d, bias=True) for d in (hidden, kv, kv))
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj, self.up_proj = (nn.Linear(hidden, inter, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, h):
        a = self.input_layernorm(h)
        widen = -(-h.shape[-1] // self.k_proj.out_features)
        k, v = (f(a).repeat(1, widen)[:, :h.shape[-1]] for f in (self.k_proj, self.v_proj))
        h = h + self.o_proj(self.q_proj(a) * torch.sigmoid(k) + v)
        b = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(b)) * self.up_proj(b))


class QwenShaped(nn.Module):
    def __init__(self, hidden: int, kv: int, inter: int, vocab: int, blocks: int, head: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, kv, inter) for _ in range(blocks))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False) if head else None  # else tied to the embedding

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for b in self.layers:
            h = b(h)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(h), w)


def build_model(dims: dict, layout: str, device, dtype):
    from dmuon import shard_model

    torch.manual_seed(0)
    with torch.device(device):
        model = QwenShaped(**dims).to(dtype)
    return shard_model(model, layout)


def pass_sizes(dims: dict) -> dict[str, list[int]]:
    """Element counts of the Muon matrices, the AdamW parameters and all parameters (dmuon.params.route's
    split; on a world of 1 every FSDP2 shard is its whole parameter), from a model on the meta device."""
    from dmuon.params import route

    with torch.device("meta"):
        routes = route(QwenShaped(**dims))
    muon = [r.param.numel() for r in routes if r.use_muon]
    adamw = [r.param.numel() for r in routes if not r.use_muon]
    return dict(muon=muon, adamw=adamw, all=muon + adamw)


def fwd_bwd(model, ids, targets) -> None:
    loss = F.cross_entropy(model(ids).float(), targets)
    loss.backward()


# ---- timing -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def deadline(seconds: int, what: str):
    """TimeoutError if the block runs past `seconds` (SIGALRM: checked between Python bytecodes)."""
    def fire(*_):
        raise TimeoutError(f"{what}: over the {seconds} s limit (--step-timeout)")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class Clock:
    """Median device ms (CUDA events; on CPU the wall time) and host ms of `fn` over repeats."""

    def __init__(self, device, repeats: int, warmup: int):
        self.cuda = device.type == "cuda"
        self.repeats, self.warmup = repeats, warmup

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, before=None) -> tuple[float, float]:
        dev, host = [], []
        for r in range(self.warmup + self.repeats):
            if before is not None:
                before()
            self.sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            if self.cuda:
                end.record()
            self.sync()
            t = (time.perf_counter() - t0) * 1e3
            if r >= self.warmup:
                host.append(t)
                dev.append(start.elapsed_time(end) if self.cuda else t)
        return statistics.median(dev), statistics.median(host)


class Table:
    """The CSV rows, each measured under its own deadline; a part that fails is recorded, not fatal."""

    def __init__(self, clock: Clock, price, limit_s: int):
        self.clock, self.price, self.limit_s, self.rows = clock, price, limit_s, []

    def predicted(self, op: str, elements: int, tensors: int) -> float | str:
        if not op:
            return ""
        return sum(self.price(elements, o, tensors) for o in op.split("+")) * 1e3

    def add(self, name, group, op, elements, tensors, fn, before=None, note="", predicted=None) -> None:
        t0 = time.perf_counter()
        try:
            with deadline(self.limit_s, name):
                measured, host = self.clock.time(fn, before)
        except Exception as e:  # noqa: BLE001 (recorded in the row and printed; the other parts still run)
            measured = host = ""
            note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        row = dict(zip(COLUMNS, (name, group, op, elements, tensors, measured, host,
                                 self.predicted(op, elements, tensors) if predicted is None else predicted,
                                 note), strict=True))
        self.rows.append(row)
        shown = f"{measured:9.3f} ms" if measured != "" else "   failed"
        print(f"[{time.perf_counter() - t0:5.1f} s] {name:28s} {elements:>12,} el {tensors:>4} t {shown}"
              + (f"  {note}" if note else ""), flush=True)


# ---- the passes -------------------------------------------------------------------------------------
def local_sizes(params) -> list[int]:
    from dmuon.runtime.fsdp import local_tensor

    return [local_tensor(p).numel() for p in params]


def part_a(table: Table, dims, device, dtype, ids, targets) -> None:
    """torch.optim.AdamW over the FSDP2 parameters (every parameter a DTensor), foreach and fused."""
    with deadline(table.limit_s, "part (a) set-up"):
        model = build_model(dims, "fsdp2-sharded", device, dtype)
        fwd_bwd(model, ids, targets)
    params = list(model.parameters())
    n = sum(local_sizes(params))
    for kind in ("foreach", "fused"):
        opt = torch.optim.AdamW(params, lr=1e-4, **{kind: True})
        table.add(f"fsdp2_torch_adamw_{kind}", "a", "adamw", n, len(params), opt.step)
        del opt
    del model, params


def part_b(table: Table, dims, device, dtype, ids, targets, kernels: str) -> list[int]:
    """DMuon on the fsdp2-owner layout: its own momentum, AdamW and step code. On a world of 1 the rank
    owns all the matrices; an owner at scale owns a few batches, so the momentum is also timed over the
    plan's largest batch alone (`_ordered_batches` cut to it). Returns that batch's member sizes."""
    from dmuon import DMuon, NSConfig

    with deadline(table.limit_s, "part (b) set-up"):
        model = build_model(dims, "fsdp2-owner", device, dtype)
        opt = DMuon(model, ns=NSConfig(kernels=kernels), timeout_s=table.limit_s)
    try:
        with deadline(table.limit_s, "part (b) first step"):
            fwd_bwd(model, ids, targets)
            opt.step()  # the state exists; every unit's exchange is absorbed, its summed gradient kept
            opt.synchronize_exchanges()
        muon = opt.params[:opt.n_muon]
        adamw = opt.params[opt.n_muon:opt.expert_first]
        n_muon, n_adamw = sum(p.numel() for p in muon), sum(local_sizes(adamw))
        real_ns = opt._ns
        no_ns = lambda stack, method: stack  # noqa: E731 (the NS call left out: momentum + stacking only)
        opt._ns = no_ns
        table.add("dmuon_momentum", "b", "muon_momentum", n_muon, len(muon), opt._speculate,
                  note="DMuon._speculate, NS replaced by the identity: momentum into the owner stacks")
        batch = max(opt._ordered_batches(), key=lambda b: sum(opt.params[i].numel() for i in b.members))
        big = [opt.params[i].numel() for i in batch.members]
        opt._ordered_batches = lambda: [batch]
        table.add("dmuon_momentum_batch", "b", "muon_momentum", sum(big), len(big), opt._speculate,
                  note=f"as dmuon_momentum over the plan's largest batch ({len(big)} x {batch.rows} x "
                  f"{batch.cols}) alone: one owner's pass at scale")
        del opt._ordered_batches  # the class's method again: every batch
        opt._ns = real_ns
        table.add("dmuon_momentum_ns", "b", "", n_muon, len(muon), opt._speculate,
                  note=f"DMuon._speculate with NS (kernels={kernels})")
        everything = torch.ones(len(opt.params), dtype=torch.bool)
        table.add("dmuon_adamw", "b", "adamw", n_adamw, len(adamw), lambda: opt._adamw_update(everything),
                  note="DMuon._adamw_update over the FSDP2 shards of the non-Muon parameters")
        again = lambda: fwd_bwd(model, ids, targets)  # noqa: E731 (untimed: every step needs its gradients)
        opt._ns = no_ns
        table.add("dmuon_step_no_ns", "b", "muon_momentum+adamw", n_muon + n_adamw, len(muon) + len(adamw),
                  opt.step, before=again, note="DMuon.step() with NS replaced by the identity; predicted: "
                  "the momentum and AdamW passes (apply, checks and flags are not in it)",
                  predicted=(table.predicted("muon_momentum", n_muon, len(muon))
                             + table.predicted("adamw", n_adamw, len(adamw))))
        opt._ns = real_ns
        table.add("dmuon_step", "b", "", n_muon + n_adamw, len(muon) + len(adamw), opt.step, before=again,
                  note=f"DMuon.step() (kernels={kernels})")
    finally:
        opt.close()
    return big


def flat_views(sizes: list[int], device, dtype, fill: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    flat = torch.full((sum(sizes),), fill, device=device, dtype=dtype)
    return flat, list(flat.split(sizes))


def adamw_plain(sizes: list[int], one: bool, device, dtype):
    """dmuon.optim.adamw_step_ (torch's fused kernel) over plain tensors of these sizes (one: a single
    tensor of their total)."""
    from dmuon.optim import adamw_step_

    ts = [flat_views(sizes, device, dtype, f) for f in (0.5, 1e-3, 0.0, 0.0)]
    p, g, m, v = ([flat] if one else views for flat, views in ts)
    steps = [1] * len(p)
    return lambda: adamw_step_(p, g, m, v, steps, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def momentum_plain(sizes: list[int], one: bool, device, dtype):
    """The runtime's momentum per tensor (dmuon.optim.momentum_update into a new buffer, muon_ns_input into
    its slot of a stack) over plain tensors of these sizes (one: a single tensor of their total)."""
    from dmuon.optim import momentum_update, muon_ns_input

    (_, gs), (_, bufs), (_, outs) = (flat_views(sizes, device, dtype, f) for f in (1e-3, 0.0, 0.0))
    if one:
        gs, bufs, outs = ([torch.cat(x)] for x in (gs, bufs, outs))

    def run():
        for g, b, o in zip(gs, bufs, outs, strict=True):
            muon_ns_input(g, momentum_update(g, b, 0.95), 0.95, True, out=o)
    return run


def part_c(table: Table, sizes: dict, device, dtype) -> None:
    """The same elementwise work on plain tensors: one tensor, and as many as the pass has."""
    for what, name, op in (("adamw", "plain_adamw_fused", "adamw"), ("all", "plain_adamw_all_fused", "adamw"),
                           ("muon", "plain_momentum", "muon_momentum"),
                           ("batch", "plain_momentum_batch", "muon_momentum")):
        s = sizes.get(what)
        if not s:  # the batch's sizes come from part (b)
            continue
        make = momentum_plain if op == "muon_momentum" else adamw_plain
        for one in (True, False):
            fn = make(s, one, device, dtype)
            table.add(f"{name}_{1 if one else 'k'}", "c", op, sum(s), 1 if one else len(s), fn)
            del fn
    for one in (True, False):
        s = sizes["all"]
        flat, views = flat_views(s, device, dtype, 0.5)
        params = [nn.Parameter(t) for t in ([flat] if one else views)]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        table.add(f"plain_torch_adamw_foreach_{1 if one else 'k'}", "c", "adamw", sum(s),
                  1 if one else len(s), opt.step)
        del opt, params, flat, views


# ---- report -----------------------------------------------------------------------------------------
def verdicts(rows: list[dict], price) -> list[str]:
    by = {r["pass"]: r for r in rows}
    out = []
    for name, base in BASELINES.items():
        r, b = by.get(name), by.get(base)
        if not r or not b or r["measured_ms"] == "" or b["measured_ms"] == "":
            out.append(f"{name}: not measured")
            continue
        intercept = price(1, r["op"]) * 1e3
        extra = r["measured_ms"] - b["measured_ms"]
        pays = extra >= intercept / 2
        out.append(f"{name}: {r['measured_ms']:.3f} ms, {extra:+.3f} ms over {base} "
                   f"({b['measured_ms']:.3f} ms) "
                   f"-> {'PAYS' if pays else 'does NOT pay'} the simulator's {intercept:.2f} ms intercept "
                   f"(threshold {intercept / 2:.2f} ms; predicted {r['predicted_ms']:.3f} ms)")
    for base in ("plain_adamw_all_fused", "plain_momentum", "plain_momentum_batch",
                 "plain_torch_adamw_foreach"):
        one, k = by.get(f"{base}_1"), by.get(f"{base}_k")
        if one and k and one["measured_ms"] != "" and k["measured_ms"] != "" and k["tensors"] > 1:
            per = (k["measured_ms"] - one["measured_ms"]) / (k["tensors"] - 1) * 1e3
            out.append(f"{base}: {per:.2f} us per extra tensor ({k['tensors']} tensors vs 1)")
    return out


def environment(device) -> str:
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "none (CPU dry run)"
    return (f"python {platform.python_version()}, torch {torch.__version__}, device {gpu}, "
            f"host {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")


def write_outputs(out: Path, prefix: str, rows, lines, args, device) -> tuple[Path, Path]:
    from dmuon.io import atomic_write_text

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()})
    csv_path = atomic_write_text(out / f"{prefix}_opt_passes.csv", buf.getvalue())
    md = [f"# Optimizer passes on one device ({prefix})", "",
          f"`{' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}`; {environment(device)}; workload "
          f"{args.workload} / {args.scale}, {args.dtype}, {args.tokens} tokens, median of {args.repeats} "
          f"after "
          f"{args.warmup} warm-up; predicted: simulator profile {args.profile} "
          "(`simulator.setup.profile_pricer`).", "",
          "| pass | group | elements | tensors | measured ms | host ms | predicted ms |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda v: f"{v:.3f}" if isinstance(v, float) else (v or "-")  # noqa: E731
        md.append(f"| {r['pass']} | {r['group']} | {r['elements']:,} | {r['tensors']} "
                  f"| {f(r['measured_ms'])} | {f(r['host_ms'])} | {f(r['predicted_ms'])} |")
    md += ["", "## Verdict", ""] + [f"- {line}" for line in lines]
    if device.type != "cuda":
        md += ["", "CPU dry run: checks the script end to end; its times say nothing about a GPU."]
    md_path = atomic_write_text(out / f"{prefix}_opt_passes.md", "\n".join(md) + "\n")
    return csv_path, md_path


def device_slug(name: str) -> str:
    """The file prefix of a GPU: its first name token with a digit ("NVIDIA H200 NVL" -> "h200")."""
    tokens = name.split() or ["gpu"]
    token = next((t for t in tokens if any(c.isdigit() for c in t)), tokens[-1])
    return "".join(c for c in token.lower() if c.isalnum()) or "gpu"


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run: gloo on the CPU (use with --scale)")
    ap.add_argument("--workload", default="qwen2.5-1.5b", help="a Qwen/Llama-shaped simulator workload")
    ap.add_argument("--scale", type=int, default=1, help="divide every dimension by this (>= 1)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the one forward/backward")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", default="a800", help="simulator hardware profile that predicts")
    ap.add_argument("--kernels", default="torch", help="NSConfig.kernels of DMuon's NS (torch: no autotune)")
    ap.add_argument("--step-timeout", type=int, default=60, help="seconds per timed part")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else results/gpu)")
    args = ap.parse_args(argv)
    for what in ("scale", "tokens", "repeats", "step_timeout"):
        if getattr(args, what) < 1:
            ap.error(f"--{what.replace('_', '-')} must be >= 1, got {getattr(args, what)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv=None) -> int:
    import torch.distributed as dist

    from simulator.setup import profile_pricer

    args = parse(argv)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch; accepted: a GPU, or --cpu for the dry run")
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        torch.set_num_threads(1)  # a dry run on a shared machine: no thread oversubscription
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    price = profile_pricer(args.profile)
    dims = qwen_dims(args.workload, args.scale)
    out = Path(args.out or os.environ.get("OUT") or "results/gpu")
    prefix = "cpu_dryrun" if args.cpu else device_slug(torch.cuda.get_device_name(0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    print(f"{environment(device)}; model {dims}", flush=True)
    t0 = time.perf_counter()
    try:
        table = Table(Clock(device, args.repeats, args.warmup), price, args.step_timeout)
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(dims["vocab"], (args.tokens,), generator=gen).to(device)
        targets = torch.randint(dims["vocab"], (args.tokens,), generator=gen).to(device)
        sizes = pass_sizes(dims)
        for name, part, extra in (("a", part_a, ()), ("b", part_b, (args.kernels,))):
            try:  # a part that fails leaves its rows out (reported below); the next part still runs
                got = part(table, dims, device, dtype, ids, targets, *extra)
                if name == "b":
                    sizes["batch"] = got
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                print(f"part ({name}) failed; its rows are missing", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        part_c(table, sizes, device, dtype)
    finally:
        dist.destroy_process_group()
    lines = verdicts(table.rows, price)
    csv_path, md_path = write_outputs(out, prefix, table.rows, lines, args, device)
    print("\n".join(["verdict:"] + lines))
    print(f"wrote {csv_path} and {md_path} in {time.perf_counter() - t0:.1f} s")
    done = {r["pass"] for r in table.rows if r["measured_ms"] != ""}
    missing = [p for p in PASSES if p not in done]
    if missing:
        print(f"not measured: {', '.join(missing)}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
