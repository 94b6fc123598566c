"""The job config's core: the job, the model, training, the parallel layout, communication and
the memory budget, one dataclass each, field names after torchtitan. Every other section
(optimizer, lr_scheduler, checkpoint, metrics, validation, profiling, ...) is registered by
its component with its checks (titan.config.extensions; titan's own are listed in
titan/components/builtin.py), as a plugin's are; `job.<section>` reaches it all the same.

Every field carries a one-line doc in its metadata; `--help` prints it. This module
must not import torch: the launcher validates configs before any heavy import.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

import titan.config.extensions as extensions


def opt(default, doc: str):
    """A config field with its `--help` line."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class Job:
    config_file: str | None = opt(None, "TOML file read before CLI overrides are applied")
    dump_folder: str = opt(
        "./outputs",
        "Folder for logs, metrics.jsonl, TensorBoard and traces; a URL (s3://bucket/run) is "
        "written through a local mirror under TITAN_CACHE_DIR that the launcher uploads",
    )
    dump_sync_interval_s: float = opt(
        60.0,
        "With a URL job.dump_folder: seconds between uploads of what changed in its local "
        "mirror (each node uploads its ranks' files, and again when the run ends)",
    )
    description: str = opt("", "Free-text description of the run, logged at start")
    print_config: bool = opt(False, "Print the merged config (defaults < TOML < CLI) at start")
    custom_import: list[str] = opt(
        [],
        "Plugins imported before the config is read, by the launcher and every worker: "
        "dotted modules on PYTHONPATH or .py paths; they register families, optimizers, "
        "metrics writers and config sections",
    )


@dataclass
class Model:
    name: str = opt("llama3", "Model family, a key of the train-spec registry")
    flavor: str = opt("debugmodel", "Model size within the family (e.g. debugmodel, 1B, 8B)")
    tokenizer_path: str = opt(
        "assets/tokenizer/tokenizer.json", "HF tokenizers tokenizer.json (or a folder holding one)"
    )
    converters: list[str] = opt(
        [],
        "Rewrites of the model before the parallelisms, by name: float8 (torchao; see "
        "[float8]), or a plugin's; lora and chunked_loss also turn on by lora.rank and "
        "training.loss_chunk_tokens",
    )
    attn_mask_type: Literal["causal", "block_causal"] = opt(
        "causal",
        "causal: attend to every earlier token of the packed window; block_causal: "
        "only to earlier tokens of the same document (documents start at BOS)",
    )
    document_positions: bool = opt(
        False, "With block_causal: restart RoPE positions at 0 at every document"
    )


@dataclass
class Training:
    device: Literal["auto", "cpu", "cuda"] = opt(
        "auto", "Device: auto = CUDA (NCCL) when a GPU is visible, else CPU (gloo)"
    )
    dataset: str = opt(
        "kjv", "Dataset: bundled name (kjv), local file/folder, or HF hub name[:subset] (streamed)"
    )
    dataset_path: str | None = opt(None, "Local path that overrides where `dataset` is read from")
    dataset_text_field: str = opt("text", "Column holding the document text")
    dataset_format: Literal["text", "chat", "images"] = opt(
        "text",
        "text: documents packed into windows, every token trained; chat: conversations "
        "(a `messages` column) rendered with the chat template, the loss on assistant "
        "tokens only (see [chat]); images: image-text records for a vision-language model, "
        "the loss on the text after the images (see [images])",
    )
    dataset_mix: list[str] = opt(
        [],
        "Weighted sources instead of dataset/dataset_path, as SOURCE=WEIGHT (a local file, "
        "folder or token-shard folder, or a bundled name), e.g. data/web=0.7,data/code=0.3",
    )
    dataset_streaming: bool = opt(
        False,
        "Stream local files as hub datasets are (each dp rank reads its own shard, no "
        "tokenized copy in memory); hub names always stream",
    )
    dataset_stream_order: Literal["rank", "global"] = opt(
        "rank",
        "Streamed data: rank = each dp rank reads its own shard (resume needs the same dp "
        "degree); global = every rank reads the whole stream and keeps its slice of each global "
        "batch (resumes on any dp degree; each rank tokenizes all the text)",
    )
    dataset_shuffle: bool = opt(True, "Shuffle packed sequences each epoch (local datasets)")
    skip_documents: str = opt(
        "",
        "A file of documents to leave out (lines of JSON as spikes.jsonl names them: "
        '{"dataset": ..., "document": ...}): their labels are not trained; every other token '
        "stays in its place",
    )
    dataloader_num_workers: int = opt(
        0,
        "Processes fetching batches ahead (local and pretokenized data; streamed data is "
        "read in the trainer's process)",
    )
    dataloader_prefetch_factor: int = opt(2, "Batches each dataloader worker keeps ready")
    local_batch_size: int = opt(8, "Sequences per microbatch on each data-parallel rank")
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step over all ranks; -1 = local x dp (no accumulation)"
    )
    global_batch_schedule: list[str] = opt(
        [],
        "Batch-size ramp-up: 'step:size' entries (e.g. 1:64,500:128), each global batch size "
        "used from its step on (global_batch_size before the first); the data continues "
        "exactly, gradient accumulation adjusting",
    )
    batch_lr_scaling: Literal["none", "sqrt", "linear"] = opt(
        "none",
        "The lr of a scheduled batch size: optimizer.lr x (size / global_batch_size) to the "
        "power 0 (none), 1/2 (sqrt) or 1 (linear)",
    )
    seq_len: int = opt(2048, "Tokens per training sequence (the longest, with a seq_len_schedule)")
    seq_len_schedule: list[str] = opt(
        [],
        "Sequence-length warm-up: 'step:length' entries (e.g. 1:512,1000:2048), each length "
        "a divisor of seq_len used from its step on (seq_len before the first); a window of "
        "seq_len / n tokens is one of the n pieces of a seq_len window",
    )
    seq_len_schedule_keeps: Literal["tokens", "sequences"] = opt(
        "tokens",
        "What a step at a shorter length keeps: tokens (seq_len / length times the sequences, "
        "microbatches too) or sequences (the batch sizes, fewer tokens a step)",
    )
    max_norm: float = opt(1.0, "Gradient-norm clipping threshold; 0 disables clipping")
    z_loss_weight: float = opt(
        0.0,
        "PaLM's z-loss: this weight x log(Z)^2 per counted token, Z the softmax normalizer of "
        "the output logits (logged as z_loss; PaLM used 1e-4); 0: off",
    )
    loss_chunk_tokens: int = opt(
        0,
        "Compute the cross-entropy this many tokens at a time, so the whole logits never "
        "exist (one output-layer matmul more per chunk in backward); 0: off",
    )
    steps: int = opt(10000, "Optimizer steps to train, >= 1 (the lr schedule spans them)")
    exit_at_step: int = opt(
        -1,
        "Stop after this step (saving a checkpoint if enabled) keeping the schedule of "
        "training.steps, e.g. for time-limited jobs; -1 = train all steps",
    )
    mixed_precision_param: Literal["bfloat16", "float32"] = opt(
        "bfloat16", "Compute dtype of parameters in forward/backward (master weights stay fp32)"
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = opt(
        "float32", "Dtype of gradient reductions across data-parallel ranks"
    )
    enable_cpu_offload: bool = opt(
        False, "With FSDP: keep params, grads and optimizer state in host memory"
    )
    seed: int = opt(0, "Seed for weight init, data order and RNG; same seed -> same weights")
    deterministic: bool = opt(False, "Use deterministic algorithms (slower; for debugging)")
    gc_freq: int = opt(50, "Run a timed gc.collect every N steps (automatic GC is disabled)")
    on_nonfinite: Literal["stop", "skip"] = opt(
        "stop", "On a NaN/Inf loss or grad norm: stop with an error, or skip the optimizer step"
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(
        1, "Replicas of the model (DDP, or the outer dim of HSDP); 1 = none"
    )
    data_parallel_shard_degree: int = opt(
        -1, "FSDP shard degree; -1 = whatever the other degrees leave of the world size"
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default", "Free gathered params after forward: default = yes, except with pipelining"
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree (heads and FFN split)")
    enable_sequence_parallel: bool = opt(
        True, "With TP: shard norms and residuals along the sequence (saves activation memory)"
    )
    disable_loss_parallel: bool = opt(
        False, "With TP: gather logits instead of computing the loss on vocab shards"
    )
    context_parallel_degree: int = opt(
        1, "Context-parallel degree (each sequence split over this many ranks)"
    )
    context_parallel_type: Literal["ring", "alltoall", "hybrid"] = opt(
        "ring",
        "How CP attention sees the whole sequence: ring (K/V chunks go round the ranks), "
        "alltoall (Ulysses: each rank takes 1/cp of the heads for every token; heads and "
        "kv heads per TP rank must divide by cp) or hybrid (all-to-all inside groups of "
        "context_parallel_alltoall_degree ranks, a ring of K/V across them)",
    )
    context_parallel_alltoall_degree: int = opt(
        2, "Hybrid CP: ranks of each all-to-all group (divides cp; heads per TP rank by it)"
    )
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = opt(
        "allgather", "Ring CP: how K/V shards travel, all-gathered once or passed round"
    )
    context_parallel_load_balance: bool = opt(
        True, "Head-tail sequence sharding so every cp rank gets equal causal-attention work"
    )
    expert_parallel_degree: int = opt(
        1,
        "Expert-parallel degree: an MoE's routed experts split over this many ranks, which "
        "it borrows from data_parallel_shard_degree x context_parallel_degree (1: off)",
    )
    pipeline_parallel_degree: int = opt(1, "Pipeline-parallel degree (layers split into stages)")
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble "
        "or DualPipeV",
    )
    pipeline_parallel_microbatch_size: int = opt(
        1, "Sequences per pipeline microbatch (local_batch_size must divide by it)"
    )
    pipeline_parallel_layers_per_stage: int | None = opt(
        None,
        "Layers per stage (sets the number of stages); None = 1 stage per rank "
        "(2 for multi-stage schedules)",
    )
    pipeline_parallel_split_points: list[str] = opt(
        [], "Explicit stage boundaries: first layer of each later stage, e.g. layers.2,layers.4"
    )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Collective timeout until the first step completes")
    train_timeout_seconds: int = opt(
        100,
        "After the first step: collective timeout, and the limit a step (plus its "
        "checkpoint/validation) may run before the watchdog dumps stacks and exits",
    )
    trace_buf_size: int = opt(
        2000,
        "NCCL flight recorder: the last N collectives of each rank, dumped under "
        "<dump_folder>/<comm.save_traces_folder> when a collective times out (CUDA/NCCL only; "
        "0 = off)",
    )
    save_traces_folder: str = opt("comm_traces", "Flight recorder folder inside the dump folder")


@dataclass
class Memory:
    device_memory_gib: float = opt(
        0.0,
        "Memory of one device that each rank's planned bytes must fit (python -m "
        "titan.planner); 0 = the visible GPU's own, no check on CPU",
    )
    check: Literal["error", "warn", "off"] = opt(
        "error",
        "When a rank's parameters + gradients + optimizer states exceed the device "
        "memory: refuse before launch, warn, or skip the check",
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    memory: Memory = field(default_factory=Memory)
    # the sections registered by titan's components, its families ([qwen3], ...:
    # titan.config.family_options) and plugins: titan.config.extensions
    extensions: dict[str, Any] = field(default_factory=extensions.sections, repr=False)
    # not a section: where each value set by a file or the command line came from
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # not a section: set by python -m titan.planner, which needs the tokenizer only for its
    # vocabulary size, so a missing one plans the flavor's vocabulary instead of failing
    plan_only: bool = field(default=False, repr=False, compare=False)

    def __getattr__(self, name: str):
        # job.<section> reaches a registered section; only called when no attribute has the name
        sections = self.__dict__.get("extensions") or {}
        if name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")


# sections that moved to their components: the old import names keep working, saying once
# where each lives now
_MOVED = {
    "ParamGroup": "titan.components.optim.optimizer_spec",
    "Optimizer": "titan.components.optim.optimizer_spec",
    "LRScheduler": "titan.components.optim.lr_scheduler_spec",
    "ActivationCheckpoint": "titan.parallelisms.sections",
    "Compile": "titan.parallelisms.sections",
    "Checkpoint": "titan.components.checkpoint.spec",
    "Metrics": "titan.components.observability.metrics_spec",
    "Validation": "titan.components.training.validation_spec",
    "Profiling": "titan.components.observability.profiling_spec",
    "FaultTolerance": "titan.components.fault_tolerance.spec",
    "Debug": "titan.components.fault_tolerance.injection_spec",
}
_told: set[str] = set()


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import logging

    if name not in _told:
        _told.add(name)
        logging.getLogger("titan").warning(
            "titan.config.job_config.%s is now %s.%s", name, _MOVED[name], name
        )
    return getattr(importlib.import_module(_MOVED[name]), name)
