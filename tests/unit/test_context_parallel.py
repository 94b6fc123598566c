"""Context parallelism (ring attention) on CPU/gloo matches a single-process run.

Workers are forked from this already-imported process (tests/forked.py).

Loss reduction that makes CP equal to one process: each cp rank holds 1/cp of every
sequence's tokens (in head-tail order, with labels and the RoPE table sharded the same way).
Each rank computes sum-CE over its local tokens / the TOTAL token count of the unsharded
batch; SUM-all-reducing that over the cp group gives the global mean CE, and SUM-all-reducing
the parameter gradients gives the gradient of the global mean. (FSDP over dp_shard_cp
AVERAGES gradients instead, so there each rank divides by its LOCAL token count, total / cp:
the same result.)
"""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.forked import run_workers
from titan.models.llama3.args import Llama3Args
from titan.models.llama3.model import Transformer
from titan.parallelisms.context_parallel import check_torch_version, context_parallel_ctx

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

SEQ_LEN = 16
ARGS = Llama3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=SEQ_LEN
)  # RoPE table exactly seq_len long: CP shards it
CPU_OPS = (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)


# ----------------------------------------------------------------------------- cases


def _loss_sum(model, inputs, labels):
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def _model_and_batch():
    """The same model and batch on every rank."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ_LEN + 1))
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _cp_vs_single(rank, world_size, rotate_method):
    model, inputs, labels = _model_and_batch()
    total = labels.numel()

    ref_loss = _loss_sum(model, inputs, labels) / total
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    rope_before = model.rope.clone()
    with context_parallel_ctx(
        mesh,
        [inputs, labels, model.rope],
        [1, 1, 0],
        {inputs, labels},
        rotate_method=rotate_method,
        load_balance=True,
    ):
        assert inputs.shape == (2, SEQ_LEN // world_size)
        loss = _loss_sum(model, inputs, labels) / total  # local tokens / ALL tokens
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)  # SUM over cp ranks = global mean
    abs_diff, rel_diff = 0.0, 0.0
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)  # SUM over cp ranks = grad of the global mean
        d = (p.grad - ref_grads[n]).abs().max().item()
        abs_diff = max(abs_diff, d)
        rel_diff = max(rel_diff, d / ref_grads[n].abs().max().item())
    return dict(
        ref_loss=ref_loss.item(),
        cp_loss=loss.item(),
        grad_abs=abs_diff,
        grad_rel=rel_diff,
        rope_restored=torch.equal(model.rope, rope_before),
    )


@pytest.mark.parametrize("cp,rotate", [(2, "allgather"), (4, "allgather"), (2, "alltoall")])
def test_cp_matches_single_process(tmp_path, cp, rotate):
    for rank, r in enumerate(run_workers(_cp_vs_single, cp, tmp_path, rotate)):
        print(
            f"cp{cp} {rotate} rank{rank}: loss {r['cp_loss']:.8f} vs {r['ref_loss']:.8f} "
            f"(diff {abs(r['cp_loss'] - r['ref_loss']):.2e}), grad max abs diff "
            f"{r['grad_abs']:.2e}, max rel {r['grad_rel']:.2e}"
        )
        assert abs(r["cp_loss"] - r["ref_loss"]) < 1e-5
        assert r["grad_abs"] < 1e-5 and r["grad_rel"] < 1e-4
        assert r["rope_restored"]


def _most_collectives_in_flight(rank, world_size, rotate_method):
    """Forward+backward under CP, counting the ring's collectives issued but not yet awaited."""
    import torch.distributed._functional_collectives as ft_c

    in_flight, most = set(), [0]

    def issued(collective):
        def wrapper(*args, **kwargs):
            out = collective(*args, **kwargs)
            in_flight.add(out.elem.untyped_storage().data_ptr())
            most[0] = max(most[0], len(in_flight))
            return out

        return wrapper

    def awaited(tensor):
        in_flight.discard(tensor.untyped_storage().data_ptr())
        return wait_tensor(tensor)

    wait_tensor = ft_c.wait_tensor
    ft_c.permute_tensor = issued(ft_c.permute_tensor)  # the ring's two exchanges
    ft_c.all_gather_single = issued(ft_c.all_gather_single)
    ft_c.wait_tensor = awaited
    model, inputs, labels = _model_and_batch()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    with context_parallel_ctx(
        mesh,
        [inputs, labels, model.rope],
        [1, 1, 0],
        {inputs, labels},
        rotate_method=rotate_method,
        load_balance=True,
    ):
        _loss_sum(model, inputs, labels).backward()
    return most[0]


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_cpu_ring_keeps_one_exchange_in_flight(tmp_path, rotate):
    # torch's ring backward overlaps the K/V and dK/dV exchanges; two collectives in flight on
    # one gloo group corrupt the heap now and then (scripts/gloo_overlap_check.py)
    assert run_workers(_most_collectives_in_flight, 2, tmp_path, rotate) == [1, 1]


def _state():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    d = DTensor._op_dispatcher
    return dict(
        sdpa=F.scaled_dot_product_attention,
        create_rotater=ring._create_rotater,
        handlers={op: op in d._custom_op_handlers for op in CPU_OPS},
        strategies={op: op in d.sharding_propagator.op_strategy_funcs for op in CPU_OPS},
        options=(_cp_options.rotate_method, _cp_options.enable_load_balance),
    )


def _registration_scoped(rank, world_size):
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    before = _state()
    assert not any(before["handlers"].values()) and not any(before["strategies"].values())
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    dummy = torch.zeros(1, 8)

    with context_parallel_ctx(mesh, [dummy], [1], {dummy}, "alltoall", load_balance=True):
        inside = _state()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    assert all(inside["handlers"].values()) and inside["sdpa"] is not before["sdpa"]
    assert inside["create_rotater"] is not before["create_rotater"]
    assert not any(inside["strategies"].values())  # by design no sharding rule, even inside
    with pytest.raises(ZeroDivisionError):  # exits by exception restore the same way
        with context_parallel_ctx(mesh, [dummy], [1], {dummy}, "allgather", load_balance=False):
            _ = 1 / 0
    assert _state() == before

    # plain SDPA is plain again
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    ref = torch.softmax((q @ k.transpose(-1, -2) / 2).masked_fill(~mask, float("-inf")), -1) @ v
    torch.testing.assert_close(out, ref)
    # and a Shard(2) DTensor SDPA outside CP fails loudly instead of attending locally
    qd, kd, vd = (DTensor.from_local(t.detach(), mesh, [Shard(2)]) for t in (q, k, v))
    with pytest.raises(NotImplementedError, match="sharding strategy"):
        F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    return True


def test_cpu_registration_only_inside_context(tmp_path):
    assert run_workers(_registration_scoped, 2, tmp_path) == [True, True]


# ----------------------------------------------------------------------------- version


def test_version_check():
    check_torch_version("cpu", "2.13.0+cpu")
    check_torch_version("cuda", "2.11.0+cu128")
    check_torch_version("cuda", "2.13.1")
    for device, version in [
        ("cpu", "2.12.0"),
        ("cpu", "2.14.0.dev20261201"),
        ("cuda", "2.10.0"),
        ("cuda", "2.14.0"),
        ("cpu", "not-a-version"),
    ]:
        with pytest.raises(RuntimeError, match=rf"{device}.* with torch .*{version}") as e:
            check_torch_version(device, version)
        assert "_VERSIONS" in str(e.value) and "context_parallel_degree = 1" in str(e.value)
        # only CPU runs are recorded; the CUDA range must not claim a test
        assert ("was tested" in str(e.value)) == (device == "cpu")
