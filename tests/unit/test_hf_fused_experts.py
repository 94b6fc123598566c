"""HF layouts that hold every expert in one tensor (GPT-OSS's: gate and up interleaved in
gate_up_proj, each expert's matrix stored (in, out), biases beside): the adapter option
`fused_expert_names` maps titan's stacked experts to and from them, whole and sharded over
experts."""

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.forked import run_workers
from titan.models.common.hf_adapter import DecoderHFAdapter, FusedExperts

E, DIM, HIDDEN = 4, 6, 5
PREFIX = "layers.0.feed_forward.experts."


class FusedAdapter(DecoderHFAdapter):
    fused_expert_names = {
        "mlp.experts.gate_up_proj": FusedExperts(
            ("feed_forward.experts.w1", "feed_forward.experts.w3"), transposed=True
        ),
        "mlp.experts.gate_up_proj_bias": FusedExperts(
            ("feed_forward.experts.b1", "feed_forward.experts.b3")
        ),
        "mlp.experts.down_proj": FusedExperts(("feed_forward.experts.w2",), transposed=True),
        "mlp.experts.down_proj_bias": FusedExperts(("feed_forward.experts.b2",)),
    }


ADAPTER = FusedAdapter(SimpleNamespace(tie_word_embeddings=False))


def titan_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "w1": (E, HIDDEN, DIM),
        "w3": (E, HIDDEN, DIM),
        "w2": (E, DIM, HIDDEN),
        "b1": (E, HIDDEN),
        "b3": (E, HIDDEN),
        "b2": (E, DIM),
    }
    return {PREFIX + k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_the_hub_layout_is_gpt_oss_s_and_comes_back_exactly():
    state = titan_state()
    hf = ADAPTER.to_hf(state)
    layer = "model.layers.0.mlp.experts."
    gate_up, down = hf[layer + "gate_up_proj"], hf[layer + "down_proj"]
    assert gate_up.shape == (E, DIM, 2 * HIDDEN) and down.shape == (E, HIDDEN, DIM)
    # x @ gate_up[e]: even columns are the gate's, odd the up projection's
    x = torch.randn(3, DIM)
    for e in range(E):
        assert torch.allclose((x @ gate_up[e])[:, 0::2], x @ state[PREFIX + "w1"][e].T)
        assert torch.allclose((x @ gate_up[e])[:, 1::2], x @ state[PREFIX + "w3"][e].T)
        assert torch.equal(down[e], state[PREFIX + "w2"][e].T)
    bias = hf[layer + "gate_up_proj_bias"]
    assert torch.equal(bias[:, 0::2], state[PREFIX + "b1"])
    assert torch.equal(bias[:, 1::2], state[PREFIX + "b3"])
    back = ADAPTER.from_hf(hf)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # the planning pass of an HF load runs on meta tensors
    meta = ADAPTER.from_hf({k: torch.empty(v.shape, device="meta") for k, v in hf.items()})
    assert {k: v.shape for k, v in meta.items()} == {k: v.shape for k, v in state.items()}


def test_a_missing_part_is_named():
    state = titan_state()
    del state[PREFIX + "w3"]
    with pytest.raises(KeyError, match="gate_up_proj"):
        ADAPTER.to_hf(state)


def _sharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    whole = titan_state()
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in whole.items()}
    hf = ADAPTER.to_hf(sharded)
    full_hf = ADAPTER.to_hf(whole)
    same_hf = all(torch.equal(hf[k].full_tensor(), full_hf[k]) for k in full_hf)
    back = ADAPTER.from_hf(hf)
    same_back = all(
        back[k].placements == sharded[k].placements and torch.equal(back[k].full_tensor(), whole[k])
        for k in whole
    )
    return same_hf, same_back


@pytest.mark.skipif(sys.platform != "linux", reason="needs fork")
def test_sharded_over_experts_each_rank_maps_its_own_rows(tmp_path):
    assert run_workers(_sharded, 2, tmp_path) == [(True, True), (True, True)]
