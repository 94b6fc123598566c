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

MoE rows (row.model deepseek_v3 or qwen3) have peers on 0.2.x only (0.3 refuses them): the
shape is registered as flavor "gpu_suite" of its deepseekv3_args / qwen3_args, trained with
`--model.name deepseek_v3` / `qwen3`. Dims, heads, MLA ranks and head dims, dense layers,
experts, top_k, shared experts, score function, renormalized top-k weights, route scale and
expert groups are titan's; causal SDPA; its grouped-mm experts on CUDA (its DeepSeek-V3 falls
back to a loop itself below SM90). What differs and cannot be made equal:
- balancing: 0.2 has no auxiliary loss at all, so titan's DeepSeek-V3 sequence-wise loss
  (coefficient 1e-4) and Qwen3-MoE's load-balancing loss (1e-3) have no counterpart there.
  DeepSeek-V3's expert bias moves by titan's rate after each step (its load_balance_coeff),
  by the same sign rule, re-centred to mean zero (titan's is not); its Qwen3 never moves a
  bias, so the peer has none (as titan's Qwen3 at the default rate 0);
- its Qwen3 puts experts in every layer or none: a titan shape with dense layers among MoE
  ones (the debug model's first layer) gets experts there too, and more parameters (the
  Qwen3-30B-A3B shape has none and matches exactly);
- DeepSeek-V3 YaRN: it scales RoPE only past original_seq_len and has no rotation mscale; the
  published 16B uses plain RoPE, which the peer keeps with a factor of 1 over the row's
  length. A titan shape it cannot reproduce (such YaRN, multi-token prediction, tied
  embeddings, two-halves RoPE) is refused rather than run as another model;
- precision details: its router projection runs in the autocast dtype (titan's sigmoid
  router in float32), its grouped mm in bf16 whatever the dtype, and its DeepSeek-V3 final
  norm uses torch's default eps instead of norm_eps.

On CPU (the dry run) the entry first makes torchtitan take the CPU as its device, which it
does not do itself (peak memory then is the process's peak RSS, as in titan); 0.3 gets causal
SDPA there, as flex attention has no CPU backward. MoE peers there run their experts as a
loop (its grouped-mm path pads with a Triton kernel) and count tokens per expert through a
float histogram (the CPU has no integer one). torchtitan 0.2.2 imports triton whatever the
device, so the CPU run needs the triton package installed.
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
    """Everything the entry needs, from the titan row and titan's model args for its shape
    (`args` must be of the row's family, row.model)."""
    shapes = {"llama3": _llama3_shape, "deepseek_v3": _deepseek_v3_shape, "qwen3": _qwen3_shape}
    if row.model not in shapes:
        raise ValueError(f"no torchtitan peer for model {row.model!r} (only {', '.join(shapes)})")
    return {
        "model": row.model,
        "device": device,
        **shapes[row.model](args, row.seq_len),
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


def _common_shape(args) -> dict:
    return {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "ffn_hidden": args.ffn_hidden_dim,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "tied": args.tie_word_embeddings,
    }


def _llama3_shape(args, seq_len: int) -> dict:
    return {
        **_common_shape(args),
        "n_kv_heads": args.n_kv_heads,
        "multiple_of": args.multiple_of,
        "ffn_dim_multiplier": args.ffn_dim_multiplier,
        "rope_scaling": args.rope_scaling_factor,
        "rope_low": args.rope_low_freq_factor,
        "rope_high": args.rope_high_freq_factor,
        "rope_original_max_len": args.rope_original_max_len,
    }


def _moe_shape(args) -> dict | None:
    """The routed experts' settings with the run's balancing (titan's MoEArgs), or None."""
    m = args.moe_args()
    if m is None:
        return None
    return {
        "n_experts": m.n_experts,
        "top_k": m.top_k,
        "hidden": m.hidden_dim,
        "n_shared": m.n_shared_experts,
        "score_func": m.score_func,
        "route_norm": m.norm_topk_prob,
        "route_scale": m.route_scale,
        "n_groups": m.n_groups,
        "topk_groups": m.topk_groups,
        # a bias that never moves stays zero: the same routing as no bias
        "bias_update_rate": m.bias_update_rate if m.score_bias else 0.0,
    }


def _deepseek_v3_shape(args, seq_len: int) -> dict:
    problems = _deepseek_v3_problems(args, seq_len)
    if problems:
        raise ValueError(f"torchtitan 0.2's DeepSeek-V3 cannot match: {'; '.join(problems)}")
    return {
        **_common_shape(args),
        "moe": _moe_shape(args),
        "n_dense_layers": args.n_dense_layers,
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_scaling": args.rope_scaling_factor,
        "rope_original_max_len": args.rope_original_max_len,
        "rope_beta_fast": args.rope_beta_fast,
        "rope_beta_slow": args.rope_beta_slow,
        "rope_mscale": args.rope_mscale_all_dim,
    }


def _deepseek_v3_problems(args, seq_len: int) -> list[str]:
    """What of titan's DeepSeek-V3 torchtitan 0.2's cannot express (empty: nothing)."""
    out = [] if args.moe else ["moe None (it builds routed experts past n_dense_layers)"]
    if args.mtp_depth:
        out.append(f"mtp_depth {args.mtp_depth} (it has no multi-token prediction)")
    if not args.interleaved_rope:
        out.append("interleaved_rope False (it rotates pairs (2i, 2i+1) only)")
    if args.tie_word_embeddings:
        out.append("tie_word_embeddings (it never ties)")
    if args.rope_scaling_factor is not None:
        # it applies YaRN only past original_seq_len, its one mscale setting the softmax
        # temperature, with no rotation scale: titan's case of equal mscales, past that length
        if not args.rope_mscale or args.rope_mscale != args.rope_mscale_all_dim:
            out.append(
                f"YaRN with rope_mscale {args.rope_mscale} != rope_mscale_all_dim "
                f"{args.rope_mscale_all_dim}"
            )
        if seq_len <= args.rope_original_max_len:
            out.append(
                f"YaRN at seq_len {seq_len} <= rope_original_max_len "
                f"{args.rope_original_max_len} (it scales only longer sequences)"
            )
    return out


def _qwen3_shape(args, seq_len: int) -> dict:
    if args.rope_scaling_factor is not None:
        raise ValueError("torchtitan 0.2's Qwen3 has no YaRN: rope_scaling_factor must be None")
    return {
        **_common_shape(args),
        "moe": _moe_shape(args),
        "n_kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        # it puts experts in every layer or none; the entry says so when titan's differ
        "dense_layers": [i for i in range(args.n_layers) if not args.is_moe_layer(i)],
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
    """The row's shape as flavor "gpu_suite" of its family's args in torchtitan 0.2."""
    {"llama3": _v02_llama3, "deepseek_v3": _v02_deepseek_v3, "qwen3": _v02_qwen3}[s["model"]](s)


def _v02_llama3(s: dict) -> None:
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


def _v02_moe(s: dict):
    """torchtitan 0.2's MoEArgs for the row's routed experts."""
    from torchtitan.models.moe import MoEArgs

    m = s["moe"]
    grouped = m["n_groups"] > 1
    return MoEArgs(
        num_experts=m["n_experts"],
        num_shared_experts=m["n_shared"],
        score_func=m["score_func"],
        route_norm=m["route_norm"],
        route_scale=m["route_scale"],
        # titan weighs each expert's output, not its input
        score_before_experts=False,
        top_k=m["top_k"],
        num_expert_groups=m["n_groups"] if grouped else None,
        num_limited_groups=m["topk_groups"] if grouped else None,
        # its grouped-mm path pads token groups with a Triton kernel: none on the CPU
        use_grouped_mm=s["device"] != "cpu",
        # its name for the expert-bias update rate; None: no bias at all
        load_balance_coeff=m["bias_update_rate"] or None,
    )


def _v02_deepseek_v3(s: dict) -> None:
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs, deepseekv3_args

    yarn = s["rope_scaling"] is not None
    deepseekv3_args["gpu_suite"] = DeepSeekV3ModelArgs(
        max_seq_len=s["seq_len"],
        vocab_size=s["vocab_size"],
        dim=s["dim"],
        inter_dim=s["ffn_hidden"],
        moe_inter_dim=s["moe"]["hidden"],
        n_layers=s["n_layers"],
        n_dense_layers=s["n_dense_layers"],
        n_heads=s["n_heads"],
        norm_eps=s["norm_eps"],
        moe_args=_v02_moe(s),
        q_lora_rank=s["q_lora_rank"],
        kv_lora_rank=s["kv_lora_rank"],
        qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"],
        v_head_dim=s["v_head_dim"],
        attn_type="sdpa",
        attn_mask_type="causal",
        rope_theta=s["rope_theta"],
        # it applies YaRN to sequences longer than original_seq_len: without titan's YaRN,
        # a factor of 1 over the row's own length keeps plain RoPE
        original_seq_len=s["rope_original_max_len"] if yarn else s["seq_len"],
        rope_factor=s["rope_scaling"] if yarn else 1.0,
        beta_fast=s["rope_beta_fast"],
        beta_slow=s["rope_beta_slow"],
        mscale=s["rope_mscale"] if yarn else 1.0,
    )


def _v02_qwen3(s: dict) -> None:
    from torchtitan.models.qwen3 import Qwen3ModelArgs, qwen3_args

    moe = s["moe"] is not None
    if moe and s["dense_layers"]:
        print(
            f"gpu_suite peer: torchtitan 0.2's Qwen3 puts experts in every layer; titan's "
            f"layers {s['dense_layers']} are dense (its parameter count differs)",
            flush=True,
        )
    moe_kw = (
        {"moe_enabled": True, "moe_inter_dim": s["moe"]["hidden"], "moe_args": _v02_moe(s)}
        if moe
        else {}
    )
    qwen3_args["gpu_suite"] = Qwen3ModelArgs(
        dim=s["dim"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"],
        vocab_size=s["vocab_size"],
        head_dim=s["head_dim"],
        hidden_dim=s["ffn_hidden"],
        norm_eps=s["norm_eps"],
        rope_theta=s["rope_theta"],
        qk_norm=True,
        max_seq_len=s["seq_len"],
        attn_type="sdpa",
        attn_mask_type="causal",
        enable_weight_tying=s["tied"],
        **moe_kw,
    )


def _v02_args(s: dict) -> list[str]:
    out = [
        "--model.name",
        s["model"],
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


def _cpu_integer_histc() -> None:
    """torchtitan's MoE router counts tokens per expert with torch.histc on the int64 expert
    ids, which CUDA takes and the CPU does not: on the CPU the ids are counted as floats (exact:
    one unit-wide bin per expert) and the counts given back as integers, as CUDA's are."""
    import torch

    histc = torch.histc

    def integer_histc(input, bins=100, min=0, max=0, **kw):
        if input.is_floating_point():
            return histc(input, bins, min, max, **kw)
        return histc(input.float(), bins, min, max).to(input.dtype)

    torch.histc = integer_histc


def main() -> None:
    import importlib.metadata

    s = json.loads(os.environ[PEER_ENV])
    version = importlib.metadata.version("torchtitan")
    v02 = version.startswith("0.2.")
    if not v02 and s["model"] != "llama3":
        raise NotImplementedError(
            f"torchtitan {version}: only 0.2.x MoE peers are supported ({s['model']} is "
            "built for torchtitan 0.2's args only); carry torchtitan 0.2.x"
        )
    # before any torchtitan import: 0.2's parser binds sys.argv when its module is imported
    sys.argv = [
        sys.argv[0],
        *(_v02_args(s) if v02 else ["--module", Path(__file__).stem, "--config", "suite_config"]),
        *sys.argv[1:],
    ]
    if s["device"] == "cpu":
        _cpu_device()
        _cpu_integer_histc()
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
