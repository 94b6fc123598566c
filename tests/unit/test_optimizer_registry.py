"""The optimizer registry is the one place the builder, the planner and the disk check learn
an optimizer from, and parameter groups by name set lr and weight decay per parameter."""

from dataclasses import dataclass

import pytest
import torch

from titan.components.checkpoint import disk_space
from titan.components.optim.lr_scheduler import build_lr_scheduler
from titan.components.optim.optimizer import build_optimizer, param_groups
from titan.components.optim.registry import OptimizerSpec, register_optimizer, unregister_optimizer
from titan.config import ConfigError, help_text, parse_args
from titan.config.job_config import opt
from titan.models.spec import get_train_spec
from titan.parallelisms.activation_checkpoint import apply_ac

LLAMA = get_train_spec("llama3")
ARGS = LLAMA.flavors["debugmodel"].with_updates(vocab_size=256, max_seq_len=16)
GROUPS = [
    "--optimizer.param_groups",
    '[{params = "norm|tok_embeddings", weight_decay = 0.0}, {params = "layers\\\\.0\\\\.",'
    " lr = 1e-5}]",
]


def model():
    m = LLAMA.build_meta(ARGS)
    m.to_empty(device="cpu")
    m.init_weights(0)
    return m


def test_groups_from_toml_tables_and_the_command_line_agree(tmp_path):
    path = tmp_path / "groups.toml"
    path.write_text(
        '[[optimizer.param_groups]]\nparams = "norm|tok_embeddings"\n'
        'weight_decay = 0.0\n[[optimizer.param_groups]]\nparams = "layers\\\\.0\\\\."'
        "\nlr = 1e-5\n"
    )
    from_file = parse_args(["--job.config_file", str(path)]).optimizer.param_groups
    assert from_file == parse_args(GROUPS).optimizer.param_groups
    assert [(g.params, g.lr, g.weight_decay) for g in from_file] == [
        ("norm|tok_embeddings", None, 0.0),
        ("layers\\.0\\.", 1e-5, None),
    ]


@pytest.mark.parametrize(
    "value,words",
    [
        ('[{params = "norm", decay = 0.0}]', "unknown key 'decay'"),
        ('[{params = "norm(", lr = 1.0}]', "does not compile"),
        ("[{lr = 1.0}]", "each group needs params"),
        ('[{params = "norm", lr = -1.0}]', "each group needs params"),
        ('{params = "norm"', "inline array of tables"),
    ],
)
def test_bad_groups_are_one_line_naming_the_key(value, words):
    with pytest.raises(ConfigError) as e:
        parse_args(["--optimizer.param_groups", value])
    assert "optimizer.param_groups" in str(e.value) and words in str(e.value)


def test_unknown_optimizer_names_the_registered_ones():
    with pytest.raises(ConfigError) as e:
        parse_args(["--optimizer.name", "adamw"])
    assert "registered: AdamW, Adam" in str(e.value) and "did you mean 'AdamW'" in str(e.value)


def test_first_matching_group_takes_a_parameter_and_sets_its_lr_and_decay():
    job = parse_args(
        [
            *GROUPS,
            "--optimizer.lr",
            "1e-3",
            "--lr_scheduler.warmup_steps",
            "0",
            "--lr_scheduler.decay_ratio",
            "0",
        ]
    )
    m = model()
    job_ac = parse_args(["--activation_checkpoint.mode", "full"])
    apply_ac(m.layers, job_ac.activation_checkpoint)  # wrappers' names are not parameters'
    assert any("_checkpoint_wrapped_module" in n for n, _ in m.named_parameters())
    groups = param_groups(m, job.optimizer)
    names = [g["param_names"] for g in groups]
    assert all("_checkpoint_wrapped_module" not in n for g in names for n in g)
    assert "layers.0.attention_norm.weight" in names[0] and "tok_embeddings.weight" in names[0]
    assert "layers.0.attention.wq.weight" in names[1] and "layers.1.attention.wq.weight" in names[2]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.0), (1e-5, 0.1), (1e-3, 0.1)]
    opt = build_optimizer([m], job.optimizer, job.extensions)
    build_lr_scheduler(opt, job.lr_scheduler, 10)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-5, 1e-3]
    # a zero gradient: only decay moves a weight, and the norms are not decayed
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(m.named_parameters())
    assert after["norm.weight"].equal(before["norm.weight"])
    assert not after["output.weight"].equal(before["output.weight"])


@dataclass
class HeavyBallOptions:
    momentum: float = opt(0.9, "Momentum of the heavy ball")


def _heavy_ball_bytes(name, shape, elements, cfg, options):
    return 4 * elements  # one momentum buffer, no step count


def build_heavy_ball(groups, cfg, options):
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=options.momentum)


def _check_heavy_ball(job):
    from titan.config.manager import require

    require(job, 0 <= job.heavy_ball.momentum < 1, "heavy_ball.momentum", "must lie in [0, 1)")


@pytest.fixture
def heavy_ball():
    register_optimizer(
        OptimizerSpec(
            "HeavyBall",
            build=f"{__name__}:build_heavy_ball",
            state_bytes=_heavy_ball_bytes,
            check=_check_heavy_ball,
            section="heavy_ball",
            options=HeavyBallOptions,
        )
    )
    yield
    unregister_optimizer("HeavyBall")


def test_a_registered_optimizer_is_built_planned_and_sized_from_its_entry(heavy_ball):
    from titan.planner.memory import state_bytes

    assert "--heavy_ball.momentum" in help_text()
    with pytest.raises(ConfigError, match="heavy_ball.momentum = 1.5"):
        parse_args(["--optimizer.name", "HeavyBall", "--heavy_ball.momentum", "1.5"])
    job = parse_args(["--optimizer.name", "HeavyBall", "--heavy_ball.momentum", "0.5"])
    m = model()
    opt = build_optimizer([m], job.optimizer, job.extensions)
    assert opt.optimizers[0].param_groups[0]["momentum"] == 0.5
    n = ARGS.num_params()
    assert state_bytes([LLAMA.build_meta(ARGS)], job)["optimizer_bytes"] == 4 * n
    need = disk_space.model_save_bytes(LLAMA.build_meta(ARGS), job.optimizer, job.extensions)
    assert need == int(8 * n * disk_space.OVERHEAD_FACTOR) + disk_space.OVERHEAD_BYTES
