"""PaLM's z-loss (`training.z_loss_weight`): the summed log(Z)^2 of the counted tokens against
the formula, a term of the objective (weighted in backward, logged unweighted as `z_loss`),
computed chunk by chunk under the chunked loss and shard by shard over a vocabulary-parallel
DTensor (all-reduces only, never the whole logits); every layout logs 1 rank's z-loss."""

import sys

import pytest
import torch

from tests.forked import run_trainer, run_workers, tiny_run
from tests.layouts import layouts
from titan.components.training.chunked_loss import apply_chunked_loss
from titan.components.training.loss import IGNORE_INDEX, z_loss_sum
from titan.components.training.objective import Objective
from titan.components.training.z_loss import ZLoss
from titan.config import ConfigError, parse_args
from titan.parallelisms.token_split import TokenSplit

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")


def data(seed=0, batch=2, seq=6, vocab=11, dim=8):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, dim, generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, 1] = labels[1, 4] = IGNORE_INDEX
    return h, labels, torch.nn.Linear(dim, vocab, bias=False)


def test_the_sum_is_log_z_squared_over_counted_tokens():
    h, labels, out = data()
    logits = out(h) * 20  # large logits: the max is taken out before exp
    want = sum(
        torch.logsumexp(logits[b, s].double(), -1) ** 2
        for b in range(2)
        for s in range(6)
        if labels[b, s] != IGNORE_INDEX
    )
    assert z_loss_sum(logits, labels).item() == pytest.approx(want.item(), rel=1e-6)
    # bf16 logits are summed in float32
    assert z_loss_sum(logits.bfloat16(), labels).dtype == torch.float32


def test_the_objective_weights_it_in_backward_and_logs_it_unweighted():
    h, labels, out = data()
    objective = Objective({"z_loss": ZLoss(1e-2)}, tokens_per_rank_step=10, cp=1)
    split = TokenSplit()
    with objective.step(1.0, split):
        loss = objective.loss(out(h), labels)
    logits = out(h)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    z = z_loss_sum(logits, labels)
    assert loss.item() == pytest.approx((ce + 1e-2 * z).item() / 10, rel=1e-6)
    logged = objective.named(objective.reduce(None, None))
    assert logged["z_loss"] == pytest.approx(z.item() / 10, rel=1e-6)
    assert logged["loss"] == pytest.approx(ce.item() / 10, rel=1e-6)


def test_the_chunked_loss_computes_it_chunk_by_chunk():
    h, labels, out = data(seq=7)
    z_term = ZLoss(1e-2)
    model = torch.nn.Module()
    model.output = out
    logits = out(h)
    whole = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="sum"
    ) + 1e-2 * z_loss_sum(logits, labels)
    whole.backward()
    want_grad, out.weight.grad = out.weight.grad.clone(), None
    apply_chunked_loss(model, chunk_tokens=4, terms=(z_term,))  # 14 tokens: chunks 4, 4, 4, 2
    sums = model.output(h, labels)
    assert sums.shape == (2,)
    objective = Objective({"z_loss": z_term}, tokens_per_rank_step=1, cp=1, output_sums=True)
    objective.loss(sums, labels).backward()
    assert sums[1].item() == pytest.approx(z_loss_sum(logits, labels).item(), rel=1e-6)
    torch.testing.assert_close(out.weight.grad, want_grad, rtol=1e-5, atol=1e-6)


def _vocab_parallel(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    h, labels, out = data(vocab=12)
    whole = out(h).detach().requires_grad_()
    sharded = distribute_tensor(whole.detach(), mesh, [Shard(-1)]).requires_grad_()
    with CommDebugMode() as comm:
        z = z_loss_sum(sharded, labels)
        z.backward()
    want = z_loss_sum(whole, labels)
    want.backward()
    grad = sharded.grad.full_tensor()
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    return z.full_tensor().item(), want.item(), (grad - whole.grad).abs().max().item(), counts


def test_vocabulary_parallel_logits_are_reduced_shard_by_shard(tmp_path):
    for z, want, grad_err, comms in run_workers(_vocab_parallel, 2, tmp_path, barrier=False):
        assert z == pytest.approx(want, rel=1e-6) and grad_err < 1e-6
        assert set(comms) == {"c10d_functional.all_reduce"}, comms  # no all-gather


def test_a_negative_weight_is_a_config_error():
    with pytest.raises(ConfigError, match="training.z_loss_weight.*must be >= 0"):
        parse_args(["--training.z_loss_weight", "-1"])


Z = ["--training.z_loss_weight", "1e-3"]
LAYOUTS = {
    **layouts("fsdp2", "tp2", "pp2"),
    "chunked": (1, ["--training.loss_chunk_tokens", "24"]),
}


@pytest.mark.slow("four short trainings, three of 2 ranks")
def test_every_layout_trains_and_logs_the_z_loss_of_one_rank(tmp_path):
    argv = [*tiny_run(4), *Z]
    want = run_trainer(tmp_path / "one", 1, argv)
    assert all(r["z_loss"] > 0 for r in want)
    for name, (world, flags) in LAYOUTS.items():
        got = run_trainer(tmp_path / name, world, [*argv, *flags], deadline_s=120)
        for a, b in zip(want, got, strict=True):
            for key in ("loss", "z_loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (name, key, a, b)
