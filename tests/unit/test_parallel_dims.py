"""Parallel degrees, model/batch checks, and preflight's run plan."""

import pytest

from titan.config import ConfigError, parse_args
from titan.models.llama3.args import Llama3Args
from titan.parallelisms.parallel_dims import ParallelDims, ParallelismError, validate_against_model
from titan.plan.run_plan import plan_run


def dims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, world_size=8):
    return ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world_size
    )


# ----------------------------------------------------------------------------- ParallelDims


@pytest.mark.parametrize(
    "kw,shard",
    [
        (dict(world_size=8), 8),
        (dict(tp=2, world_size=8), 4),
        (dict(dp_replicate=2, tp=2, world_size=8), 2),
        (dict(cp=2, pp=2, world_size=8), 2),
        (dict(tp=8, world_size=8), 1),
        (dict(world_size=1), 1),
    ],
)
def test_fill_minus_one(kw, shard):
    d = dims(**kw)
    assert d.dp_shard == shard
    assert d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp == d.world_size
    assert d.dp == d.dp_replicate * d.dp_shard


def test_enabled_flags():
    d = dims(dp_replicate=2, tp=2, world_size=8)
    assert d.dp == 4 and d.dp_enabled and d.fsdp_enabled and d.tp_enabled
    assert not d.cp_enabled and not d.pp_enabled
    one = dims(world_size=1)
    assert not (one.dp_enabled or one.fsdp_enabled or one.tp_enabled)
    ddp = dims(dp_replicate=2, dp_shard=1, world_size=2)
    assert ddp.dp_enabled and not ddp.fsdp_enabled
    cp_only = dims(dp_shard=1, cp=2, world_size=2)
    assert cp_only.fsdp_enabled  # FSDP shards over dp_shard x cp


def test_zero_shard_degree_is_an_error():
    with pytest.raises(ParallelismError, match="must be -1 or >= 1"):
        dims(dp_shard=0, tp=2, world_size=4)


def test_fill_not_divisible():
    with pytest.raises(ParallelismError, match="not divisible") as e:
        dims(tp=3, world_size=8)
    assert "NGPU" in str(e.value)


def test_product_mismatch():
    with pytest.raises(ParallelismError) as e:
        dims(dp_shard=3, tp=2, world_size=8)
    msg = str(e.value)
    assert "= 6" in msg and "world size is 8" in msg


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(tp=0), "tp"),
        (dict(pp=0), "pp"),
        (dict(cp=-1), "cp"),
        (dict(dp_replicate=0), "dp_replicate"),
        (dict(dp_shard=-2), "data_parallel_shard_degree"),
    ],
)
def test_degree_below_one(kw, name):
    with pytest.raises(ParallelismError, match=name):
        dims(**kw)


def test_mesh_needs_build():
    with pytest.raises(RuntimeError, match="build_mesh"):
        dims(world_size=1)["dp"]


# ----------------------------------------------------------------------------- model checks


def check(d, n_heads=32, n_kv=8, n_layers=16, seq_len=2048, local=2, global_=None):
    args = Llama3Args(n_heads=n_heads, n_kv_heads=n_kv, n_layers=n_layers)
    validate_against_model(
        d,
        args,
        seq_len=seq_len,
        local_batch_size=local,
        global_batch_size=global_ if global_ is not None else local * d.dp,
    )


def test_model_checks_pass():
    check(dims(tp=8, world_size=8))
    check(dims(cp=4, world_size=8), seq_len=2048)
    check(dims(pp=4, world_size=8), n_layers=4)
    check(dims(world_size=4), local=2, global_=32)


def test_tp_must_divide_heads():
    with pytest.raises(ParallelismError, match="n_heads"):
        check(dims(tp=3, world_size=3), n_heads=32, n_kv=8)
    with pytest.raises(ParallelismError, match="n_kv_heads"):
        check(dims(tp=16, world_size=16), n_heads=32, n_kv=8)  # divides heads, not kv heads


def test_pp_exceeds_layers():
    with pytest.raises(ParallelismError, match="layers"):
        check(dims(pp=8, world_size=8), n_layers=6)


def test_batch_not_divisible_by_dp():
    with pytest.raises(ParallelismError) as e:
        check(dims(world_size=4), local=2, global_=12)  # 12 % (2 x 4)
    assert "global_batch_size 12" in str(e.value) and "2 x 4 = 8" in str(e.value)
    with pytest.raises(ParallelismError):
        check(dims(world_size=1), local=4, global_=6)


def test_cp_seq_len_rule():
    check(dims(cp=4, world_size=4), seq_len=128)  # 128 % 8 == 0
    with pytest.raises(ParallelismError, match="2 x context_parallel_degree"):
        check(dims(cp=4, world_size=4), seq_len=100)
    with pytest.raises(ParallelismError):
        check(dims(cp=2, world_size=2), seq_len=2050)  # even, but not a multiple of 4
    check(dims(world_size=1), seq_len=101)  # no rule without CP


# ----------------------------------------------------------------------------- plan_run


def job(*argv):
    return parse_args(list(argv))


def test_plan_defaults():
    plan = plan_run(job(), world_size=1)
    assert plan.spec.name == "llama3"
    assert plan.model_args.vocab_size == plan.tokenizer.vocab_size == 2048
    assert plan.model_args.max_seq_len == 2048
    assert plan.dims.dp == 1 and plan.global_batch_size == 8 and plan.grad_accum_steps == 1


def test_plan_grad_accum():
    plan = plan_run(
        job("--training.local_batch_size", "2", "--training.global_batch_size", "32"), world_size=4
    )
    assert plan.dims.dp == 4
    assert plan.global_batch_size == 32 and plan.grad_accum_steps == 4
    plan = plan_run(
        job(
            "--training.local_batch_size",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.global_batch_size",
            "12",
        ),
        world_size=4,
    )
    assert plan.dims.dp == 2 and plan.grad_accum_steps == 3
    plan = plan_run(
        job("--training.local_batch_size", "3", "--training.seq_len", "64"), world_size=2
    )
    assert plan.global_batch_size == 6 and plan.grad_accum_steps == 1
    assert plan.model_args.max_seq_len == 64


def test_plan_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert plan_run(job()).dims.dp == 2


def plan_error(argv, world_size=1):
    with pytest.raises(ConfigError) as e:
        plan_run(job(*argv), world_size=world_size)
    return str(e.value)


def test_plan_unknown_model():
    msg = plan_error(["--model.name", "gpt5"])
    assert "'gpt5'" in msg and "model.name" in msg and "llama3" in msg


def test_plan_unknown_flavor():
    msg = plan_error(["--model.flavor", "13B"])
    assert "model.flavor" in msg and "'13B'" in msg and "8B" in msg and "command line" in msg


def test_plan_pipeline_errors():
    pp2 = ["--parallelism.pipeline_parallel_degree", "2"]
    msg = plan_error([*pp2, "--parallelism.pipeline_parallel_schedule", "gpipe"], world_size=2)
    assert "did you mean 'GPipe'" in msg
    msg = plan_error([*pp2, "--training.local_batch_size", "1"], world_size=2)
    assert "cannot fill 2 pipeline ranks" in msg
    msg = plan_error([*pp2, "--parallelism.pipeline_parallel_layers_per_stage", "2"], world_size=2)
    assert "3 pipeline stages do not divide evenly" in msg  # 6 layers / 2 per stage
    msg = plan_error([*pp2, "--parallelism.pipeline_parallel_layers_per_stage", "1"], world_size=2)
    assert "one stage per rank" in msg  # 6 stages on 2 ranks with the single-stage 1F1B
    # the validation batch is independent of training's, but it must fill the pipeline too
    plan_run(job(*pp2, "--validation.enable", "--validation.local_batch_size", "2"), world_size=2)
    msg = plan_error(
        [*pp2, "--validation.enable", "--validation.local_batch_size", "1"], world_size=2
    )
    assert "validation.local_batch_size" in msg
    msg = plan_error(
        [*pp2, "--parallelism.pipeline_parallel_split_points", "layers.x"], world_size=2
    )
    assert "must name a layer" in msg


def test_plan_context_parallel_seq_len():
    msg = plan_error(
        ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"], world_size=2
    )
    assert "2 x context_parallel_degree = 4" in msg


def test_plan_missing_tokenizer(tmp_path):
    missing = str(tmp_path / "tok.json")
    msg = plan_error(["--model.tokenizer_path", missing])
    assert missing in msg and "model.tokenizer_path" in msg


def test_plan_parallelism_errors_become_config_errors():
    msg = plan_error(["--parallelism.tensor_parallel_degree", "3"], world_size=3)
    assert "tensor_parallel_degree 3" in msg
    msg = plan_error(["--parallelism.data_parallel_shard_degree", "3"], world_size=4)
    assert "world size is 4" in msg
    msg = plan_error(
        ["--training.local_batch_size", "2", "--training.global_batch_size", "6"], world_size=2
    )
    assert "global_batch_size 6" in msg


def test_plan_cpu_offload_needs_fsdp():
    msg = plan_error(["--training.enable_cpu_offload"], world_size=1)
    assert "enable_cpu_offload" in msg and "FSDP" in msg
    plan_run(job("--training.enable_cpu_offload"), world_size=2)


# ----------------------------------------------------------------------------- the dims table


def test_the_dims_table_drives_mesh_layout_record_planner_and_search(monkeypatch):
    from titan.parallelisms import parallel_dims
    from titan.parallelisms.parallel_dims import DIMS
    from titan.planner import layout_search

    names = [d.name for d in DIMS]
    d = dims(dp_replicate=2, tp=2, pp=2, world_size=16)
    assert list(d.degrees()) == names
    # the checkpoint's layout record: world size, the table's dims, grad accumulation, the
    # global batch
    plan = plan_run(job("--parallelism.tensor_parallel_degree", "2"), world_size=4)
    assert list(plan.layout()) == ["world_size", *names, "grad_accum_steps", "global_batch_size"]
    assert plan.layout() == {
        "world_size": 4,
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 1,
        "tp": 2,
        "pp": 1,
        "grad_accum_steps": 1,
        "global_batch_size": plan.global_batch_size,
    }  # as checkpoints hold
    # each dim's degree is read from its config field
    for row in DIMS:
        section, attr = row.config_field.split(".")
        assert getattr(getattr(job(), section), attr) is not None
    assert ParallelDims.from_config(
        job("--parallelism.pipeline_parallel_degree", "2"), 4
    ).degrees() == {**dict.fromkeys(names, 1), "dp_shard": 2, "pp": 2}
    assert layout_search.LAYOUT_FIELDS == {
        **{r.name: r.config_field for r in DIMS},
        "ep": "parallelism.expert_parallel_degree",
        "cp_type": "parallelism.context_parallel_type",
        "cp_a2a": "parallelism.context_parallel_alltoall_degree",
    }
    # the mesh's dims follow the table's mesh positions: moving a row moves the dim
    assert [n for n, _ in d.mesh_dims()] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    moved = tuple(
        parallel_dims.Dim(r.name, r.config_field, 9 if r.name == "pp" else r.mesh_position, r.fills)
        for r in DIMS
    )
    monkeypatch.setattr(
        parallel_dims, "MESH_ORDER", tuple(sorted(moved, key=lambda r: r.mesh_position))
    )
    assert [n for n, _ in d.mesh_dims()] == ["dp_replicate", "dp_shard", "cp", "tp", "pp"]
    assert dict(d.mesh_dims()) == d.degrees()
    # layout search: one degree per row, the candidates every factorization
    assert all(len(f) == len(DIMS) for f in layout_search.factorizations(8, len(DIMS)))


def test_a_degree_field_without_its_row_is_refused(monkeypatch):
    from titan.parallelisms import parallel_dims

    monkeypatch.setattr(parallel_dims, "DIMS", parallel_dims.DIMS[:-1])
    with pytest.raises(TypeError, match="rows of DIMS"):
        dims(world_size=8)


def test_a_copy_of_dims_has_no_mesh():
    import dataclasses

    d = dims(world_size=2)
    d._mesh = object()
    assert dataclasses.replace(d)._mesh is None


def test_pipeline_stages_balance_unequal_layer_costs():
    from titan.config import parse_args
    from titan.models.spec import get_train_spec
    from titan.parallelisms.pipeline import stage_layer_ranges
    from titan.plan.run_plan import pipeline_plans

    # a costly first layer (a dense one before MoE layers): the first stage takes fewer
    assert stage_layer_ranges(6, 2, [], [5, 1, 1, 1, 1, 1]) == [range(0, 1), range(1, 6)]
    assert stage_layer_ranges(7, 3, [], [1] * 6 + [6]) == [range(0, 3), range(3, 6), range(6, 7)]
    # equal costs keep the even split, earlier stages taking the remainder
    assert (
        stage_layer_ranges(5, 2, [], [2] * 5)
        == stage_layer_ranges(5, 2, [])
        == [range(0, 3), range(3, 5)]
    )
    # a family's layer_costs reach the plan: DeepSeek-V3 with 2 wide dense layers, 2 MoE
    args = (
        get_train_spec("deepseek_v3")
        .flavors["debugmodel"]
        .with_updates(n_dense_layers=2, ffn_hidden_dim=8192)
    )
    job = parse_args(["--model.name", "deepseek_v3", "--parallelism.pipeline_parallel_degree", "2"])
    plan, _ = pipeline_plans(job, args)
    assert plan.layer_ranges == (range(0, 1), range(1, 4))
    # explicit split points still win
    job = parse_args(
        [
            "--model.name",
            "deepseek_v3",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_split_points",
            "layers.2",
        ]
    )
    assert pipeline_plans(job, args)[0].layer_ranges == (range(0, 2), range(2, 4))


def test_layout_search_tries_the_hybrid_where_all_to_all_cannot_split_the_heads():
    from titan.planner.layout_search import _cp_types, _layouts

    ring, alltoall = {"cp_type": "ring"}, {"cp_type": "alltoall"}
    assert list(_cp_types(1, 1, (8, 4))) == [ring]
    assert list(_cp_types(4, 1, (8, 4))) == [ring, alltoall]
    # 4 kv heads on cp 8: all-to-all cannot split them, groups of 4 can (ring across 2)
    assert list(_cp_types(8, 1, (32, 4))) == [ring, {"cp_type": "hybrid", "cp_a2a": 4}]
    # tp 2 leaves each rank 2 kv heads: groups of 2
    assert list(_cp_types(8, 2, (32, 4))) == [ring, {"cp_type": "hybrid", "cp_a2a": 2}]
    assert list(_cp_types(4, 2, (8, 2))) == [ring]  # one kv head per tp rank: ring only
    found = list(_layouts(8, 1, (32, 4)))
    assert {c.get("cp_a2a") for c in found if c["cp"] == 8 and c["cp_type"] == "hybrid"} == {4}
    assert all(c["cp_type"] == "ring" for c in _layouts(8, 1))  # heads unknown: ring


def test_layout_search_enumerates_expert_parallel_and_prices_its_all_to_all():
    from titan.planner import layout_search
    from titan.planner.layout_search import Hardware, step_time

    # ep borrows from dp_shard x cp and divides the routed experts; a dense model gets ep 1
    found = list(layout_search._layouts(8, 4))
    assert {c["ep"] for c in found if c["dp_shard"] == 8} == {1, 2, 4}
    assert {c["ep"] for c in found if c["dp_shard"] == 2 and c["cp"] == 2} == {1, 2, 4}
    assert {c["ep"] for c in found if c["dp_shard"] * c["cp"] == 1} == {1}
    assert {c["ep"] for c in layout_search._layouts(8, 1)} == {1}

    def parts(ep):
        job = parse_args(
            [
                "--model.name",
                "deepseek_v3",
                "--training.local_batch_size",
                "2",
                "--parallelism.expert_parallel_degree",
                str(ep),
            ]
        )
        return step_time(job, plan_run(job, 4), Hardware(), 4)[1]

    one, two, four = parts(1), parts(2), parts(4)
    assert "ep all-to-all" not in one
    # (ep-1)/ep of the routed rows leave the rank: 1/2, then 3/4
    assert two["ep all-to-all"] > 0
    assert four["ep all-to-all"] == pytest.approx(two["ep all-to-all"] * 1.5)
    assert one["compute"] == two["compute"] == four["compute"]
