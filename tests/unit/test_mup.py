"""muP ([mup]): the width rules, the converter's model and optimizer changes, the coordinate
check's flatness under muP (and growth without it), the trainer's wiring and the refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.forked import TWO_RANK_LAYOUTS, run_trainer, tiny_run
from titan.components.mup import rules
from titan.components.mup.converter import MupConverter
from titan.components.optim.muon_spec import MuonOptions
from titan.components.optim.optimizer import build_optimizer
from titan.components.optim.optimizer_spec import Optimizer, ParamGroup
from titan.models.common.attention import Attention
from titan.models.spec import get_train_spec
from titan.tools import coord_check

ADAMW_ONLY = MuonOptions().adamw_params


def test_the_width_rules_of_adam_and_muon():
    m = 8.0
    hidden, emb, out, norm = (
        "layers.0.attention.wq.weight",
        "tok_embeddings.weight",
        "output.weight",
        "layers.0.ffn_norm.weight",
    )
    assert rules.init_scale(hidden, 2, m) == pytest.approx(m**-0.5)
    assert [rules.init_scale(n, d, m) for n, d in ((emb, 2), (out, 2), (norm, 1))] == [1, 1, 1]
    assert rules.lr_scale(hidden, 2, m, "AdamW") == 1 / m
    assert rules.lr_scale(hidden, 2, m, "Adam") == 1 / m
    for name, ndim in ((emb, 2), (out, 2), (norm, 1), ("layers.0.attention.wq.bias", 1)):
        for opt in ("AdamW", "Muon"):
            assert rules.lr_scale(name, ndim, m, opt, MuonOptions()) == 1.0
    # Muon's orthogonal update: no factor where its scale is width-free ("original"), and
    # 1/sqrt(m) where it grows as sqrt(max(rows, cols)) (match_rms_adamw)
    assert rules.lr_scale(hidden, 2, m, "Muon", MuonOptions(adjust_lr="original")) == 1.0
    assert rules.lr_scale(hidden, 2, m, "Muon", MuonOptions()) == pytest.approx(m**-0.5)
    # a matrix Muon leaves to its AdamW half follows Adam's rule
    adamw_half = MuonOptions(adamw_params=r"wq")
    assert rules.lr_scale(hidden, 2, m, "Muon", adamw_half) == 1 / m
    assert rules.q_scale(16, 16) == 1.0 and rules.q_scale(64, 16) == 0.5


def _model(
    width: int, base_width=None, family="llama3", flavor="debugmodel", seed=0, layers=2, **changes
):
    spec = get_train_spec(family)
    args = spec.flavors[flavor].with_updates(dim=width, max_seq_len=32, **changes)
    args = args.with_updates(n_layers=layers or args.n_layers)
    conv = MupConverter(base_width) if base_width else None
    model = spec.build_meta(args)
    if conv:
        conv.convert(model)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    if conv:
        conv.init_weights(model, seed)
    return model, conv


@pytest.mark.parametrize("family, flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel")])
def test_at_the_base_width_mup_is_the_standard_model(family, flavor):
    """m = 1: every factor is 1, so the same weights and the same logits, bit for bit."""
    plain, _ = _model(256, None, family, flavor)
    mup, conv = _model(256, 256, family, flavor)
    assert conv.m == 1.0 and mup.output_scale == 1.0
    tokens = torch.randint(0, 2048, (2, 16))
    assert torch.equal(plain(tokens), mup(tokens))


@pytest.mark.parametrize("family, flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel")])
def test_the_converter_sets_init_logit_and_attention_scales(family, flavor):
    plain, _ = _model(256, None, family, flavor)
    mup, conv = _model(256, 64, family, flavor)
    m = 4.0
    assert conv.m == m and mup.output_scale == 1 / m
    base_hd = mup.args.with_updates(dim=64).head_dim  # llama3: 64 / 16; qwen3: its fixed 32
    attn = [mod for mod in mup.modules() if isinstance(mod, Attention)]
    assert attn and all(a.q_scale == math.sqrt(base_hd / mup.args.head_dim) for a in attn)
    p, q = dict(plain.named_parameters()), dict(mup.named_parameters())
    for name, w in p.items():
        factor = m**-0.5 if rules.is_hidden(name, w.ndim) else 1.0
        assert torch.allclose(q[name], w * factor), name


def test_the_attention_scale_is_sqrt_base_head_dim_over_head_dim():
    """The query factor gives every attention path softmax scale sqrt(base_hd) / head_dim."""
    torch.manual_seed(0)
    attn = Attention(dim=32, n_heads=2, n_kv_heads=2, head_dim=16)
    attn.q_scale = rules.q_scale(16, 4)
    x, rope = torch.randn(1, 5, 32), torch.zeros(5, 8, 2)
    rope[..., 0] = 1  # cos 1, sin 0: no rotation
    out = attn(x, rope)
    q, k, v = (w(x).view(1, 5, 2, 16).transpose(1, 2) for w in (attn.wq, attn.wk, attn.wv))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=math.sqrt(4) / 16)
    assert torch.allclose(out, attn.wo(ref.transpose(1, 2).reshape(1, 5, 32)), atol=1e-6)


def test_the_optimizer_takes_each_parameters_factor():
    model, conv = _model(256, 64)
    cfg = Optimizer(
        lr=1e-2, param_groups=[ParamGroup(params=r"feed_forward\.w1", lr=2e-2)], weight_decay=0.0
    )
    opt = build_optimizer([model], cfg, {}, conv.lr_scale)
    lr_of = {n: g["lr"] for g in opt.param_groups for n in g["param_names"]}
    assert lr_of["layers.0.attention.wq.weight"] == pytest.approx(1e-2 / 4)
    assert lr_of["layers.0.feed_forward.w1.weight"] == pytest.approx(2e-2 / 4)  # its group's
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight"):
        assert lr_of[name] == 1e-2
    assert set(lr_of) == {n for n, _ in model.named_parameters()}


def _flat_and_growing(results: dict, steps: int) -> None:
    """The stated bound: over 8x the width, muP keeps every kind's change since init (and
    the hidden activations) within a factor 2; the standard parametrization's first update of
    each grows at least 4x (Adam's update moves a layer's output by ~lr x fan-in: m = 8)."""
    for step in range(1, steps):
        for kind in ("attention", "ffn", "residual", "logits"):
            r = coord_check.growth(results, "mup", kind + "_change", step)
            assert 0.5 <= r <= 2, (kind, step, r)
        for kind in ("attention", "ffn", "residual"):
            r = coord_check.growth(results, "mup", kind, step)
            assert 0.5 <= r <= 2, (kind, step, r)
    for kind in ("attention", "ffn", "residual", "logits"):
        r = coord_check.growth(results, "standard", kind + "_change", 1)
        assert r >= 4, (kind, r)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_coordinates_stay_flat_under_mup_and_grow_without(family):
    # llama3: 4 heads growing in width; qwen3: heads of a fixed width growing in number
    heads = 4 if family == "llama3" else None
    setup = coord_check.Setup(family=family, n_layers=2, n_heads=heads, seq_len=32, lr=3e-3)
    results = coord_check.run(setup, [64, 512], base_width=64, steps=4, batch_size=2)
    _flat_and_growing(results, 4)


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
def test_coordinates_stay_flat_under_mup_with_muon(adjust_lr):
    # one layer, two updates: Newton-Schulz on the width-512 matrices is most of the time
    setup = coord_check.Setup(
        n_layers=1, n_heads=4, seq_len=32, lr=3e-3, optimizer="Muon", adjust_lr=adjust_lr
    )
    results = coord_check.run(setup, [64, 512], base_width=64, steps=3, batch_size=2)
    for step in range(1, 3):
        for kind in ("attention", "ffn", "residual", "logits"):
            r = coord_check.growth(results, "mup", kind + "_change", step)
            assert 0.5 <= r <= 2, (kind, step, r)


def test_muon_match_rms_needs_its_sqrt_m_factor():
    """Without the 1/sqrt(m) (Muon's hidden lr as under "original"), the hidden layers'
    updates grow with the width again: ~sqrt(8) over 8x, past the factor-2 bound."""
    batch = coord_check.corpus_tokens(2 * 33).view(2, 33)
    setup = coord_check.Setup(n_layers=1, n_heads=4, seq_len=32, lr=3e-3, optimizer="Muon")
    changes = []
    for width in (64, 512):
        model, _ = coord_check.build(setup, width, 64)
        wrong = MupConverter(64, optimizer="Muon", muon=MuonOptions(adjust_lr="original"))
        wrong.m = width / 64
        cfg = Optimizer(name="Muon", lr=setup.lr, weight_decay=0.0)
        opt = build_optimizer(
            [model], cfg, {"muon": MuonOptions(ns_dtype="float32")}, wrong.lr_scale
        )
        changes.append(coord_check.coord_sizes(model, opt, batch, 2)[1]["ffn_change"])
    assert changes[1] / changes[0] > 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 steps of the debug model (dim 256): standard, muP at base width 256 and at 64."""
    tmp = tmp_path_factory.mktemp("mup")
    plain = run_trainer(tmp / "plain", 1, tiny_run(3), deadline_s=60)
    same = run_trainer(tmp / "m1", 1, [*tiny_run(3), "--mup.base_width", "256"])
    m4 = run_trainer(tmp / "m4", 1, [*tiny_run(3), "--mup.base_width", "64"])
    return plain, same, m4, (tmp / "m4" / "rank0.log").read_text()


def test_the_trainer_trains_with_mup(trained):
    """At base width = dim (m = 1) the run is the standard run bit for bit (the wiring adds
    nothing); at base width 64 (m = 4) it trains otherwise, and says what it applied."""
    plain, same, m4, log = trained
    assert [r["loss"] for r in same] == [r["loss"] for r in plain]
    assert all(math.isfinite(r["loss"]) for r in m4)
    assert [r["loss"] for r in m4] != [r["loss"] for r in plain]
    assert "muP: width multiplier 4 (base width 64): hidden init x 0.5, hidden lr x 0.25" in log


def test_a_resume_keeps_the_parametrization(tmp_path):
    """The checkpoint records muP's settings: the same ones resume it; another base width (or
    none) is refused in one line before any state loads (the weights would compute other
    outputs under other multipliers)."""
    ck = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    first = run_trainer(tmp_path, 1, [*tiny_run(2), *ck, "--mup.base_width", "64"])
    assert len(first) == 2
    for other in (["--mup.base_width", "128"], []):
        with pytest.raises(BaseException, match="its weights were trained parametrized as"):
            run_trainer(tmp_path, 1, [*tiny_run(4), *ck, *other])
    resumed = run_trainer(tmp_path, 1, [*tiny_run(4), *ck, "--mup.base_width", "64"])
    assert [r["step"] for r in resumed][-2:] == [3, 4]
    # generation and evaluation build the plain model: they refuse it, naming the export
    from titan.tools.generate import GenerateError, open_checkpoint

    with pytest.raises(GenerateError, match="was trained parametrized as .* export it"):
        open_checkpoint(str(tmp_path / "dump" / "checkpoint" / "step-4"), [])


@pytest.mark.needs("transformers")
def test_an_hf_export_computes_the_mup_model_in_transformers(tmp_path):
    """At lr 1e-30 (no float32 weight moves) the trained weights are the muP init, which the
    test rebuilds; the run's HF export, loaded by transformers, gives its logits, and its
    marker records no parametrization, so generation opens it."""
    import transformers

    from titan.components.checkpoint.trained_with import saved_trained_with
    from titan.tools.generate import open_checkpoint

    argv = [*tiny_run(2), "--mup.base_width", "64", "--optimizer.lr", "1e-30"]
    ck = ["--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.last_save_in_hf"]
    run_trainer(tmp_path, 1, [*argv, *ck, "--training.seed", "3"])
    export = tmp_path / "dump" / "checkpoint" / "step-2"
    assert saved_trained_with(export)["parametrization"] == {}
    open_checkpoint(str(export), [])  # not refused
    mup, _ = _model(256, 64, seed=3, layers=None)  # the flavor's, as trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    tokens = torch.randint(0, 2048, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, mup(tokens), rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_every_layout_trains_mup_as_one_rank(trained, tmp_path, layout):
    """The multipliers ride on the meta model into every stage and shard; the init scale is
    elementwise and the lr factors go by name."""
    argv = [*tiny_run(3), "--mup.base_width", "64", *TWO_RANK_LAYOUTS[layout]]
    rows = run_trainer(tmp_path, 2, argv, deadline_s=120)
    for a, b in zip(trained[2], rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.converters", "mup"], r"mup.base_width = 0 .*must be > 0"),
        (["--mup.base_width", "-1"], r"mup.base_width = -1 .*must be > 0"),
        (
            ["--mup.base_width", "64", "--lora.rank", "4"],
            r"lora.rank = 4 .*use one of them",
        ),
    ],
)
def test_bad_mup_settings_are_config_errors(flags, message):
    from titan.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(flags)


@pytest.mark.parametrize(
    "name, flavor", [("qwen3", "debugmodel_moe"), ("deepseek_v3", "debugmodel")]
)
def test_families_the_rules_do_not_cover_are_refused(name, flavor):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args(
        ["--model.name", name, "--model.flavor", flavor, "--mup.base_width", "64"]
        + ["--training.seq_len", "32"]
    )
    with pytest.raises(ConfigError, match=r"model.name .*muP supports the dense llama3 and qwen3"):
        plan_run(job, 1)


def test_an_export_of_a_tied_flavor_is_refused_before_launch():
    """The logit multiplier has no matrix of its own to fold into when the output is the
    embedding."""
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args(
        [*tiny_run(1), "--model.flavor", "debugmodel_tied", "--mup.base_width", "64"]
        + ["--checkpoint.enable", "--checkpoint.last_save_in_hf"]
    )
    with pytest.raises(ConfigError, match=r"last_save_in_hf .*embedding shares"):
        plan_run(job, 1)


@pytest.mark.parametrize("family, flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel")])
def test_folded_weights_compute_the_mup_model_plainly(family, flavor):
    """The export's weights (logit multiplier in the output matrix, attention scale in the
    query projection or its norm) in the plain model: the muP model's logits (float32
    rounding of one extra product each)."""
    from titan.components.checkpoint.train_state import ModelState

    untied = {"tie_word_embeddings": False}  # qwen3's debug model ties them
    mup, conv = _model(256, 64, family, flavor, seed=3, **untied)
    plain, _ = _model(256, None, family, flavor, **untied)
    folded = ModelState([mup], fold=lambda sd: conv.fold(sd, [mup])).exported(None)
    assert folded.folded
    plain.load_state_dict(folded.state_dict())
    tokens = torch.randint(0, 2048, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), mup(tokens), rtol=0, atol=1e-5)
        # not a vacuous equality: unfolded, the plain model computes other logits
        plain.load_state_dict(mup.state_dict())
        assert (plain(tokens) - mup(tokens)).abs().max() > 1e-2


def test_the_coord_check_cli_prints_its_tables_and_json(tmp_path, capsys):
    import json

    out = tmp_path / "coord.json"
    argv = ["--widths", "64,128", "--n_layers", "1", "--steps", "2", "--seq_len", "16"]
    assert coord_check.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mup       attention_change     1" in printed and "ratio" in printed
    assert set(json.loads(out.read_text())) == {"standard", "mup"}


@pytest.mark.needs("matplotlib")
def test_the_coord_check_plots_where_matplotlib_is(tmp_path):
    png = tmp_path / "coord.png"
    argv = ["--widths", "64,128", "--n_layers", "1", "--steps", "2", "--seq_len", "16"]
    assert coord_check.main([*argv, "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
