"""torchtitan, the GPU suite's peer: whether it is there, the command for a row, and the
torchrun entry that trains it on exactly the shape of the titan row it follows (parameter
counts and FLOPs per token are titan's for that shape).

torchtitan is never a titan dependency: scripts/gpu_wheels.sh carries it to the GPU
machine. Two release lines are driven, as their configs differ:
- 0.2.x (carried by default; its imports all resolve on the GPU machine's torch 2.11): a
  dataclass CLI; the shape is registered as flavor "gpu_suite" of its llama3 args. Causal
  SDPA; separate q/k/v matrices; on one GPU no FSDP and bf16 by autocast, as titan; no
  weight tying (titan's 1B ties its embedding: 4M more parameters on torchtitan's side).
- 0.3.x (needs a torch newer than 2.13: torch.distributed.fsdp.DataParallelMeshDims,
  torch.distributed.set_timeout): Python config functions (`--module M --config F`);
  `suite_config` below is one, reading the row from $GPU_SUITE_PEER. Its Llama 3 fuses
  wq/wk/wv into one matrix and ships only flex/varlen attention, block-causal over documents,
  so the peer is fed the corpus as one document: the mask is then plain causal, the same work
  as titan's. It always wraps FSDP (a one-rank mesh on one GPU), captures forward+backward in
  a CUDA graph and compiles the loss too; its only selective AC is per op, as titan's "op".
Both get titan's float8 recipe (rowwise) with the output projection left in high precision.
Metrics come from its TensorBoard events (loss, tokens/s, max reserved memory).

On CPU (the dry run) the entry first makes torchtitan take the CPU as its device, which it
does not do itself (peak memory then is the process's peak RSS, as in titan); 0.3 gets causal
SDPA there, as flex attention has no CPU backward.
"""

import json
import os
import resource
import subprocess
import sys
import types
from pathlib import Path

PEER_ENV = "GPU_SUITE_PEER"
NOT_INSTALLED = "not installed (run scripts/gpu_wheels.sh and carry .whl)"


def probe(env: dict) -> tuple[str | None, str]:
    """(torchtitan version, '') when its trainer imports here, else (None, why not)."""
    code = (
        "import importlib.util, importlib.metadata as m, sys\n"
        "if importlib.util.find_spec('torchtitan') is None: sys.exit(3)\n"
        "import torchtitan.train\n"
        "print(m.version('torchtitan'))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    if p.returncode == 3:
        return None, NOT_INSTALLED
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"not importable here: {last}"
    return p.stdout.strip().splitlines()[-1], ""


def peer_spec(
    row, args, device: str, tokenizer_dir: Path, data_dir: Path, dump: Path, attention: str
) -> dict:
    """Everything the entry needs, from the titan row and titan's model args for its shape."""
    return {
        "device": device,
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "ffn_hidden": args.ffn_hidden_dim,
        "multiple_of": args.multiple_of,
        "ffn_dim_multiplier": args.ffn_dim_multiplier,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling_factor,
        "rope_low": args.rope_low_freq_factor,
        "rope_high": args.rope_high_freq_factor,
        "rope_original_max_len": args.rope_original_max_len,
        "tied": args.tie_word_embeddings,
        "seq_len": row.seq_len,
        "batch": row.batch,
        "steps": row.steps,
        "dtype": row.dtype,
        "float8": row.float8,
        "ac": row.ac,
        "compile": row.compile,
        "attention": "sdpa" if device == "cpu" else attention,
        "tokenizer_dir": str(tokenizer_dir),
        "data_dir": str(data_dir),
        "dump": str(dump),
    }


def command(spec: dict, extra: list[str]) -> tuple[list[str], dict]:
    """The torchrun command line and the environment variable holding the row."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc_per_node=1",
        "--local-ranks-filter=0",
        "--role=rank",
        "--tee=3",
        str(Path(__file__).resolve()),
        *extra,
    ]
    return cmd, {PEER_ENV: json.dumps(spec)}


def read_metrics(dump: Path) -> list[dict]:
    """Per-step records {step, loss, tps, memory_gib} from torchtitan's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = {
        "loss_metrics/global_avg_loss": "loss",
        "throughput(tps)": "tps",
        "memory/max_reserved(GiB)": "memory_gib",
    }
    records: dict[int, dict] = {}
    for events in sorted(Path(dump).rglob("events.out.tfevents*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag, key in tags.items():
            if tag in acc.Tags()["scalars"]:
                for e in acc.Scalars(tag):
                    records.setdefault(e.step, {"step": e.step})[key] = e.value
    return [records[s] for s in sorted(records)]


# ------------------------------------------------------------------ torchtitan 0.3 config


def suite_config():
    """The row in $GPU_SUITE_PEER as a torchtitan 0.3 Trainer.Config."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models import llama3 as tt
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    s = json.loads(os.environ[PEER_ENV])
    dim, vocab = s["dim"], s["vocab_size"]
    # the published configs' inits (private names of the pinned 0.3 release)
    layers = tt._build_llama3_layers(
        fuse_qkv=True,
        n_layers=s["n_layers"],
        dim=dim,
        n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"],
        hidden_dim=s["ffn_hidden"],
        rope=ComplexRoPE.Config(
            dim=dim // s["n_heads"],
            max_seq_len=s["seq_len"],
            theta=s["rope_theta"],
            scaling="llama" if s["rope_scaling"] else "none",
            scaling_factor=s["rope_scaling"] or 8.0,
            low_freq_factor=s["rope_low"],
            high_freq_factor=s["rope_high"],
            original_max_position_embeddings=s["rope_original_max_len"],
        ),
        attn_backend="flex" if s["attention"] == "sdpa" else s["attention"],
    )
    if s["attention"] == "sdpa":
        for layer in layers:  # causal SDPA: the trainer then builds no document masks
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = tt.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=s["tied"],
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=tt._EMBEDDING_SKIP_INIT if s["tied"] else tt._EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=tt._output_linear_init(dim)
        ),
        layers=layers,
    )
    if s["float8"]:
        from torchtitan.components.quantization import Float8LinearConverter

        model = (
            Float8LinearConverter.Config(
                recipe_name="rowwise",
                filter_fqns=["lm_head"],
                emulate=s["device"] == "cpu",
                model_compile_enabled=s["compile"],
            )
            .build()
            .convert(model)
        )
    spec = ModelSpec(
        name="llama3",
        flavor="gpu_suite",
        model=model,
        parallelize_fn=tt.parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=tt.Llama3StateDictAdapter,
    )
    ac = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[s["ac"]]
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=s["tokenizer_dir"],
        dump_folder=s["dump"],
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(
            local_batch_size=s["batch"],
            seq_len=s["seq_len"],
            steps=s["steps"],
            mixed_precision_param=s["dtype"],
        ),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=s["data_dir"]),
        metrics=MetricsProcessor.Config(log_freq=1, enable_tensorboard=True),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=s["compile"]),
    )


# ------------------------------------------------------------------ torchtitan 0.2 config


def _v02_register(s: dict) -> None:
    """The row's shape as flavor "gpu_suite" of torchtitan 0.2's llama3 args."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    llama3_args["gpu_suite"] = TransformerModelArgs(
        dim=s["dim"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"],
        vocab_size=s["vocab_size"],
        multiple_of=s["multiple_of"],
        ffn_dim_multiplier=s["ffn_dim_multiplier"],
        norm_eps=s["norm_eps"],
        rope_theta=s["rope_theta"],
        rope_scaling_args=RoPEScalingArgs(
            scaling_factor=s["rope_scaling"] or 1.0,
            low_freq_factor=s["rope_low"],
            high_freq_factor=s["rope_high"],
            original_max_position_embeddings=s["rope_original_max_len"],
        ),
    )


def _v02_args(s: dict) -> list[str]:
    out = [
        "--model.flavor",
        "gpu_suite",
        "--model.hf_assets_path",
        s["tokenizer_dir"],
        "--training.dataset",
        "c4_test",
        "--training.dataset_path",
        s["data_dir"],
        "--training.local_batch_size",
        str(s["batch"]),
        "--training.seq_len",
        str(s["seq_len"]),
        "--training.steps",
        str(s["steps"]),
        "--training.mixed_precision_param",
        s["dtype"],
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--job.dump_folder",
        s["dump"],
        "--activation_checkpoint.mode",
        s["ac"],
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    if s["compile"]:
        out.append("--compile.enable")
    if s["float8"]:
        f8 = "--quantize.linear.float8"
        out += [
            "--model.converters",
            "quantize.linear.float8",
            f"{f8}.recipe_name",
            "rowwise",
            f"{f8}.filter_fqns",
            "output",
        ]
        if s["device"] == "cpu":
            out.append(f"{f8}.emulate")
    return out


# ---------------------------------------------------------------------------- the entry


def _cpu_device() -> None:
    """Make torchtitan see the CPU as its device. It asks torch for an accelerator when its
    tools module is imported (else assumes CUDA) and other modules copy the answer, so torch's
    answer is replaced for the duration of that import only."""
    import torch
    import torch._utils as tu

    def peak_rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = types.SimpleNamespace(
        set_device=lambda d: None,
        device_count=lambda: 1,
        current_device=lambda: 0,
        is_available=lambda: True,
        synchronize=lambda *a: None,
        empty_cache=lambda: None,
        get_device_name=lambda d=None: "cpu",
        reset_peak_memory_stats=lambda *a: None,
        get_device_properties=lambda d=None: types.SimpleNamespace(total_memory=total, name="cpu"),
        memory_stats=lambda d=None: {
            "active_bytes.all.peak": peak_rss(),
            "reserved_bytes.all.peak": peak_rss(),
            "num_alloc_retries": 0,
            "num_ooms": 0,
        },
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )
    saved = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: (
        cpu if device_type in (None, "cpu") else saved[1](device_type)
    )
    try:
        import torchtitan.tools.utils  # noqa: F401 (with the package, whose modules copy it)
    finally:
        tu._get_available_device_type, tu._get_device_module = saved
    # 0.3 shortens every group's timeout after step 1 through an API newer than torch 2.13;
    # on one CPU rank no collective can time out, so the dry run goes on without it
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None


def main() -> None:
    import importlib.metadata

    s = json.loads(os.environ[PEER_ENV])
    v02 = importlib.metadata.version("torchtitan").startswith("0.2.")
    # before any torchtitan import: 0.2's parser binds sys.argv when its module is imported
    sys.argv = [
        sys.argv[0],
        *(_v02_args(s) if v02 else ["--module", Path(__file__).stem, "--config", "suite_config"]),
        *sys.argv[1:],
    ]
    if s["device"] == "cpu":
        _cpu_device()
    if v02:
        _v02_register(s)
        from torchtitan.train import Trainer
        from torchtitan.train import main as train

        train(Trainer)
    else:
        from torchtitan.train import main as train

        train()


if __name__ == "__main__":
    main()
