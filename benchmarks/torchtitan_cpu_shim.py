"""Start torchtitan's trainer on a machine without a GPU, for the side-by-side benchmark.

    torchrun --nproc_per_node N benchmarks/torchtitan_cpu_shim.py --job.config_file X.toml

torchtitan's files are never edited or copied: the points below are patched at import time,
in this process only, and only where the machine lacks what torchtitan assumes. On a CUDA
machine only the model shape and the dataset are added.
- Its device fallback is "cuda": with no accelerator it gets "cpu" and a device module that
  answers the `torch.cuda` memory calls (peak memory is the process's peak RSS).
- Its barrier passes `device_ids`, which gloo refuses: they are dropped on a gloo group.
- FSDP reduces with PREMUL_SUM at its divide factor 1.0, which gloo lacks: on gloo FSDP is
  told to reduce with SUM, the same arithmetic at factor 1.0 (no division either way).
- Its MoE package imports a triton kernel at import time, and a CPU wheel has no triton:
  that one module is replaced. Its `generate_permute_indices` (expert parallelism's reorder of
  the received rows by local expert, padded per expert) is written here for the CPU from its
  documented contract; the triton fill is never called. torch's own triton probes are
  untouched.
- Its router counts tokens per expert with `torch.histc` on int64 expert indices, which
  CUDA computes and the CPU refuses: on the CPU an integer histc is computed on the indices
  as float32 (exact for expert ids) and returned in the input's dtype, as CUDA returns it.
- Its profiler lists the GPU activity as None when there is no GPU, which torch refuses: the
  None is left out.
Environment (set by benchmarks/vs_torchtitan.py):
- TITAN_BENCH_FAMILY: llama3 (default), qwen3 or deepseek_v3, the torchtitan model name.
- TITAN_BENCH_SHAPE: JSON of that family's model-args fields (`moe_args` a dict of MoEArgs
  fields), registered as its flavor `titan_shape` (titan's flavor, so both sides train the
  same shape).
- TITAN_BENCH_CORPUS: a JSON-lines file with a "text" field, registered as dataset
  `titan_corpus`.
"""

import contextlib
import json
import os
import resource
import sys
import types

import torch
import torch.distributed as dist


def _cpu_device_module() -> types.ModuleType:
    mod = types.ModuleType("titan_bench_cpu_device")
    for name in (
        "current_device",
        "device_count",
        "is_available",
        "synchronize",
        "set_device",
        "current_stream",
        "stream",
        "Stream",
        "Event",
    ):
        setattr(mod, name, getattr(torch.cpu, name))

    def peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(
        total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.memory_stats = lambda device=None: {
        "active_bytes.all.peak": peak_rss(),
        "reserved_bytes.all.peak": peak_rss(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    return mod


@contextlib.contextmanager
def _cpu_device_while_importing():
    import torch._utils as tu

    original_type, original_module = tu._get_available_device_type, tu._get_device_module
    cpu = _cpu_device_module()
    tu._get_available_device_type = lambda: original_type() or "cpu"
    tu._get_device_module = lambda t=None: cpu if t == "cpu" else original_module(t)
    try:
        yield
    finally:
        tu._get_available_device_type, tu._get_device_module = original_type, original_module


def _permute_indices_cpu(
    tokens_per_expert_group, experts_per_rank, num_ranks, max_len, alignment, use_cpu=False
):
    """The received rows (rank-major: rank r's rows for its local experts 0..E-1, then rank
    r+1's) reordered expert-major, each expert's run padded to a multiple of `alignment` (at
    least one): (indices into the rows, -1 for padding; padded sizes; their running sum)."""
    counts = tokens_per_expert_group.view(num_ranks, experts_per_rank).tolist()
    starts = (tokens_per_expert_group.cumsum(0) - tokens_per_expert_group).tolist()
    totals = [sum(counts[r][e] for r in range(num_ranks)) for e in range(experts_per_rank)]
    sizes = [-(-max(t, alignment) // alignment) * alignment for t in totals]
    indices = torch.full((max_len,), -1, dtype=torch.int32)
    at = 0
    for e in range(experts_per_rank):
        write = at
        for r in range(num_ranks):
            n = counts[r][e]
            first = starts[r * experts_per_rank + e]
            end = min(write + n, max_len)
            indices[write:end] = torch.arange(first, first + end - write, dtype=torch.int32)
            write += n
        at += sizes[e]
    sizes_t = torch.tensor(sizes, dtype=torch.int32, device=tokens_per_expert_group.device)
    return (
        indices.to(tokens_per_expert_group.device),
        sizes_t,
        sizes_t.cumsum(0).to(torch.int32),
    )


@contextlib.contextmanager
def _moe_kernels_without_triton():
    import importlib.util

    name = "torchtitan.models.moe.kernels"
    if importlib.util.find_spec("triton") is not None:
        yield
        return

    def needs_triton(*_, **__):
        raise RuntimeError("torchtitan's triton index fill needs triton (benchmark shim)")

    kernels = types.ModuleType(name)
    kernels.fill_indices_wrapper = needs_triton
    kernels.generate_permute_indices = _permute_indices_cpu
    sys.modules[name] = kernels
    yield


def _barrier_without_device_ids_on_gloo() -> None:
    original = dist.barrier

    def barrier(group=None, async_op=False, device_ids=None):
        if dist.get_backend(group) == "gloo":
            device_ids = None
        return original(group=group, async_op=async_op, device_ids=device_ids)

    dist.barrier = barrier


def _sum_reduction_on_gloo() -> None:
    import torchtitan.models.llama3.infra.parallelize as llama_parallelize
    import torchtitan.models.llama4.infra.parallelize as moe_parallelize
    from torch.distributed.fsdp import FSDPModule

    original = llama_parallelize.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model) -> None:
        original(model)
        if dist.get_backend() == "gloo":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)

    # the dense families call it from llama3's module, the MoE ones (qwen3, deepseek_v3, by
    # llama4's apply_fsdp) from llama4's
    for module in (llama_parallelize, moe_parallelize):
        module.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _integer_histc_on_cpu() -> None:
    original = torch.histc

    def histc(input, bins=100, min=0, max=0, *, out=None):
        if out is None and input.device.type == "cpu" and not input.is_floating_point():
            return original(input.float(), bins=bins, min=min, max=max).to(input.dtype)
        return original(input, bins=bins, min=min, max=max, out=out)

    torch.histc = histc


def _profiler_without_missing_activity() -> None:
    original = torch.profiler.profile

    class profile(original):
        def __init__(self, *args, activities=None, **kwargs):
            if activities is not None:
                activities = [a for a in activities if a is not None]
            super().__init__(*args, activities=activities, **kwargs)

    torch.profiler.profile = profile


def _register_shape_and_corpus() -> None:
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    shape = os.environ.get("TITAN_BENCH_SHAPE")
    if shape:
        fields = json.loads(shape)
        family = os.environ.get("TITAN_BENCH_FAMILY", "llama3")
        if family == "llama3":
            from torchtitan.models.llama3 import TransformerModelArgs as Args
            from torchtitan.models.llama3 import llama3_args as flavors
        elif family == "qwen3":
            from torchtitan.models.qwen3 import Qwen3ModelArgs as Args
            from torchtitan.models.qwen3 import qwen3_args as flavors
        elif family == "deepseek_v3":
            from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs as Args
            from torchtitan.models.deepseek_v3 import deepseekv3_args as flavors
        else:
            raise SystemExit(f"TITAN_BENCH_FAMILY={family!r}: llama3, qwen3 or deepseek_v3")
        if "moe_args" in fields:
            from torchtitan.models.moe import MoEArgs

            fields["moe_args"] = MoEArgs(**fields["moe_args"])
        flavors["titan_shape"] = Args(**fields)
    corpus = os.environ.get("TITAN_BENCH_CORPUS")
    if corpus:
        DATASETS["titan_corpus"] = DatasetConfig(
            path=corpus,
            loader=lambda path: load_dataset("json", data_files=path, split="train"),
            sample_processor=lambda sample: sample["text"],
        )


def main() -> None:
    on_cpu = not torch.cuda.is_available()
    with contextlib.ExitStack() as stack:
        if on_cpu:
            stack.enter_context(_cpu_device_while_importing())
        stack.enter_context(_moe_kernels_without_triton())
        import torchtitan.tools.utils  # noqa: F401  (binds its device type now)
        import torchtitan.train as tt_train
    if on_cpu:
        _barrier_without_device_ids_on_gloo()
        _sum_reduction_on_gloo()
        _integer_histc_on_cpu()
        _profiler_without_missing_activity()
    _register_shape_and_corpus()
    tt_train.main(tt_train.Trainer)


if __name__ == "__main__":
    main()
