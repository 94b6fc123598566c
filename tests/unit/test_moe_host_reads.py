"""No host reads in an eager MoE training step: DeepSeek-V3's and Qwen3-MoE's debug models,
forward and backward (balancing losses included) and the balancing hook after the optimizer
step (DeepSeek's bias update, the load statistics), in float32 and under bf16 autocast, never
copy a value out of a tensor nor run an op whose output size depends on the values: on a GPU
none of them waits for the device. The load figures are read once, when the step is logged.

Under expert parallelism the all-to-all's split sizes are the one read per MoE layer (see
titan/parallelisms/expert_parallel.py); tests/unit/test_compile_moe.py shows the same blocks
compile without a graph break."""

import pytest
import torch
import torch.nn.functional as F

from tests.dispatch_count import DispatchCount
from titan.components.observability.metrics import on_host
from titan.config import parse_args
from titan.models.common.aux_loss import AuxLossCollector
from titan.models.common.moe_balance import moe_balance_hook
from titan.models.spec import get_train_spec

MODELS = {"qwen3_moe": ("qwen3", "debugmodel_moe"), "deepseek_v3": ("deepseek_v3", "debugmodel")}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_an_moe_step_reads_nothing_on_the_host_until_logged(model_name, autocast):
    family, flavor = MODELS[model_name]
    spec = get_train_spec(family)
    args = spec.flavors[flavor].with_updates(max_seq_len=32)
    model = spec.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.train()
    hook = moe_balance_hook([model], parse_args([]))
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    count = DispatchCount()
    with count, AuxLossCollector(1.0), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    with count:
        loss.backward()
        metrics = hook(True)
    assert count.ops["aten._grouped_mm"] >= 3  # the experts' path this test is about
    assert count.host_reads == [] and count.tolist == 0, count.host_reads
    # DeepSeek's bias moved on the device
    if args.moe_args().score_bias:
        assert any(m.router.expert_bias.abs().sum() > 0 for m in _moes(model))
    with count:
        logged = on_host(metrics)
    assert count.tolist == 1 and count.host_reads == []  # one copy for all the figures
    moe_layers = [i for i in range(args.block_count()) if args.is_moe_layer(i)]
    assert logged.keys() == {"expert_load_imbalance"} | {
        f"expert_load/layer_{i}" for i in moe_layers
    }
    assert isinstance(logged["expert_load_imbalance"], float)
    for i in moe_layers:
        share = logged[f"expert_load/layer_{i}"]
        assert len(share) == args.moe_args().n_experts and sum(share) == pytest.approx(1.0)


def _moes(model):
    from titan.models.common.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]
