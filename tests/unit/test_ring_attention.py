"""Ring attention with masks by position (titan.parallelisms.ring_attention): on CP 2 and 4
with head-tail load balancing, documents, GQA, sinks and tiles small enough that some are
skipped, each rank's output and the gradients of its queries, keys, values and the sinks
equal attention over the whole sequence on one process (float64: to rounding)."""

import sys

import pytest

from tests.forked import run_workers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")


def _ring_vs_whole(rank, world_size, tile):
    import torch
    import torch.distributed as dist

    from titan.models.common import masked_attention as written_out
    from titan.parallelisms import ring_attention
    from titan.parallelisms.ring_attention import ring_masked_attention

    ring_attention._TILE = tile  # small: many tiles, some masked out whole
    torch.manual_seed(0)  # every rank draws the whole problem alike
    b, h, kv_heads, seq, d, dv = 2, 4, 2, 24, 8, 6
    f64 = {"dtype": torch.float64}
    q, k = torch.randn(b, h, seq, d, **f64), torch.randn(b, kv_heads, seq, d, **f64)
    v, sinks = torch.randn(b, kv_heads, seq, dv, **f64), torch.randn(h, **f64)
    grad = torch.randn(b, h, seq, dv, **f64)
    docs = torch.tensor([0] * 5 + [1] * 3 + [2] * 13 + [3] * 3)
    pos = torch.arange(seq)
    mask = (pos[:, None] >= pos[None, :]) & (docs[:, None] == docs[None, :])
    mask = mask[None, None].expand(b, 1, seq, seq)
    # head-tail balancing: 2 x cp chunks, rank r holds chunks r and 2 cp - 1 - r
    c = seq // (2 * world_size)

    def held(r):
        return torch.cat([pos[r * c : (r + 1) * c], pos[(2 * world_size - 1 - r) * c :][:c]])

    mine, every = held(rank), torch.cat([held(r) for r in range(world_size)])
    errors = []
    for with_sinks in (False, True):
        whole = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        ref = written_out.masked_attention(*whole[:3], mask, whole[3] if with_sinks else None)
        (ref * grad).sum().backward()
        local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
        s = sinks.clone().requires_grad_(True)
        out = ring_masked_attention(
            *local, mask[:, :, mine][..., every], dist.group.WORLD, s if with_sinks else None
        )
        (out * grad[:, :, mine]).sum().backward()
        pairs = [(out, ref[:, :, mine])]
        pairs += [(x.grad, w.grad[:, :, mine]) for x, w in zip(local, whole[:3], strict=True)]
        if with_sinks:
            dist.all_reduce(s.grad)  # each rank's rows' share of the sink's gradient
            pairs.append((s.grad, whole[3].grad))
        errors.append(max((a - e).abs().max().item() for a, e in pairs))
    return errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("tile", [256, 2])
def test_ring_attention_equals_attention_over_the_whole_sequence(cp, tile, tmp_path):
    for rank, errors in enumerate(run_workers(_ring_vs_whole, cp, tmp_path, tile)):
        assert max(errors) < 1e-12, (rank, errors)
