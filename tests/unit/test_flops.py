"""FLOPs per token and device peak FLOP/s for MFU."""

import pytest
import torch

import titan.components.observability.flops as flops
from titan.components.observability.flops import gpu_peak_flops, measure_matmul_flops, peak_flops
from titan.models.llama3.args import LLAMA3_FLAVORS


def test_flops_per_token_8b_by_hand():
    L, d, H, kv, Dh, ffn, V, T = 32, 4096, 32, 8, 128, 14336, 128256, 8192
    per_layer = (
        d * H * Dh  # wq
        + 2 * d * kv * Dh  # wk, wv
        + H * Dh * d  # wo
        + 3 * d * ffn  # w1, w2, w3
        + 2 * d  # two RMSNorms
    )
    n_nonembed = L * per_layer + d + V * d  # final norm + output projection
    expected = 6 * n_nonembed + 12 * L * H * Dh * T
    args = LLAMA3_FLAVORS["8B"]
    assert args.num_params(include_embedding=False) == n_nonembed
    assert args.flops_per_token(T) == expected
    # about 6 x 7.5e9 + 12.9e9 attention at this length
    assert args.flops_per_token(T) == pytest.approx(5.79e10, rel=0.01)


def test_flops_per_token_grows_linearly_with_seq_len():
    a = LLAMA3_FLAVORS["debugmodel"]
    d1 = a.flops_per_token(2048) - a.flops_per_token(1024)
    assert d1 == 12 * a.n_layers * a.n_heads * a.head_dim * 1024
    assert a.flops_per_token(0) == 6 * a.num_params(include_embedding=False)


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GB200", 2500e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("AMD Instinct MI300X", 1307e12),
    ],
)
def test_gpu_peak_table(name, peak):
    assert gpu_peak_flops(name) == peak


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", ""])
def test_gpu_peak_unknown(name):
    assert gpu_peak_flops(name) is None


def test_peak_flops_override():
    assert peak_flops(torch.device("cpu"), torch.float32, override=123e12) == (
        123e12,
        "metrics.peak_flops",
    )
    # the override wins over the device table too
    assert peak_flops(torch.device("cuda"), torch.bfloat16, override=5e12)[0] == 5e12


def test_peak_flops_cuda_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak, source = peak_flops(torch.device("cuda"), torch.bfloat16)
    assert peak == 989e12 and "H100" in source and "datasheet" in source


def test_peak_flops_unknown_cuda_measures(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU")
    monkeypatch.setattr(
        flops,
        "measure_matmul_flops",
        lambda device, dtype, n=0, **kw: calls.append((device, dtype, n)) or 7e12,
    )
    peak, source = peak_flops(torch.device("cuda"), torch.float32)
    assert peak == 7e12 and "measured" in source and "Mystery GPU" in source
    assert calls == [(torch.device("cuda"), torch.bfloat16, 4096)]


def test_no_mfu_on_cpu_unless_a_peak_is_given(monkeypatch):
    """A matmul timed at start-up is no ceiling on a shared CPU: the quick start showed up to
    304% MFU against one. CPU MFU is left out unless metrics.peak_flops states a peak."""
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda *a, **kw: pytest.fail("timed"))
    peak, source = peak_flops(torch.device("cpu"), torch.float32)
    assert (
        peak is None and source.startswith("not reported on CPU") and "metrics.peak_flops" in source
    )
    assert peak_flops(torch.device("cpu"), torch.bfloat16, override=2e11)[0] == 2e11


def _logger_and_writers(tmp_path, peak, cfg):
    """A MetricsLogger and rank 0's metrics writers (their callback) for a fresh run."""
    from types import SimpleNamespace

    from titan.components.observability.metrics import MetricsLogger
    from titan.components.observability.writers import MetricsWriters

    log = MetricsLogger(cfg, device=torch.device("cpu"), flops_per_token=1e9, peak_flops=peak)
    writers = MetricsWriters(cfg, {}, {})
    run = SimpleNamespace(dump_folder=str(tmp_path), step=0, rank=0, history_set_aside=None)
    writers.on_train_start(run)
    return log, writers


def _logged(tmp_path, peak, caplog):
    from titan.config import JobConfig

    cfg = JobConfig().metrics
    cfg.enable_tensorboard = False
    log, writers = _logger_and_writers(tmp_path, peak, cfg)
    log.record_step(tokens=1000, data_s=0.0)
    with caplog.at_level("INFO", logger="titan.components.observability.metrics"):
        record = log.log(1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_seen=1000)
    writers.write(1, record)
    writers.close()
    return record, caplog.records[-1].getMessage()


def test_metrics_leave_mfu_out_without_a_peak(tmp_path, caplog):
    import json

    record, line = _logged(tmp_path, None, caplog)
    assert record["mfu"] is None and record["tflops"] > 0 and "mfu:   n/a" in line
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mfu"] is None
    record, line = _logged(tmp_path / "given", 1e15, caplog)
    assert record["mfu"] == pytest.approx(100 * record["tflops"] / 1e3)
    assert f"mfu: {record['mfu']:5.2f}%" in line


def test_measure_matmul_flops_small():
    got = measure_matmul_flops(torch.device("cpu"), torch.float32, n=64, iters=2, repeats=2)
    assert 1e6 < got < 1e14


def test_lists_are_tensorboard_histograms_only(tmp_path, caplog):
    """An MoE hook's per-layer expert loads: a histogram over expert positions in
    TensorBoard, neither in metrics.jsonl nor on the console; numbers go to all three."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titan.config import JobConfig

    cfg = JobConfig().metrics
    log, writers = _logger_and_writers(tmp_path, None, cfg)
    log.record_step(tokens=1000, data_s=0.0)
    loads = [0.5, 0.0, 0.25, 0.25]
    with caplog.at_level("INFO", logger="titan.components.observability.metrics"):
        record = log.log(
            1,
            loss=2.0,
            grad_norm=1.0,
            lr=1e-3,
            tokens_seen=1000,
            expert_load_imbalance=2.0,
            **{"expert_load/layer_1": loads},
        )
    writers.write(1, record)
    writers.close()
    line = caplog.records[-1].getMessage()
    assert "expert_load_imbalance: 2" in line and "layer_1" not in line
    (record,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["expert_load_imbalance"] == 2.0 and "expert_load/layer_1" not in record
    (event_dir,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents*")}
    acc = EventAccumulator(str(event_dir), size_guidance={"histograms": 0})
    acc.Reload()
    (hist,) = acc.Histograms("train/expert_load/layer_1")
    assert hist.step == 1 and list(hist.histogram_value.bucket) == loads
    assert [e.value for e in acc.Scalars("train/expert_load_imbalance")] == [2.0]


def test_seconds_print_alike_every_step_and_validation_names_what_it_scored(tmp_path, caplog):
    from titan.config import JobConfig

    cfg = JobConfig().metrics
    cfg.enable_tensorboard = False
    log, _ = _logger_and_writers(tmp_path, None, cfg)
    lines = []
    for gc_s in (0.0, 0.000177):
        log.record_step(tokens=1000, data_s=0.0)
        with caplog.at_level("INFO", logger="titan.components.observability.metrics"):
            log.log(1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_seen=1000, gc_s=gc_s)
        lines.append(caplog.records[-1].getMessage())
    assert "gc_s: 0.0000" in lines[0] and "gc_s: 0.0002" in lines[1]
    with caplog.at_level("INFO", logger="titan.components.observability.metrics"):
        log.log_validation(4, 2.5, 2, of="the EMA weights")
    assert caplog.records[-1].getMessage().endswith("batches: 2  (the EMA weights)")
