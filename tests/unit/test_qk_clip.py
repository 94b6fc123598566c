"""QK-clip (`optimizer.qk_clip_threshold`): each head's largest logit against the scores
written out (causal, windowed, document masks; grouped keys), one clip bringing a head's
largest logit on the same inputs to tau by the formula (MHA, GQA with biases, MLA with and
without a query bottleneck), and every layout clipping as 1 rank does."""

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.forked import run_trainer, tiny_run
from tests.layouts import degrees
from titan.components.optim.qk_clip import scale_rows_
from titan.config import ConfigError, parse_args
from titan.models.common import logit_max
from titan.models.common.attention import Attention
from titan.models.common.aux_loss import AuxLossCollector
from titan.models.common.documents import block_causal_block_mask, block_causal_mask
from titan.models.common.rope import inverse_frequencies, rope_table
from titan.models.deepseek_v3.mla import MLA

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")


def written_out(q, k, scale, allowed) -> torch.Tensor:
    """Each head's largest allowed logit, one score at a time."""
    batch, queries, heads, _ = q.shape
    group = heads // k.shape[2]
    best = torch.full((heads,), float("-inf"))
    for h in range(heads):
        for b in range(batch):
            for i in range(queries):
                for j in range(k.shape[1]):
                    if allowed[b if allowed.shape[0] > 1 else 0, 0, i, j]:
                        s = scale * torch.dot(q[b, i, h], k[b, j, h // group])
                        best[h] = max(best[h], s)
    return best


def doc_ids() -> torch.Tensor:
    return torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])


@pytest.mark.parametrize("mask", ["causal", "causal_blocks", "window", "bool", "block"])
def test_each_heads_largest_logit_over_its_allowed_pairs(mask, monkeypatch):
    monkeypatch.setitem(logit_max.BLOCK_SCORES, "cpu", 2 * 4 * 8 * 3)  # 3 queries a block
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 4, 5, generator=gen), torch.randn(2, 8, 2, 5, generator=gen)
    window = 3 if mask == "window" else None
    given = {
        "causal": None,
        "causal_blocks": None,
        "window": None,
        "bool": block_causal_mask(doc_ids()),
        "block": block_causal_block_mask(doc_ids()),
    }[mask]
    full = logit_max.allowed_pairs(given, 0, 8, 8, "cpu", window)
    if mask == "window":
        i = torch.arange(8)
        assert torch.equal(full[0, 0], (i[:, None] >= i) & (i[:, None] - i < 3))
    if mask in ("bool", "block"):
        assert torch.equal(full, block_causal_mask(doc_ids()))

    def allowed(lo, hi):
        return logit_max.allowed_pairs(given, lo, hi, 8, "cpu", window)

    # causal_blocks: the keys before each block unmasked, its own square masked
    got = logit_max.head_logit_max(q, k, 0.5, allowed, causal=mask == "causal_blocks")
    torch.testing.assert_close(got, written_out(q, k, 0.5, full), rtol=1e-6, atol=0)


def attention(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mha":
        m = Attention(16, 4, 4, 4)
    elif kind == "gqa_bias":
        m = Attention(16, 4, 2, 4, bias=True, sliding_window=5)
    elif kind == "mla":
        m = MLA(16, 4, 0, 6, 4, 2, 3, softmax_scale=0.3)
    else:
        m = MLA(16, 4, 8, 6, 4, 2, 3, softmax_scale=0.3)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.6)
    m.track_logit_max()
    return m


def rope_cache(head_dim: int, seq: int) -> torch.Tensor:
    return rope_table(inverse_frequencies(head_dim, 10000.0), seq)


def largest_logits(m, x, rope) -> torch.Tensor:
    m.logit_max.fill_(float("-inf"))
    with AuxLossCollector(1.0):  # a training step's forward
        m(x, rope)
    return m.logit_max.clone()


@pytest.mark.parametrize("kind", ["mha", "gqa_bias", "mla", "mla_q_lora"])
def test_one_clip_brings_each_head_over_tau_to_tau(kind):
    m = attention(kind)
    rope_dim = 4 if isinstance(m, Attention) else 2
    rope = rope_cache(rope_dim, 10)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    before = largest_logits(m, x, rope)
    tau = before.median().item()
    over = before > tau
    assert 0 < over.sum() < len(before)
    gamma = torch.where(over, tau / before, torch.ones_like(before))
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        for name, factors in m.qk_clip_scales(gamma).items():
            scale_rows_(m.get_parameter(name), factors)
    after = largest_logits(m, x, rope)
    want = torch.where(over, torch.full_like(before, tau), before)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=0)
    # the rows of the heads under tau, the values and the output did not move
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, weights[n])}
    assert changed == set(m.qk_clip_scales(gamma)), changed
    if kind == "mha":  # sqrt(gamma) on each head's query and key rows
        root = gamma.sqrt().repeat_interleave(4)[:, None]
        torch.testing.assert_close(m.wq.weight, weights["wq.weight"] * root)
        torch.testing.assert_close(m.wk.weight, weights["wk.weight"] * root)


def test_only_a_training_steps_forward_is_recorded():
    m = attention("mha")
    x, rope = torch.randn(1, 6, 16), rope_cache(4, 10)
    m(x, rope)  # validation, generation, a pipeline stage's shape inference
    with AuxLossCollector(1.0), torch.no_grad():
        m(x, rope)
    assert torch.isinf(m.logit_max).all()
    with AuxLossCollector(1.0):
        m(x, rope)
    assert torch.isfinite(m.logit_max).all()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--optimizer.qk_clip_threshold", "-1"], "must be > 0"),
        (
            ["--optimizer.qk_clip_threshold", "50", "--parallelism.context_parallel_degree", "2"],
            "context_parallel_degree = 1",
        ),
    ],
)
def test_bad_settings_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(flags)


def test_a_converter_that_freezes_the_weights_it_rescales_is_refused_when_planned():
    """Found by what the other converter does (it trains only its own parameters), not by its
    name."""
    from titan.plan.run_plan import plan_run

    job = parse_args(["--optimizer.qk_clip_threshold", "50", "--lora.rank", "4"])
    with pytest.raises(ConfigError, match=r"only its own parameters \(LoraConverter\) freezes"):
        plan_run(job, 1)


def test_a_model_with_q_k_norms_is_refused():
    from titan.components.optim.qk_clip_spec import plan_check
    from titan.models.spec import get_train_spec

    job = parse_args(["--model.name", "qwen3", "--optimizer.qk_clip_threshold", "50"])
    spec = get_train_spec("qwen3")
    with pytest.raises(ConfigError, match="q/k RMSNorm"):
        plan_check(job, SimpleNamespace(spec=spec, model_args=spec.flavors["debugmodel"]))


# the debug model's largest logits start near 0.5 and grow: a tau they pass every step
TAU = "0.3"
ARGV = [*tiny_run(6), "--optimizer.qk_clip_threshold", TAU, "--metrics.log_freq", "1"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_trainer(tmp_path_factory.mktemp("one"), 1, ARGV, deadline_s=120)


def test_heads_are_clipped_and_logged(one_rank, tmp_path):
    assert all(r["qk_max"] > float(TAU) and r["qk_clipped_heads"] >= 1 for r in one_rank)
    off = run_trainer(tmp_path, 1, [*ARGV, "--optimizer.qk_clip_threshold", "0"], deadline_s=120)
    assert "qk_max" not in off[0]
    # the first step's forward is the same; the clip changes what follows
    assert off[0]["loss"] == one_rank[0]["loss"]
    assert off[-1]["loss"] != one_rank[-1]["loss"]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
LAYOUTS = {  # name: (ranks, flags)
    "fsdp2": (2, FSDP2),
    "tp2": (2, TP2),
    "pp2": (2, degrees(pipeline_parallel=2)),
    "fsdp2_tp2": (4, [*FSDP2, *TP2]),  # the query rows sharded twice (FSDP's strided shards)
    "full_ac_compiled": (1, ["--activation_checkpoint.mode", "full", "--compile.enable"]),
}


def assert_clipped_alike(want: list[dict], got: list[dict], name: str) -> None:
    for a, b in zip(want, got, strict=True):
        for key in ("loss", "qk_max"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (name, key, a, b)
        assert a["qk_clipped_heads"] == b["qk_clipped_heads"], (name, a, b)


@pytest.mark.slow("four trainings of 2 or 4 ranks and a compiled one, 6 steps each")
def test_every_layout_clips_as_one_rank_does(one_rank, tmp_path):
    for name, (ranks, flags) in LAYOUTS.items():
        got = run_trainer(tmp_path / name, ranks, [*ARGV, *flags], deadline_s=300)
        assert_clipped_alike(one_rank, got, name)


VARIANTS = {
    # MLA: the query's and key's parts without position, the rotated query part
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
    # grouped keys, biases, sinks, sliding windows
    "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"],
    "muon": ["--optimizer.name", "Muon", "--muon.ns_dtype", "float32"],
}


@pytest.mark.slow("a 1-rank and a 2-rank training of 6 steps")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_attention_and_muon_clip_alike_with_heads_split(variant, tmp_path):
    argv = [*ARGV, *VARIANTS[variant]]
    want = run_trainer(tmp_path / "one", 1, argv, deadline_s=300)
    assert sum(r["qk_clipped_heads"] for r in want) >= 1
    assert_clipped_alike(
        want, run_trainer(tmp_path / "tp2", 2, [*argv, *TP2], deadline_s=300), variant
    )
