"""Compiled MoE blocks on CPU: torch.compile traces every block of the MoE debug models whole
(no graph break in titan's code: the experts' grouped GEMM, the balancing loss, the routing
counts), with per-op activation checkpointing, LoRA experts, bf16 autocast, token dropping and
the router z-loss too, and the compiled step gives eager's loss and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from titan.components.lora.adapters import apply_lora, init_adapters
from titan.components.lora.spec import Lora
from titan.models.common.aux_loss import AuxLossCollector
from titan.models.spec import get_train_spec
from titan.parallelisms.activation_checkpoint import apply_ac
from titan.parallelisms.compile import compile_blocks
from titan.parallelisms.sections import ActivationCheckpoint

MODELS = {"qwen3_moe": ("qwen3", "debugmodel_moe"), "deepseek_v3": ("deepseek_v3", "debugmodel")}
SETUPS = {
    "plain": {},
    "per-op AC": {"ac": "op"},
    "LoRA experts": {"lora": [r"feed_forward\.experts\.w\d$", r"attention\.wo$"]},
    "bf16 autocast": {"autocast": True},
    # token dropping and the router z-loss
    "capacity, z-loss": {"args": {"moe_capacity_factor": 1.0, "moe_router_z_loss_coeff": 1e-3}},
}


def _model(family: str, flavor: str, setup: dict):
    spec = get_train_spec(family)
    args = spec.flavors[flavor].with_updates(max_seq_len=32, **setup.get("args", {}))
    model = spec.build_meta(args)
    if "lora" in setup:
        apply_lora(model, Lora(rank=4, target_modules=setup["lora"]))
    model.to_empty(device="cpu")
    model.init_weights(0)
    if "lora" in setup:
        init_adapters(model, 0)
        for p in (p for n, p in model.named_parameters() if "lora_b" in n):
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
    if "ac" in setup:
        apply_ac(model.layers, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    return model.train()


def _step(model, tokens, autocast=False):
    with AuxLossCollector(1.0) as aux:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), aux.floats(), grads


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_moe_blocks_compile_whole_and_match_eager(model_name, setup):
    family, flavor = MODELS[model_name]
    eager = _model(family, flavor, SETUPS[setup])
    compiled = _model(family, flavor, SETUPS[setup])
    # the trainer's call for MoE blocks (fullgraph off, so a break would be counted, not
    # raised); aot_eager traces forward and backward as inductor's would be, without its C++
    # build (tests/integration cover inductor)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled.layers, "aot_eager", fullgraph=False)
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(1))
    autocast = SETUPS[setup].get("autocast", False)
    want_loss, want_aux, want_grads = _step(eager, tokens, autocast)
    got_loss, got_aux, got_grads = _step(compiled, tokens, autocast)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # it compiled at all
    # the same ops in the same order (aot_eager's decompositions keep fp32 rounding to a few
    # ulps): the loss to 1e-6, each gradient to 1e-5 of its largest entry
    assert torch.allclose(got_loss, want_loss, rtol=1e-6)
    assert want_aux.keys() == got_aux.keys() and want_aux
    for name, v in want_aux.items():
        assert got_aux[name] == pytest.approx(v, rel=1e-6)
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        assert (got_grads[name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-12, name
