"""The side-by-side benchmark's own arithmetic: what it reads from torchtitan's log, the
shape it hands torchtitan, and the trace breakdown's self times (benchmarks/ is not a package:
the scripts are loaded by path; nothing here installs or runs torchtitan)."""

import importlib.util
import json

import pytest

from titan.runtime.paths import REPO_ROOT


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torchtitan_log_lines_give_step_and_tokens_per_second():
    vs = _script("vs_torchtitan")
    log = (
        "[titan] 2026-11-24 21:41:41,533 - root - INFO - step:  1  loss:  8.05533  grad_norm:"
        "  1.0718  memory:  0.83GiB(3.51%)  tps: 2,111  tflops: 0.08  mfu: 0.02%\n"
        "[rank0]:[titan] ... - step: 20  loss:  5.1  grad_norm:  0.5  memory:  0.9GiB(3.9%)"
        "  tps: 4,238  tflops: 0.15  mfu: 0.05%\n"
    )
    assert vs.TT_LOG.findall(log) == [("1", "2,111"), ("20", "4,238")]
    assert vs.STEP1.search(log.splitlines()[0]) and not vs.STEP1.search(log.splitlines()[1])
    # titan's own console line for step 1 is found the same way (start-up time)
    assert vs.STEP1.search("[titan rank0] 21:41:56 INFO step:  1/40  loss:   8.0983")
    assert not vs.STEP1.search("[titan rank0] 21:41:56 INFO step: 10/40  loss:   8.0983")


def test_torchtitan_gets_titans_shape_and_the_same_training_settings(tmp_path):
    vs = _script("vs_torchtitan")
    shape = vs.torchtitan_shape("llama3", "debugmodel")
    assert shape == dict(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        multiple_of=256,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        rope_theta=500000.0,
    )
    with pytest.raises(SystemExit, match="ties its embeddings"):
        vs.torchtitan_shape("llama3", "debugmodel_tied")
    args = vs.argparse.Namespace(
        lr=3e-3, batch=8, seq_len=256, steps=40, warmup=10, family="llama3"
    )
    toml = vs.torchtitan_toml(args, tmp_path / "dump", tmp_path / "tok", vs.LAYOUTS["tp2"][1])
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    cfg = tomllib.loads(toml)
    assert cfg["training"]["mixed_precision_param"] == "float32"
    assert cfg["optimizer"]["implementation"] == "fused"
    assert cfg["activation_checkpoint"]["mode"] == "none"
    assert cfg["metrics"]["log_freq"] == 10 and cfg["metrics"]["enable_tensorboard"] is False
    assert cfg["parallelism"] == {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}
    assert cfg["model"]["name"] == "llama3"


@pytest.fixture
def bench_flavors():
    """The benchmarks' plugin adds flavors to titan's tables: taken out again after the test."""
    from titan.models.llama3.args import LLAMA3_FLAVORS
    from titan.models.qwen3.args import QWEN3_FLAVORS

    saved = [(table, dict(table)) for table in (LLAMA3_FLAVORS, QWEN3_FLAVORS)]
    yield
    for table, before in saved:
        table.clear()
        table.update(before)


def test_moe_shapes_match_titans_routing_and_parameter_count(bench_flavors):
    """torchtitan's fields for the MoE families name titan's experts, top-k, shared experts,
    dense layers and routing (scores applied after the experts, fp32 loop); the counts both
    trainers printed are in RESULTS.md (5,777,920 and 5,104,640), these are titan's."""
    vs = _script("vs_torchtitan")
    from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
    from titan.models.qwen3.args import QWEN3_FLAVORS

    qwen = vs.torchtitan_shape("qwen3_moe", "debugmodel_moe_all")
    assert QWEN3_FLAVORS["debugmodel_moe_all"].num_params() == 5_777_920
    assert (qwen["moe_enabled"], qwen["moe_inter_dim"], qwen["head_dim"]) == (True, 128, 32)
    assert qwen["moe_args"] == dict(
        num_experts=8,
        num_shared_experts=0,
        top_k=2,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
        use_grouped_mm=False,
        load_balance_coeff=None,
    )
    with pytest.raises(SystemExit, match="routes every layer"):
        vs.torchtitan_shape("qwen3_moe", "debugmodel_moe")  # its dense first layer
    ds = vs.torchtitan_shape("deepseek_v3", "debugmodel")
    assert DEEPSEEK_V3_FLAVORS["debugmodel"].num_params() == 5_104_640
    assert (ds["n_dense_layers"], ds["q_lora_rank"], ds["kv_lora_rank"]) == (1, 128, 64)
    assert ds["moe_args"] == dict(
        num_experts=8,
        num_shared_experts=1,
        top_k=2,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        score_before_experts=False,
        use_grouped_mm=False,
        load_balance_coeff=1e-3,
        num_expert_groups=4,
        num_limited_groups=2,
    )


def test_the_shims_permute_indices_order_rows_by_local_expert_padded():
    """EP's reorder of received rows (rank-major) into local-expert-major runs, each padded to
    the alignment (at least one row), -1 for padding."""
    import torch

    shim = _script("torchtitan_cpu_shim")
    # from rank 0: 2 rows for expert 0, 1 for expert 1; from rank 1: 0 and 3
    counts = torch.tensor([2, 1, 0, 3])
    idx, sizes, offsets = shim._permute_indices_cpu(counts, 2, 2, 16, 4)
    assert sizes.tolist() == [4, 4] and offsets.tolist() == [4, 8]
    assert idx.tolist() == [0, 1, -1, -1, 2, 3, 4, 5] + [-1] * 8


def test_trace_breakdown_counts_each_ops_own_time_once(tmp_path):
    tc = _script("trace_compare")

    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [
        op("ProfilerStep#7", 0, 100, cat="user_annotation"),
        op("aten::linear", 0, 50),
        op("aten::mm", 5, 40),  # linear's own time: 10
        op("aten::add", 60, 10),
        op("FSDP::all_gather (layers.0)", 70, 20, cat="user_annotation"),
        op("c10d::_allgather_base_", 72, 8),
        op("aten::mm", 0, 30, tid=2),
    ]  # backward thread
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    own, step = tc.self_times(tc.load(str(path)))
    assert step == 100
    assert own["aten::mm"] == 70 and own["aten::linear"] == 10 and own["aten::add"] == 10
    assert own["c10d::_allgather_base_"] == 8
    assert own["FSDP::all_gather (layers.0)"] == 12  # annotations keep only their own gaps
    assert tc.kind_of("c10d::_allgather_base_") == "collectives"
    assert tc.kind_of("aten::mm") == "matmul"
    assert tc.kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"


def test_scaling_reads_the_checkpointers_log_lines(bench_flavors):
    """benchmarks/scaling.py times saves and loads from the checkpointer's own log lines."""
    sc = _script("scaling")
    # the lines as the checkpointer's format strings render them
    saved = "checkpoint step 1 saved (sync, training blocked 4.70s)"
    assert sc.SAVED.search(saved).groups() == ("4.70",)
    loaded = "loaded model, optimizer, train_state from /x/step-1 in 0.95s"
    assert sc.LOADED.search(loaded).groups() == ("model, optimizer, train_state", "0.95")
    hf = (
        "initialized the model from the HF weights in /x/hf: 3 tensors, 2005.0 MiB "
        "read by this rank (its shards only) in 0.35s"
    )
    assert sc.HF_LOADED.search(hf).groups() == ("2005.0", "0.35")


def test_kernel_breakdown_sums_kernels_by_kind_and_counts_busy_time_once(tmp_path):
    """trace_compare --kernels: a GPU trace's kernels by name and kind; overlapping kernels
    (two streams) count once in the busy time, which the step's wall time bounds."""
    tc = _script("trace_compare")

    def ev(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}

    grouped = "void cutlass::device_kernel<at::cuda::detail::GroupProblemShape<int>>"
    adam = "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>"
    events = [
        ev("ProfilerStep#22", 0, 1000, cat="user_annotation"),
        ev("aten::_grouped_mm", 0, 50, cat="cpu_op"),  # host ops are not kernels
        ev(grouped, 100, 300),
        ev(grouped, 450, 100),
        ev("sm90_xmma_gemm_bf16bf16_bf16f32", 350, 200),  # overlaps both grouped calls
        ev("triton_poi_fused__to_copy_index_3", 600, 40),
        ev(adam, 700, 100),
        ev("Memcpy DtoH (Device -> Pinned)", 900, 10, cat="gpu_memcpy"),
    ]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    times, busy, step = tc.kernel_times(tc.load(str(path)))
    assert step == 1000 and times[grouped] == (400, 2)
    assert busy == 450 + 40 + 100 + 10  # 100..550 once, then the rest apart
    kinds = {n: tc.kernel_kind(n) for n in times}
    assert kinds[grouped] == "grouped GEMM" and kinds[adam] == "optimizer"
    assert kinds["sm90_xmma_gemm_bf16bf16_bf16f32"] == "GEMM"
    assert kinds["triton_poi_fused__to_copy_index_3"] == "compiled fusions (triton)"
    assert kinds["Memcpy DtoH (Device -> Pinned)"] == "memcpy/memset"
    report = tc.kernels_report([str(path)], ["titan"], top=3)
    assert "GPU busy 0.6 ms (60%)" in report and "| grouped GEMM | 0.40 |" in report
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(json.dumps({"traceEvents": events[:2]}))
    assert tc.kernels_report([str(cpu_only)], ["A"], 3).startswith("no GPU kernels")
