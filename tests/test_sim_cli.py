"""`harness simulate` (JSON, table, exit codes) and the Chrome trace it writes."""

import json

import pytest

from harness.cli import main
from simulator.api import SimConfig, run
from simulator.engine.trace import write_trace

KEYS = {"workload", "gpus", "strategy", "layout", "step_s", "forward_s", "backward_s", "optimizer_s",
        "exposed_comm_s", "tokens_per_s", "profile", "comm_bytes_per_rank", "ns_makespan_s", "provenance"}


def test_json_output_has_the_documented_keys(capsys):
    rc = main(["simulate", "--workload", "qwen2.5-1.5b", "--gpus", "16", "--strategy", "dmuon", "--json",
               "--nic-gbps", "400", "--no-overlap", "--balancer", "round_robin"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= set(out)
    got = (out["workload"], out["gpus"], out["strategy"], out["profile"])
    assert got == ("qwen2.5-1.5b", 16, "dmuon", "a800")
    assert out["settings"]["overlap"] is False and out["settings"]["nic_gbps"] == 400
    assert out["plan_balancer"] == "round_robin"
    assert "given on the command line" in out["provenance"]["inter_node_bandwidth"]


def test_default_prints_all_strategies_side_by_side(capsys):
    assert main(["simulate", "--workload", "qwen2.5-1.5b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    for word in ("adamw", "naive", "dmuon", "SIMULATED", "dmuon vs naive: optimizer", "forward_compute"):
        assert word in out


@pytest.mark.parametrize("args,match", [
    (["--gpus", "0"], "gpus must be an integer >= 1"),
    (["--gpus", "12"], "not a whole number of 8-GPU nodes .* multiple of 8 \\(nearest: 8 or 16\\)"),
    (["--gpu", "tpu"], "unknown gpu profile 'tpu'; accepted:"),
    (["--layout", "zero4"], "unknown layout 'zero4'; accepted:"),
    (["--workload", "nope"], "unknown workload 'nope'; accepted:"),
    (["--nic-gbps", "-1"], "--nic-gbps must be a positive number"),
    (["--strategy", "lion"], "unknown strategy 'lion'; accepted: adamw, naive, dmuon, all"),
    (["--system", "ours,theirs"], "accepted: ours, published, or ours,published"),
    (["--system", "theirs"], "unknown system 'theirs'; accepted: ours, published"),
    (["--system", "ours,published", "--strategy", "adamw"], "compares dmuon's two schedules; accepted: "
                                                           "--strategy dmuon or all"),
    (["--system", "ours,published", "--trace", "t.json"], "--trace writes one layout of one system"),
    (["--layout", "fsdp-keep,zero4"], "unknown layout 'zero4'; accepted:"),
    (["--layout", "fsdp-keep,,ddp"], "--layout: 'fsdp-keep,,ddp' is not a comma-separated list of distinct"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, args, match):
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert pytest.importorskip("re").search(match, err)


def test_trace_is_chrome_json_with_one_track_per_rank_and_stream(tmp_path):
    result, built = run(SimConfig(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon"))
    path = write_trace(built, tmp_path / "t.json", ranks_per_node=8, metadata={"strategy": "dmuon"})
    doc = json.loads(path.read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left behind
    events = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert set(names.values()) == {f"rank {r} {s}" for r in range(16) for s in ("compute", "comm")}
    assert len(names) == 32
    spans = [e for e in events if e["ph"] == "X"]
    ran = sum(1 for ops in built.cluster.queues.values() for op in ops if op.start is not None)
    assert len(spans) == ran
    for e in spans:
        rank = e["tid"] // 8
        assert e["pid"] == rank // 8 and e["dur"] >= 0
        assert names[(e["pid"], e["tid"])].startswith(f"rank {rank} ")
    # collectives line up across their participants
    ag = [e for e in spans if e["name"] == "ag/1/fwd/0"]
    assert len(ag) == 16 and len({(e["ts"], e["dur"]) for e in ag}) == 1


def test_cli_trace_per_strategy(tmp_path, capsys):
    base = tmp_path / "run.json"
    assert main(["simulate", "--workload", "qwen2.5-1.5b", "--gpus", "8", "--trace", str(base),
                 "--json"]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["run.adamw.json", "run.dmuon.json", "run.naive.json"]
    assert main(["simulate", "--workload", "qwen2.5-1.5b", "--gpus", "8", "--trace",
                 str(tmp_path / "missing" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
