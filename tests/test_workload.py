"""Workload catalog expansion and the custom TOML/CSV loaders."""

import pytest

from dmuon.errors import InputError
from simulator.models.workload import catalog_names, load_workload

REFERENCE_TOTALS = {  # public parameter counts (billions) of the catalog models, embeddings included
    "qwen2.5-7b": 7.6, "llama3.1-8b": 8.0, "llama3.2-3b": 3.2, "qwen2.5-1.5b": 1.5,
}


def test_catalog_lists_paper_workloads():
    assert {"qwen2.5-7b", "pi0", "wall-oss", "wall-wm"} <= set(catalog_names())


@pytest.mark.parametrize("name", ["qwen2.5-7b", "pi0", "wall-oss", "wall-wm", "llama3.1-8b"])
def test_expansion_matches_catalog_counts(name):
    import csv

    from simulator.models.workload import CATALOG_PATH

    with open(CATALOG_PATH) as f:
        rows = [r for r in csv.DictReader(f) if r["workload"] == name]
    w = load_workload(name)
    assert len(w.params) == sum(int(r["count"]) for r in rows)
    assert w.n_params == sum(int(r["count"]) * int(r["rows"]) * int(r["cols"]) for r in rows)
    muon_rows = [r for r in rows if r["optimizer"] == "muon"]
    assert len(w.muon_matrices) == sum(int(r["count"]) for r in muon_rows)
    assert len({p.name for p in w.params}) == len(w.params)
    # layers are contiguous 0..L-1 and forward-ordered
    layers = [p.layer for p in w.params]
    assert layers == sorted(layers) and set(layers) == set(range(w.n_layers))


@pytest.mark.parametrize("name,billions", REFERENCE_TOTALS.items())
def test_parameter_totals_match_public_sizes(name, billions):
    assert load_workload(name).n_params / 1e9 == pytest.approx(billions, rel=0.03)


def test_qwen_layout():
    w = load_workload("qwen2.5-7b")
    assert w.n_layers == 30  # embedding, 28 blocks, head
    assert w.params[0].matrix == "embed_tokens" and w.params[-1].matrix == "lm_head"
    block = [p for p in w.params if p.layer == 1]
    assert [p.matrix for p in block] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"]


def test_blocks_with_several_matrices_per_block():
    w = load_workload("wall-wm")
    assert w.n_layers == 30 and all(len(g) == 10 for g in w.layer_params())
    assert any("ASSUMPTION" in n for n in w.notes)


def test_unknown_workload_lists_choices():
    with pytest.raises(InputError, match="unknown workload 'gpt-5'.*qwen2.5-7b"):
        load_workload("gpt-5")


def test_custom_toml(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('name = "mine"\n[[matrices]]\nname = "w1"\nrows = 64\ncols = 256\ncount = 4\n'
                 '[[matrices]]\nname = "w2"\nrows = 256\ncols = 64\ncount = 4\n'
                 '[[matrices]]\nname = "embed"\nrows = 1000\ncols = 64\noptimizer = "adamw"\n')
    w = load_workload(p)
    assert w.name == "mine" and len(w.muon_matrices) == 8 and len(w.adamw_params) == 1
    assert w.n_layers == 5  # embedding + 4 blocks
    assert w.params[0].optimizer == "adamw"


def test_custom_csv(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text("matrix,rows,cols,count\nq,32,32,2\nup,128,32,2\n")
    w = load_workload(p)
    assert w.name == "m" and len(w.params) == 4 and w.n_layers == 2


@pytest.mark.parametrize("text,msg", [
    ('[[matrices]]\nname = "a"\nrows = 0\ncols = 4\n', "rows must be a positive integer"),
    ('[[matrices]]\nname = "a"\nrows = 4.5\ncols = 4\n', "rows must be a positive integer"),
    ('[[matrices]]\nname = "a"\nrows = "x"\ncols = 4\n', "rows must be a positive integer"),
    ('[[matrices]]\nname = "a"\nrows = 4\ncols = -3\n', "cols must be a positive integer"),
    ('[[matrices]]\nname = "a"\nrows = 4\ncols = 4\nshape = 3\n', "unknown key 'shape'"),
    ('nam = "x"\n[[matrices]]\nname = "a"\nrows = 4\ncols = 4\n', "unknown key 'nam'"),
    ('name = "x"\n', "needs at least one"),
    ('[[matrices]\nname=', "malformed TOML"),
    ('[[matrices]]\nname = "a"\nrows = 4\ncols = 4\noptimizer = "sgd"\n', "accepted: muon, adamw"),
    ('[[matrices]]\nname = "a"\nrows = 4\ncols = 4\ncount = 3\n[[matrices]]\nname = "b"\nrows = 4\ncols = 4\n'
     'count = 2\n', None),
])
def test_custom_toml_errors(tmp_path, text, msg):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    if msg is None:  # counts 3 and 2: gcd 1 -> a single block holding 3 + 2 matrices: accepted
        w = load_workload(p)
        assert len(w.params) == 5
        return
    with pytest.raises(InputError, match=msg):
        load_workload(p)
    assert str(p) in str(pytest.raises(InputError, load_workload, p).value) or "malformed" in msg


def test_custom_csv_errors(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("matrix,rows\nq,3\n")
    with pytest.raises(InputError, match="missing column 'cols'"):
        load_workload(p)
    p.write_text("matrix,rows,cols,colour\nq,3,3,red\n")
    with pytest.raises(InputError, match="unknown column 'colour'"):
        load_workload(p)
    with pytest.raises(InputError, match="does not exist"):
        load_workload(tmp_path / "missing.toml")


def test_scaled_workload_keeps_structure():
    w = load_workload("qwen2.5-7b")
    s = w.scaled(1 / 16, blocks=4)
    assert s.n_layers == 6  # embedding, 4 blocks, head
    q = [p for p in s.params if p.matrix == "q_proj"]
    assert len(q) == 4 and (q[0].rows, q[0].cols) == (224, 224)
    gate = [p for p in s.params if p.matrix == "gate_proj"][0]
    assert (gate.rows, gate.cols) == (1184, 224)
    assert all(p.rows % 8 == 0 and p.cols % 8 == 0 for p in s.params)
    assert [p.layer for p in s.params] == sorted(p.layer for p in s.params)
    with pytest.raises(InputError, match="width_scale must be a finite number > 0"):
        w.scaled(0)
    with pytest.raises(InputError, match="blocks must be a positive integer"):
        w.scaled(0.5, blocks=0)
