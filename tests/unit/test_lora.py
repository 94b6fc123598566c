"""LoRA: adapters on the targeted linear layers only, the base frozen; the merged model and the
PEFT adapter that peft loads onto transformers' model both compute titan's logits."""

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from titan.components.checkpoint import hf_io
from titan.components.lora.adapters import (
    LoRALinear,
    apply_lora,
    init_adapters,
    is_adapter,
    merged_state,
)
from titan.components.lora.peft_export import PeftExportError, write_peft_adapter
from titan.models.spec import get_train_spec

# per family: what the adapters target (MLA's projections; a shared expert's FFN)
TARGETS = {
    "llama3": [r"attention\.w\w*$", r"feed_forward\.w[123]$"],
    "qwen3": [r"attention\.w[qkvo]$", r"feed_forward\.w2$"],
    "deepseek_v3": [r"attention\.w\w*$"],  # MLA's projections
}


def load_hf(folder):
    """transformers' model of an HF folder, float32, eager attention, in eval mode."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="eager"
        ).eval()


def lora_cfg(targets, rank=4, alpha=8.0):
    return SimpleNamespace(rank=rank, alpha=alpha, dropout=0.0, target_modules=targets)


def adapted_model(family, seed=0):
    """The debug model with adapters, its B factors random (zero would hide them)."""
    spec = get_train_spec(family)
    args = spec.flavors["debugmodel"].with_updates(max_seq_len=32)
    model = spec.build_meta(args)
    names = apply_lora(model, lora_cfg(TARGETS[family]))
    model.to_empty(device="cpu")
    model.init_weights(seed, buffer_device=torch.device("cpu"))
    init_adapters(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.05)
    return spec, args, model.eval(), names


def test_only_the_targets_train():
    spec, args, model, names = adapted_model("llama3")
    assert len(names) == 7 * args.n_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}" for n in names for x in "ab"}
    assert all(is_adapter(n) for n in trainable)
    layer = model.get_submodule(names[0])
    assert layer.lora_a.shape == (4, layer.in_features)
    assert layer.lora_b.shape == (layer.out_features, 4)


def test_adapters_start_as_the_base_model_and_seed_by_name():
    spec, args, _, _ = adapted_model("llama3")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    base = spec.build_meta(args)
    base.to_empty(device="cpu")
    base.init_weights(0, buffer_device=torch.device("cpu"))
    fresh = spec.build_meta(args)
    apply_lora(fresh, lora_cfg(TARGETS["llama3"]))
    fresh.to_empty(device="cpu")
    fresh.init_weights(0, buffer_device=torch.device("cpu"))
    init_adapters(fresh, 0)
    with torch.no_grad():
        assert torch.equal(fresh(tokens), base(tokens))  # B = 0
    a = fresh.get_submodule("layers.0.attention.wq").lora_a
    assert a.abs().max() > 0
    assert not torch.equal(a, fresh.get_submodule("layers.1.attention.wq").lora_a)


@pytest.mark.parametrize("family", list(TARGETS))
def test_merged_state_computes_the_adapted_model(family):
    spec, args, model, _ = adapted_model(family)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = _plain_logits(spec, args, merged_state(model.state_dict(), [model]), tokens)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_routed_expert_adapters_merge_and_group_alike():
    """Adapters on each routed expert's w1/w2/w3 (and the shared expert's): the grouped GEMMs
    equal the one-expert-at-a-time products, and the merged weights compute the same model."""
    spec = get_train_spec("deepseek_v3")
    args = spec.flavors["debugmodel"].with_updates(max_seq_len=32)
    model = spec.build_meta(args)
    names = apply_lora(model, lora_cfg([r"experts\.w[123]$"]))
    assert "layers.1.feed_forward.experts.w2" in names
    assert "layers.1.feed_forward.shared_experts.w2" in names
    model.to_empty(device="cpu")
    model.init_weights(0, buffer_device=torch.device("cpu"))
    init_adapters(model, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_b" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    experts = model.get_submodule("layers.1.feed_forward.experts")
    assert experts.lora_a_w1.shape == (args.moe.n_experts, 4, args.dim)
    x = torch.randn(12, args.dim, generator=gen)
    counts = torch.tensor([3, 0, 5, 4] + [0] * (args.moe.n_experts - 4))
    with torch.no_grad():
        grouped = experts(x, counts)
        one_by_one = torch.cat(
            [experts._one(e, c) for e, c in enumerate(x.split(counts.tolist())) if len(c)]
        )
        torch.testing.assert_close(grouped, one_by_one, rtol=0, atol=1e-6)
        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
        merged = _plain_logits(spec, args, merged_state(model.state_dict(), [model]), tokens)
        torch.testing.assert_close(merged, model.eval()(tokens), rtol=0, atol=1e-5)
    with pytest.raises(PeftExportError, match="routed experts' weight"):
        write_peft_adapter(
            [model], lora_cfg([]), spec.state_dict_adapter(args), Path("/nonexistent")
        )


def _plain_logits(spec, args, state, tokens):
    plain = spec.build_meta(args)
    plain.to_empty(device="cpu")
    plain.init_weights(0, buffer_device=torch.device("cpu"))
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and all("rope" in k or "freqs" in k for k in missing), missing
    return plain.eval()(tokens)


@pytest.mark.needs("transformers", "peft")
@pytest.mark.parametrize("family", list(TARGETS))
def test_peft_and_merged_exports_give_titans_logits(family, tmp_path):
    import peft

    spec, args, model, names = adapted_model(family)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    state = model.state_dict()
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    hf_io.save_hf(base, spec, args, tmp_path / "base")
    hf_io.save_hf(merged_state(state, [model]), spec, args, tmp_path / "merged")
    adapter = write_peft_adapter(
        [model], lora_cfg(TARGETS[family]), spec.state_dict_adapter(args), tmp_path / "adapter"
    )
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert len(config["target_modules"]) == len(names)

    with torch.no_grad():
        ours = model(tokens)
        with_adapter = peft.PeftModel.from_pretrained(load_hf(tmp_path / "base"), str(adapter))
        peft_logits = with_adapter(tokens).logits
        merged_logits = load_hf(tmp_path / "merged")(tokens).logits
        base_logits = load_hf(tmp_path / "base")(tokens).logits
    torch.testing.assert_close(peft_logits, ours, rtol=0, atol=1e-4)
    torch.testing.assert_close(merged_logits, ours, rtol=0, atol=1e-4)
    assert (base_logits - ours).abs().max() > 1e-2  # the adapters change the function


def test_peft_refuses_ffn_adapters_of_a_model_with_experts(tmp_path):
    """PEFT reads gate/up/down_proj targets of an MoE model type as the routed experts'."""
    spec = get_train_spec("deepseek_v3")
    args = spec.flavors["debugmodel"]
    model = spec.build_meta(args)
    cfg = lora_cfg([r"shared_experts\.w2$"])
    apply_lora(model, cfg)
    model.to_empty(device="cpu")
    with pytest.raises(PeftExportError, match="routed experts"):
        write_peft_adapter([model], cfg, spec.state_dict_adapter(args), tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "targets, why",
    [
        ([r"attention\.wz$"], "match no linear layer"),
        ([r"attention$"], r"match layers\.0\.attention \(Attention\)"),
    ],
)
def test_bad_targets_are_named(targets, why):
    spec = get_train_spec("llama3")
    with pytest.raises(ValueError, match=why):
        apply_lora(spec.build_meta(spec.flavors["debugmodel"]), lora_cfg(targets))


def test_lora_linear_is_the_merged_linear():
    torch.manual_seed(0)
    layer = nn.Linear(12, 10)
    from titan.components.lora.adapters import add_adapter

    add_adapter(layer, 3, 6.0, 0.0)
    nn.init.normal_(layer.lora_a)
    nn.init.normal_(layer.lora_b)
    x = torch.randn(5, 12)
    merged = layer.weight + 2.0 * layer.lora_b @ layer.lora_a
    torch.testing.assert_close(layer(x), nn.functional.linear(x, merged, layer.bias))
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
