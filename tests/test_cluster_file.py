"""Cluster files (simulator.fabric.cluster_file): the shipped examples, how they map onto the hardware model,
overrides by the config / CLI, errors, and the `cluster` / `model` keys in experiment files."""

import json

import pytest

from dmuon.errors import InputError
from harness.cli import main
from harness.experiment import expand, load_experiment
from harness.sweep import run_sweep
from simulator.api import SimConfig, profile_of, simulate
from simulator.fabric.cluster_file import cluster_names, load_cluster
from simulator.fabric.hardware import load_profile

GOOD = """
name = "mine"
source = "measured"
gpu = "h100"
gpus_per_node = { value = 4, source = "counted" }
nvlink_GBps = { value = 225, source = "nvbandwidth" }
nics_per_node = 2
nic_gbps = { value = 200, source = "ibstat" }
rails = 2
"""


def _file(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_shipped_clusters_are_labelled_and_cited():
    import tomllib

    from simulator.fabric.cluster_file import CLUSTERS_DIR

    assert {"a800-hdr", "h100-ndr", "gb200-nvl72-like"} <= set(cluster_names())
    for name in cluster_names():
        data = tomllib.loads((CLUSTERS_DIR / f"{name}.toml").read_text())
        assert data["source"] in ("datasheet", "measured")
        for key, v in data.items():
            if isinstance(v, dict):
                assert v.get("source"), f"{name}: {key} cites no source"


def test_mapping_onto_the_hardware_model():
    a800 = load_profile("a800")
    hdr = load_cluster("a800-hdr")
    assert (hdr.gpus_per_node, hdr.network.nic_Bps_per_node) == (8, 800e9 / 8)
    assert hdr.network.curves == a800.network.curves  # NVLink 200 GB/s = the profile's: the curve as is
    nvl = load_cluster("gb200-nvl72-like")
    h100 = load_profile("h100")
    assert nvl.gpus_per_node == 72 and nvl.network.nic_Bps_per_node == 72 * 400e9 / 8
    assert nvl.network.busbw("all_gather", 1e8) == pytest.approx(2 * h100.network.busbw("all_gather", 1e8))
    assert "rails" in nvl.provenance and nvl.fwd_flops == h100.fwd_flops


def test_a800_cluster_file_equals_the_a800_profile():
    a = simulate(SimConfig(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon", balancer="lpt"))
    b = simulate(SimConfig(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon", balancer="lpt",
                           cluster="a800-hdr"))
    assert b.profile == "a800-hdr" and b.step_s == pytest.approx(a.step_s, rel=1e-12)


def test_config_values_override_the_file(tmp_path):
    path = _file(tmp_path, GOOD)
    p = profile_of(SimConfig(cluster=path))
    assert (p.gpus_per_node, p.network.nic_Bps_per_node, p.nvlink_Bps) == (4, 400e9 / 8, 225e9)
    assert "nvbandwidth" in p.provenance["nvlink_GBps"]
    assert profile_of(SimConfig(cluster=path, nic_gbps=100)).network.nic_Bps_per_node == 100e9 / 8
    other = profile_of(SimConfig(cluster=path, gpu="h200"))  # another GPU profile, the file's fabric
    assert other.cost_profiles == load_profile("h200").cost_profiles and other.nvlink_Bps == 225e9
    r = simulate(SimConfig(workload="qwen2.5-1.5b", gpus=8, strategy="adamw", cluster=path))
    assert r.settings["nodes"] == 2 and r.settings["ranks_per_node"] == 4
    r = simulate(SimConfig(workload="qwen2.5-1.5b", gpus=8, strategy="adamw", cluster=path, gpus_per_node=8))
    assert r.settings["nodes"] == 1


@pytest.mark.parametrize("text,match", [
    ("source = [", "malformed TOML"),
    (GOOD + "colour = 1\n", "unknown key 'colour'; accepted: name, description, source, gpu"),
    (GOOD.replace('gpu = "h100"\n', ""), "missing key 'gpu'; required: source, gpu"),
    (GOOD.replace('"measured"', '"guessed"'), "unknown source .*'guessed'; accepted: datasheet, measured"),
    (GOOD.replace("rails = 2", "rails = 3"), "rails must divide nics_per_node \\(2\\)"),
    (GOOD.replace("value = 225", "value = -1"), "nvlink_GBps must be a finite number > 0"),
    (GOOD.replace("value = 4,", "value = 4.5,"), "gpus_per_node must be an integer"),
    (GOOD + "inter_efficiency = 1.5\n", "inter_efficiency must be in \\(0, 1\\]"),
    (GOOD.replace('"h100"', '"cpu"'), "is a CPU profile"),
    (GOOD.replace('"h100"', '"tpu"'), "unknown gpu profile 'tpu'"),
])
def test_bad_cluster_files_are_one_line_errors(tmp_path, text, match):
    with pytest.raises(InputError, match=match) as e:
        load_cluster(_file(tmp_path, text))
    assert "\n" not in str(e.value)


def test_unknown_cluster_names(tmp_path):
    with pytest.raises(InputError, match="unknown cluster 'dgx'; accepted: a800-hdr"):
        load_cluster("dgx")
    with pytest.raises(InputError, match="does not exist"):
        load_cluster(str(tmp_path / "none.toml"))


def test_cli_cluster_and_gpu_override(capsys):
    args = ["simulate", "--workload", "qwen2.5-1.5b", "--gpus", "16", "--strategy", "adamw", "--json"]
    assert main([*args, "--cluster", "h100-ndr"]) == 0
    out = json.loads(capsys.readouterr().out)
    fwd = {g: f"{load_profile(g).fwd_flops / 1e12:.4g} TFLOP/s" for g in ("h100", "a800")}  # fitted values
    assert out["profile"] == "h100-ndr" and fwd["h100"] in out["provenance"]["forward_compute"]
    assert main([*args, "--cluster", "h100-ndr", "--gpu", "a800"]) == 0  # a800 compute, the H100 fabric
    out = json.loads(capsys.readouterr().out)
    assert fwd["a800"] in out["provenance"]["forward_compute"]
    assert "3200 Gb/s per node" in out["provenance"]["inter_node_bandwidth"]
    assert main([*args, "--cluster", "nope"]) == 2
    assert "unknown cluster 'nope'" in capsys.readouterr().err


def test_experiment_files_take_model_and_cluster(tmp_path):
    exp = tmp_path / "moe.toml"
    exp.write_text('runner = "simulate"\n[fixed]\nstrategy = "adamw"\ngpus = 16\n'
                   '[axes]\nmodel = ["qwen3-30b-a3b"]\ncluster = ["a800-hdr", "h100-ndr"]\n')
    rows = expand(load_experiment(str(exp)))
    assert [r["cluster"] for r in rows] == ["a800-hdr", "h100-ndr"]
    summary = run_sweep(load_experiment(str(exp)), tmp_path / "out")
    got = [(r["workload"], r["profile"]) for r in summary.rows]
    assert got == [("qwen3-30b-a3b", "a800-hdr"), ("qwen3-30b-a3b", "h100-ndr")]
