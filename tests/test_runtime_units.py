"""Single-process tests of the runtime's pure pieces: buffer layouts, launch order of the backward hooks,
layer assignment, and the benchmark model's shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.runtime.exchange import OwnerLayout
from dmuon.runtime.groups import CommGroups, check_node_size
from dmuon.runtime.hooks import BackwardTracker
from dmuon.runtime.model import forward_layers


def _groups(world: int, node_size=None) -> CommGroups:
    return CommGroups(group=None, rank=0, world_size=world, global_ranks=tuple(range(world)),
                      node_size=node_size)


def _coverage(layout: OwnerLayout) -> list[list[int]]:
    """For each tensor, how many times each element is owned, and check buffer offsets are consistent."""
    counts = [[0] * n for n in layout.numels]
    used = set()
    for o, pieces in enumerate(layout.pieces):
        a, b = layout.chunk_start[o], layout.chunk_start[o] + layout.chunk_numel[o]
        for k, lo, hi, off in pieces:
            assert a <= off and off + (hi - lo) <= b, "piece outside its owner's chunk"
            assert off - lo == layout.offsets[k]
            for x in range(lo, hi):
                counts[k][x] += 1
            span = set(range(off, off + hi - lo))
            assert not span & used, "two pieces share buffer elements"
            used |= span
    assert max(used, default=-1) < layout.total
    return counts


@pytest.mark.parametrize("mode", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("world,node_size", [(1, None), (3, None), (4, None), (4, 2), (6, 3)])
def test_even_split_owns_every_element_exactly_once(mode, world, node_size):
    numels = [7, 1, 30, 5, 2]
    layout = OwnerLayout(numels, None, _groups(world, node_size), mode)
    assert all(c == [1] * n for c, n in zip(_coverage(layout), numels, strict=True))
    sizes = [layout.chunk_numel[o] for o in range(world)]
    assert max(sizes) - min(sizes) <= max(1, sum(numels) // world + 1)
    if mode == "reduce":
        assert layout.total == sum(numels)
    else:
        assert layout.total == world * layout.chunk_cap


@pytest.mark.parametrize("mode", ["reduce", "reduce_scatter"])
@pytest.mark.parametrize("world,node_size", [(2, None), (4, 2)])
def test_owner_layout_keeps_each_tensor_whole_in_its_owners_chunk(mode, world, node_size):
    numels, owners = [4, 9, 3, 6, 1], [1, 0, 1, world - 1, 0]
    layout = OwnerLayout(numels, owners, _groups(world, node_size), mode)
    assert all(c == [1] * n for c, n in zip(_coverage(layout), numels, strict=True))
    for k, o in enumerate(owners):
        assert [p[0] for p in layout.pieces[o]].count(k) == 1
        assert (k, 0, numels[k], layout.offsets[k]) in layout.pieces[o]


def test_two_level_slots_are_local_major():
    layout = OwnerLayout([8] * 4, [0, 1, 2, 3], _groups(4, node_size=2), "reduce_scatter")
    # ranks (node, local): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); slot = local * n_nodes + node
    assert layout.slot == [0, 2, 1, 3]
    assert [layout.chunk_start[o] // layout.chunk_cap for o in range(4)] == [0, 2, 1, 3]


def test_node_size_must_divide_the_world():
    from dmuon.errors import InputError

    assert check_node_size(None, 4) is None and check_node_size(2, 4) == 2
    with pytest.raises(InputError, match="does not divide"):
        check_node_size(3, 4)
    with pytest.raises(InputError, match="positive integer"):
        check_node_size(0, 4)


def test_forward_layers_group_blocks_and_keep_registration_order():
    names = ["embed.weight", "layers.0.attn.q.weight", "layers.0.mlp.up.weight", "layers.1.attn.q.weight",
             "layers.1.experts.3.w", "norm.weight", "lm_head.weight", "scale"]
    assert forward_layers(names) == [0, 1, 1, 2, 2, 3, 4, 5]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, use_b=True):
        x = self.a(x)
        if use_b:
            x = self.b(x)
        return self.c(x).sum()


def test_backward_tracker_launches_in_order_once_per_backward():
    net = _Net()
    launched = []
    units = [[net.c.weight, net.c.bias], [net.b.weight, net.b.bias], [net.a.weight, net.a.bias]]
    tracker = BackwardTracker(units, launched.append)
    net(torch.randn(2, 3)).backward()
    assert launched == [0, 1, 2]
    net(torch.randn(2, 3), use_b=False).backward()  # unit 1 unused: launched at the end of backward
    assert launched == [0, 1, 2, 0, 1, 2]
    tracker.finish()  # a round already ran since the last step: nothing more
    assert launched == [0, 1, 2, 0, 1, 2]
    with tracker.no_sync():
        net(torch.randn(2, 3)).backward()
    assert len(launched) == 6
    tracker.finish()  # nothing exchanged since the last step: step() runs the round
    assert launched[6:] == [0, 1, 2]
    tracker.remove()


def test_bench_model_has_the_workload_shapes_and_routing():
    from dmuon.params import route
    from simulator.models.benchmodel import build_bench_model, synthetic_batch
    from simulator.models.workload import load_workload

    w = load_workload("qwen2.5-7b").scaled(1 / 32, blocks=2)
    model = build_bench_model(w)
    shapes = sorted(tuple(s) for s in model.matrix_shapes().values())
    assert shapes == sorted((p.rows, p.cols) for p in w.params)
    routed = {r.name: r.use_muon for r in route(model)}
    assert sum(routed.values()) == len(w.muon_matrices)
    assert not routed["model.embed_tokens.weight"] and not routed["lm_head.weight"]
    x, y = synthetic_batch(model.vocab, 8, 2, seed=0, step=0, rank=0)
    loss = model(x, y)
    uniform = torch.log(torch.tensor(float(model.vocab))).item()
    assert torch.isfinite(loss) and abs(loss.item() - uniform) < 1.0  # small init: near-uniform logits


def test_bench_model_rejects_workloads_that_are_not_decoders():
    from dmuon.errors import InputError
    from simulator.models.benchmodel import decoder_spec
    from simulator.models.workload import load_workload

    with pytest.raises(InputError, match="decoder-only"):
        decoder_spec(load_workload("pi0"))
