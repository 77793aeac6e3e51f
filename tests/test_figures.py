"""Every figure renders (PNG + PDF) from a tiny synthetic results table; index.md, comparison.md; the numbers
the figures and comparison.md print (headline ranges, ablation shares) computed correctly."""

import json

import pandas as pd
import pytest

from dmuon.errors import InputError
from harness.figures import FIGURES, render, render_experiment
from harness.figures.ablation import PATH, leave_one_out, mean_shares, paper_shares, shares
from harness.figures.comparison import write_comparison
from harness.figures.paper import headline

PROFILE = {"profile": "a800", "profile_description": "a800: test profile", "cost_source": "a800"}


def paper_rows(tmp_path):
    """2 workloads x 2 GPU counts x 3 strategies, with a synthetic trace for one point."""
    rows = []
    for w, base in (("pi0", 1.0), ("wall-wm", 2.0)):
        for g in (8, 16):
            for s, opt in (("adamw", 0.02), ("naive", 1.0 * base), ("dmuon", 0.1 * base * 8 / g)):
                rows.append(
                    {
                        "workload": w,
                        "gpus": g,
                        "strategy": s,
                        "optimizer_s": opt + 0.01,
                        "optimizer_published_s": opt,
                        "forward_s": 0.2,
                        "backward_s": 0.4,
                        "step_s": 0.6 + opt + 0.01,
                        "layout": "fsdp-keep",
                        "seq_len": 2048,
                        "micro_batch": 2,
                        "gpus_per_node": 8,
                        "balancer": "milp",
                        "ns_method": "auto",
                        **PROFILE,
                    }
                )
    traces = tmp_path / "traces"
    traces.mkdir()
    for r in rows:
        if r["workload"] == "pi0" and r["gpus"] == 8:
            ev = [
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": 0,
                    "tid": k * 8 + j,
                    "args": {"name": f"rank {k} {st}"},
                }
                for k in range(2)
                for j, st in enumerate(("compute", "comm"))
            ]
            ev += [
                {"ph": "X", "name": n, "cat": ph, "pid": 0, "tid": k * 8, "ts": t0, "dur": d}
                for k in range(2)
                for n, ph, t0, d in (
                    ("fwd0", "fwd", 0, 200e3),
                    ("bwd0", "bwd", 200e3, 400e3),
                    ("ns0", "opt", 600e3, r["optimizer_s"] * 1e6),
                )
            ]
            name = f"traces/pi0_8_{r['strategy']}.json"
            (tmp_path / name).write_text(json.dumps({"traceEvents": ev}))
            r["trace_file"] = name
    return pd.DataFrame(rows)


def ablation_rows():
    times = {
        "naive": 10.0,
        "+sym_gram": 8.0,
        "+owners_lb": 4.0,
        "+batching_autotune": 3.0,
        "+overlap": 2.0,
        "-sym_gram": 2.5,
        "-owners_lb": 8.0,
        "-load_balance": 2.2,
        "-batching_autotune": 3.0,
        "-overlap": 3.0,
        "+split": 1.9,
    }
    rows = []
    for w, scale in (("pi0", 1.0), ("qwen2.5-7b", 2.0)):
        for v, t in times.items():
            rows.append(
                {
                    "workload": w,
                    "gpus": 8,
                    "variant": v,
                    "step_s": t * scale,
                    "optimizer_s": t * scale - 1,
                    **PROFILE,
                }
            )
    return pd.DataFrame(rows)


SPLIT_GPUS = (8, 64, 1024)


def scaling_rows():
    rows = []
    for gpu in ("a800", "h200"):
        for g in (8, 16, 32):
            for s in ("adamw", "naive", "dmuon"):
                rows.append(
                    {
                        "grid": "gpus",
                        "gpu": gpu,
                        "gpus": g,
                        "strategy": s,
                        "tokens_per_s": 1000 * g,
                        "step_s": 1.0,
                    }
                )
    for nic in (100, 200):
        for s in ("adamw", "naive", "dmuon"):
            rows.append(
                {
                    "grid": "nic",
                    "gpu": "a800",
                    "gpus": 64,
                    "nic_gbps": nic,
                    "strategy": s,
                    "tokens_per_s": 1.0,
                    "step_s": 100 / nic,
                }
            )
    for gpn in (4, 8):
        for s in ("adamw", "naive", "dmuon"):
            rows.append(
                {
                    "grid": "gpus_per_node",
                    "gpu": "a800",
                    "gpus": 256,
                    "gpus_per_node": gpn,
                    "strategy": s,
                    "tokens_per_s": 1.0,
                    "step_s": 1.0,
                }
            )
    for g in SPLIT_GPUS:
        for k, opt in ((1, 0.05), (8, 0.05 * 8 / g)):
            rows.append({"grid": "split", "gpu": "a800", "gpus": g, "strategy": "dmuon", "max_split": k,
                         "tokens_per_s": 1.0, "step_s": 1.0, "optimizer_s": opt + 0.001 * k,
                         "ns_makespan_s": opt})
    df = pd.DataFrame(rows)
    df["workload"], df["seq_len"], df["micro_batch"], df["layout"], df["balancer"] = (
        "qwen2.5-7b",
        2048,
        2,
        "fsdp-keep",
        "lpt",
    )
    df["profile"] = df["gpu"]
    df["profile_description"] = df["gpu"] + ": test"
    df["cost_source"] = df["gpu"].map({"a800": "a800", "h200": "h200 datasheet roofline"})
    return df


def test_scaling_figure_draws_the_split_grid():
    from harness.figures.scaling import scaling

    df = scaling_rows()
    fig = scaling(df)
    (ax_opt,) = [a for a in fig.axes if a.get_title().startswith("(e)")]
    (ax_ns,) = [a for a in fig.axes if a.get_title().startswith("(f)")]
    split = df[df["grid"] == "split"]
    for ax, col in ((ax_opt, "optimizer_s"), (ax_ns, "ns_makespan_s")):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert len(lines) == 2
        for k in (1, 8):
            (label,) = [lab for lab in lines if f"max_split {k} " in lab]
            assert "A800 (NS: measured table)" in label
            want = split[split["max_split"] == k].sort_values("gpus")
            assert list(lines[label].get_xdata()) == list(SPLIT_GPUS)
            assert list(lines[label].get_ydata()) == pytest.approx(list(want[col] * 1e3))
    assert "max_split 1 vs 8" in fig.texts[-1].get_text()
    # without the grid (an older table) the panels are hidden, the rest still draws
    old = df[df["grid"] != "split"].drop(columns=["max_split", "optimizer_s", "ns_makespan_s"])
    fig2 = scaling(old)
    assert not [a for a in fig2.axes if a.get_visible() and a.get_title().startswith(("(e)", "(f)"))]


def balancer_rows():
    rows = []
    for g in (8, 32):
        for b, loads in (
            ("round_robin", [3, 1] * (g // 2)),
            ("lpt", [2.2, 1.8] * (g // 2)),
            ("milp", [2] * g),
        ):
            rows.append(
                {
                    "workload": "pi0",
                    "gpus": g,
                    "balancer": b,
                    "loads_s": json.dumps([x / 1e3 for x in loads]),
                    "makespan_s": max(loads) / 1e3,
                    "lower_bound_s": 2e-3,
                    "efficiency": 2 / max(loads),
                    "solve_time_s": {"round_robin": 1e-3, "lpt": 1e-2, "milp": 1.0}[b],
                    "cost_source": "a800",
                    "method": "gram_sym",
                    "dtype": "bf16",
                    "batching": True,
                    "max_batch": 8,
                    "time_limit_s": 10.0,
                }
            )
    return pd.DataFrame(rows)


def kernel_rows():
    return pd.DataFrame(
        [
            {
                "workload": "qwen2.5-7b",
                "matrix": m,
                "n": n,
                "m": mm,
                "batch": 8,
                "scale": 8,
                "dtype": "fp32",
                "repeats": 3,
                "threads": 1,
                "standard_jordan_s": 2e-3,
                "gram_jordan_s": 1e-3,
                "standard_polar_s": 2e-3,
                "gram_polar_s": 1e-3,
                "loop_s": 8e-3,
                "batched_s": 4e-3,
                "gram_speedup_jordan": 2.0,
                "batch_speedup": 2.0,
                "device": "measured on test cpu",
                "load_1m_before": 0.5,
                "load_1m_after": 0.6,
            }
            for m, n, mm in (("q_proj", 448, 448), ("k_proj", 64, 448))
        ]
    )


def validation_rows():
    rows = []
    for check, kind in (
        ("published_8xa800", "published"),
        ("ns_replay", "published"),
        ("closed_loop", "measured"),
    ):
        for k, (metric, err) in enumerate((("step", 0.1), ("optimizer", -0.3))):
            rows.append(
                {
                    "check": check,
                    "label": f"pi0 point{k}",
                    "workload": "pi0",
                    "strategy": "dmuon",
                    "metric": metric,
                    "unit": "s",
                    "reference": 1.0,
                    "reference_kind": kind,
                    "simulated": 1.0 + err,
                    "error": err,
                    "bound": 0.25,
                    "bounded": k == 0,
                    "within_bound": abs(err) <= 0.25,
                    "note": "",
                    "profile": "a800",
                }
            )
    return pd.DataFrame(rows)


def moe_rows():
    """2 models x 2 clusters (datasheet / measured) x 2 GPU counts x 3 strategies."""
    rows = []
    for w in ("qwen3-30b-a3b", "kimi-k2-like"):
        for cl, src in (("h100-ndr", "datasheet"), ("my-cluster", "measured")):
            for g in (256, 1024):
                for s, opt in (("adamw", 0.1), ("naive", 5.0), ("dmuon", 1.0)):
                    rows.append({"workload": w, "cluster": cl, "gpus": g, "strategy": s, "step_s": 2 + opt,
                                 "optimizer_s": opt, "seq_len": 4096, "micro_batch": 1, "layout": "fsdp-keep",
                                 "balancer": "lpt", "ns_method": "auto", "profile": cl,
                                 "profile_description": f"{cl}: cluster {cl} ({src}): 8 GPUs per node",
                                 "cost_source": "h100 datasheet roofline" if src == "datasheet" else "a800"})
    return pd.DataFrame(rows)


def test_moe_figure_labels_each_cluster_source():
    from harness.figures.moe import cluster_label

    df = moe_rows()
    assert cluster_label(df, "h100-ndr") == "h100-ndr (datasheet, NS: datasheet roofline)"
    assert cluster_label(df, "my-cluster") == "my-cluster (measured)"


def moe_ep_rows():
    return pd.DataFrame([{"workload": w, "gpus": g, "ep": ep, "makespan_s": 0.1 / ep ** 0.3,
                          "lower_bound_s": 0.09, "cost_source": "a800", "method": "gram_sym", "dtype": "bf16",
                          "balancer": "lpt"}
                         for w in ("qwen3-30b-a3b", "kimi-k2-like") for g in (256, 1024)
                         for ep in (1, 8, 64)])


def sensitivity_rows():
    conf = {"workload": "qwen2.5-7b", "gpus": 128, "gpu": "a800", "strategy": "dmuon", "layout": "fsdp-keep",
            "seq_len": 2048, "micro_batch": 2, "output": "step_s", "base": 1.0}
    return pd.DataFrame([{"input": name, "input_low": lo, "input_high": hi, "at_low": a, "at_high": b,
                          "swing": abs(b - a), "source": "test", **conf}
                         for name, lo, hi, a, b in (("bwd_tflops", 190, 210, 1.05, 0.97),
                                                    ("nccl_channels", 8, 32, 0.9, 1.04))])


def test_sensitivity_figure_from_its_csv_ranked_by_swing(tmp_path):
    rdir = tmp_path / "results" / "sensitivity"
    rdir.mkdir(parents=True)
    sensitivity_rows().to_csv(rdir / FIGURES["sensitivity"].data, index=False)
    figs = tmp_path / "figs"
    (entry,) = render_experiment("sensitivity", tmp_path / "results", figs)
    assert entry["files"] == ["sensitivity.png", "sensitivity.pdf"]
    assert entry["command"].startswith("harness sensitivity --workload qwen2.5-7b --gpus 128 --csv ")
    assert "## 11. Sensitivity" in (figs / "index.md").read_text()
    from harness.figures.sensitivity import sensitivity

    fig = sensitivity(sensitivity_rows())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bwd_tflops", "nccl_channels"]  # top: largest
    widths = sorted(round(abs(p.get_width()), 6) for p in ax.patches)
    assert widths == pytest.approx(sorted([50.0, 30.0, 100.0, 40.0]))  # ms from the 1000 ms base
    with pytest.raises(InputError, match="one configuration"):
        sensitivity(pd.concat([sensitivity_rows(), sensitivity_rows().assign(gpus=8)]))


def breakdown_rows():  # scripts/published_vs_ours.py --breakdown (figure 12)
    return pd.DataFrame([{"workload": w, "gpus": 128, "layout": lay, "part": part, "points": v,
                          "published_pct": 3.0, "ours_pct": 2.0, "adamw_share": 0.2, "layers": 28,
                          "muon_per_layer": 7.0, "small_share": 0.4}
                         for w in ("pi0", "wall-oss") for lay in ("fsdp-keep", "hsdp-free")
                         for part, v in (("ours forward", 1.5), ("coalesce", -0.5), ("hsdp_stages", 2.0))])


DATA = {
    "published": breakdown_rows,
    "sensitivity": sensitivity_rows,
    "moe": moe_rows,
    "moe_ep": moe_ep_rows,
    "paper": paper_rows,
    "ablation": ablation_rows,
    "scaling": scaling_rows,
    "balancers": balancer_rows,
    "kernels": kernel_rows,
    "validation": validation_rows,
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_each_figure_renders_from_a_tiny_table(name, tmp_path):
    spec = FIGURES[name]
    rdir = tmp_path / "results" / spec.experiment
    rdir.mkdir(parents=True)
    make = DATA[spec.experiment]
    df = make(rdir) if spec.experiment == "paper" else make()
    df.to_csv(rdir / spec.data, index=False)
    entry = render(name, rdir, tmp_path / "figs")
    for f in entry["files"]:
        assert (tmp_path / "figs" / f).stat().st_size > 5000
    assert entry["files"] == [f"{spec.stem}.png", f"{spec.stem}.pdf"]
    assert entry["caption"].startswith(("SIMULATED", "MEASURED", "Plans priced"))
    assert entry["data"].endswith(f"{spec.experiment}/{spec.data}")


def test_index_and_comparison(tmp_path):
    root = tmp_path / "results"
    for exp in ("paper", "ablation"):
        (root / exp).mkdir(parents=True)
    paper_rows(root / "paper").to_csv(root / "paper" / "results.csv", index=False)
    ablation_rows().to_csv(root / "ablation" / "results.csv", index=False)
    figs = tmp_path / "figs"
    render_experiment("paper", root, figs)
    render_experiment("ablation", root, figs)
    index = (figs / "index.md").read_text()
    for stem in ("01_optimizer_time", "02_step_speedup", "06_timeline", "04_ablation"):
        assert f"({stem}.png)" in index
    assert "harness run paper" in index and "harness run ablation" in index
    assert index.index("## 1.") < index.index("## 2.") < index.index("## 4.") < index.index("## 6.")
    text = write_comparison(figs / "comparison.md", root).read_text()
    assert "| step speedup DMuon / naive, max (x) |" in text
    assert "symmetric Gram kernel | 25 |" in text  # pi0 and qwen: (10-8)/8, same shares at twice the times
    assert "_no results yet: run `harness validate`_" in text


def test_headline_ranges():
    df = paper_rows_no_trace()
    h = headline(df)
    opt = df.pivot_table(index=["workload", "gpus"], columns="strategy", values="optimizer_s")
    assert h["optimizer_speedup_max"] == pytest.approx((opt["naive"] / opt["dmuon"]).max())
    assert h["optimizer_speedup_published_min"] == pytest.approx(1.0 / 0.1)  # pi0, 8 GPUs
    st = df.pivot_table(index=["workload", "gpus"], columns="strategy", values="step_s")
    assert h["step_overhead_mean_pct"] == pytest.approx(100 * (st["dmuon"] / st["adamw"] - 1).mean())
    assert h["points"] == 4


def paper_rows_no_trace():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        return paper_rows(Path(d))


def test_ablation_shares_and_leave_one_out():
    df = ablation_rows()
    s = shares(df)
    assert list(s["workload"]) == ["pi0", "qwen2.5-7b"]
    row = s.iloc[0]
    assert [row[k] for k in PATH[1:]] == pytest.approx([25.0, 50.0, 12.5, 12.5])
    assert sum(row[k] for k in PATH[1:]) == pytest.approx(100.0)
    assert mean_shares(df) == pytest.approx(
        {"+sym_gram": 25.0, "+owners_lb": 50.0, "+batching_autotune": 12.5, "+overlap": 12.5}
    )
    opt = mean_shares(
        df, "optimizer_s"
    )  # times minus 1: pi0 saving 9 -> 7 of 8 ... computed per configuration
    assert sum(opt.values()) == pytest.approx(100.0)
    lo = leave_one_out(df)
    assert lo[(lo.workload == "pi0") & (lo.variant == "-owners_lb")]["increase_pct"].iloc[0] == pytest.approx(
        300.0
    )
    assert paper_shares() == {"+sym_gram": 48.0, "+owners_lb": 32.0, "+batching_autotune": 16.0}
    split = lo[(lo.workload == "pi0") & (lo.variant == "+split")]["increase_pct"].iloc[0]
    assert split == pytest.approx(-5.0)  # full DMuon + split NS, 1.9 vs 2.0


def test_missing_results_say_what_to_run(tmp_path):
    with pytest.raises(InputError, match="run the experiment first"):
        render("optimizer_time", tmp_path, tmp_path / "figs")
