"""The job config: one dataclass per concern, field names after torchtitan.

Every field carries a one-line doc in its metadata; `--help` prints it. This module
must not import torch: the launcher validates configs before any heavy import.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

from titan.config import extensions
from titan.config.family_options import family_sections


def opt(default, doc: str):
    """A config field with its `--help` line."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class Job:
    config_file: str | None = opt(None, "TOML file read before CLI overrides are applied")
    dump_folder: str = opt("./outputs", "Folder for logs, metrics.jsonl, TensorBoard and traces")
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
    dataset_format: Literal["text", "chat"] = opt(
        "text",
        "text: documents packed into windows, every token trained; chat: conversations "
        "(a `messages` column) rendered with the chat template, the loss on assistant "
        "tokens only (see [chat])",
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
    seq_len: int = opt(2048, "Tokens per training sequence")
    max_norm: float = opt(1.0, "Gradient-norm clipping threshold; 0 disables clipping")
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
class ParamGroup:
    params: str = opt(
        "", "Regex searched in each parameter's name; the first group matching a parameter takes it"
    )
    lr: float | None = opt(None, "Peak learning rate of the group; None = optimizer.lr")
    weight_decay: float | None = opt(
        None, "Weight decay of the group; None = optimizer.weight_decay"
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer, a name in the optimizer registry (AdamW, Adam, ...)")
    lr: float = opt(8e-4, "Peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "Decoupled weight decay")
    implementation: Literal["fused", "foreach", "for-loop"] = opt(
        "fused", "Kernel: fused, foreach, or for-loop (fused falls back where unsupported)"
    )
    state_dtype: Literal["float32", "bfloat16"] = opt(
        "float32", "Dtype of Adam's moment estimates between steps (the update runs in float32)"
    )
    param_groups: list[ParamGroup] = opt(
        [],
        "Parameters trained with their own lr or weight decay, by name: "
        "[[optimizer.param_groups]] tables (params = regex, lr, weight_decay); on the command "
        "line in TOML's inline form, '[{params = \"norm\", weight_decay = 0.0}]'",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Linear warmup steps from ~0 to the peak lr")
    decay_ratio: float | None = opt(
        None, "Fraction of steps spent decaying at the end; None = all after warmup (<1 gives WSD)"
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = opt("linear", "Shape of the decay phase")
    min_lr_factor: float = opt(0.0, "Final lr as a fraction of the peak lr")


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
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = opt(
        "none", "Recompute activations in backward: none, full (every block) or selective"
    )
    selective_ac_option: str = opt(
        "2",
        "Selective AC: 'op' = save matmul/attention outputs per op; an integer N = "
        "checkpoint every N-th block",
    )


@dataclass
class Compile:
    enable: bool = opt(
        False, "torch.compile the model (per transformer block; whole model with TP on CPU)"
    )
    backend: str = opt("inductor", "torch.compile backend")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save DCP checkpoints and resume from the newest complete one")
    folder: str = opt("checkpoint", "Checkpoint folder inside the dump folder (step-N subfolders)")
    interval: int = opt(500, "Save every N steps (and after the last step)")
    keep_latest_k: int = opt(
        10, "Keep the newest k complete checkpoints, purge older ones; 0 = all"
    )
    write_threads: int = opt(
        2,
        "Files each rank writes at once in a save (DCP's thread_count): serializing and "
        "checksumming overlap the writes the kernel blocks in (1: one file, DCP's default)",
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = opt(
        "disabled", "Copy during the next step, write in a background process; pinned needs CUDA"
    )
    enable_first_step_checkpoint: bool = opt(False, "Also save right after step 1")
    load_step: int = opt(-1, "Resume from this step's checkpoint instead of the newest (-1)")
    allow_rope_change: bool = opt(
        False,
        "A long-context phase: a resume (or initial load) may change the model's RoPE "
        "settings (rope_*: scaling factor, original length, theta) and seq_len; every other "
        "architecture field must still match",
    )
    verify: Literal["full", "fast", "off"] = opt(
        "full",
        "Before a resume: full = every file against its checksum (the ranks share the "
        "reading), fast = file sizes only, off = trust the completion marker",
    )
    initial_load_path: str | None = opt(
        None,
        "Start from this checkpoint (a step folder) or, with initial_load_in_hf, an HF "
        "safetensors folder; ignored when the checkpoint folder holds one to resume from",
    )
    initial_load_model_only: bool = opt(True, "From initial_load_path load only the model weights")
    initial_load_in_hf: bool = opt(False, "initial_load_path is an HF folder (safetensors)")
    exclude_from_loading: list[str] = opt(
        [], "State parts not restored on resume: optimizer, lr_scheduler, dataloader, train_state"
    )
    last_save_model_only: bool = opt(
        False, "The final save holds only the model (in export_dtype), for export or eval"
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "Dtype of a model-only or HF final save"
    )
    last_save_in_hf: bool = opt(
        False,
        "The final save is an HF folder (sharded safetensors, config.json, tokenizer) "
        "in export_dtype, written by every rank from its shards",
    )
    hf_max_shard_size: str = opt("5GB", "Size limit of each safetensors file of an HF save")
    create_seed_checkpoint: bool = opt(
        False, "Initialize the model, save it as step-0 and exit (not needed for same-seed runs)"
    )


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False,
        "torchft replica groups: each group is its own run_train.sh job; needs "
        "pip install torchft and a lighthouse at TORCHFT_LIGHTHOUSE",
    )
    replica_id: int = opt(0, "This group's id, 0 .. group_size-1")
    group_size: int = opt(1, "Number of replica groups (they average gradients through torchft)")
    min_replica_size: int = opt(1, "Fewest live groups that may commit a step")
    timeout_seconds: int = opt(30, "torchft collective/quorum timeout (quorum gets 3x)")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every N steps")
    enable_tensorboard: bool = opt(
        True, "Write TensorBoard events under <dump_folder>/<save_tb_folder>"
    )
    save_tb_folder: str = opt("tb", "TensorBoard folder inside the dump folder")
    peak_flops: float = opt(
        0.0,
        "Peak FLOP/s of one device for MFU; 0 = the GPU's datasheet peak (an unknown GPU: "
        "a measured bf16 matmul), and no MFU on CPU, which publishes no peak",
    )
    disable_color_printing: bool = opt(False, "Plain console output without ANSI colors")
    enable_wandb: bool = opt(
        False,
        "Log the same values as TensorBoard to Weights & Biases (pip install "
        "'titan[wandb]'; WANDB_MODE=offline keeps the run on disk under the dump folder)",
    )
    wandb_project: str = opt("titan", "W&B project")
    wandb_run_name: str | None = opt(None, "W&B run name; None = the dump folder's name")
    wandb_entity: str | None = opt(None, "W&B entity (team or user); None = the login's default")
    wandb_tags: list[str] = opt([], "W&B run tags")
    per_rank: bool = opt(
        True,
        "Every log step, gather each rank's own step time (its wall time less its waits "
        "for other ranks) and data wait; log the slowest rank and the spread",
    )
    straggler_threshold: float = opt(
        0.2, "Warn when a rank's own step time exceeds the median's by more than this fraction"
    )
    straggler_log_steps: int = opt(
        3, "... for this many consecutive log steps (one warning per episode)"
    )


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Collect torch profiler traces")
    save_traces_folder: str = opt("profile_traces", "Trace folder inside the dump folder")
    profile_freq: int = opt(10, "Profile one step out of every N")
    profiler_warmup: int = opt(3, "Profiler warmup steps before each traced step")
    profiler_active: int = opt(1, "Steps traced each time")
    enable_memory_snapshot: bool = opt(
        False,
        "Record the CUDA caching allocator's history and dump it every profile_freq "
        "steps and on an out-of-memory error (CUDA only; view at pytorch.org/memory_viz)",
    )
    memory_snapshot_start_step: int = opt(1, "The step from which the memory snapshot records")
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Memory snapshot folder inside the dump folder"
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
class Validation:
    enable: bool = opt(False, "Evaluate loss on a held-out dataset during training")
    dataset: str = opt("kjv_valid", "Validation dataset (same forms as training.dataset)")
    dataset_path: str | None = opt(None, "Local path that overrides where the dataset is read from")
    dataset_streaming: bool = opt(False, "Stream local files (as training.dataset_streaming)")
    freq: int = opt(500, "Validate every N steps (and after the last step)")
    steps: int = opt(-1, "Validation batches per validation; -1 = one full pass over the dataset")
    global_batch_size: int = opt(
        -1,
        "Sequences per validation batch over all data-parallel ranks, each taking an equal "
        "share: the same sequences, so the same val_loss, on every layout; -1: "
        "local_batch_size x dp (then val_loss depends on dp)",
    )
    local_batch_size: int = opt(
        -1,
        "Sequences per forward on each data-parallel rank (a rank's share of a validation "
        "batch may take several); -1: its whole share (8 when global_batch_size is -1 too)",
    )


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
class Debug:
    nan_at_step: int = opt(
        -1, "Test hook: make the model's output, so the loss, NaN at this step (-1 = never)"
    )
    sleep_at_step: int = opt(-1, "Test hook: debug.sleep_rank sleeps inside this step (-1 = never)")
    sleep_rank: int = opt(0, "Test hook: the rank that sleeps at debug.sleep_at_step")
    sleep_seconds: float = opt(3600.0, "Test hook: how long that rank sleeps")
    sleep_every_step: bool = opt(
        False, "Test hook: sleep in every step from debug.sleep_at_step on (a straggler)"
    )
    kill_in_checkpoint_step: int = opt(
        -1,
        "Test hook: debug.kill_rank SIGKILLs itself while saving this step's checkpoint, "
        "on the first launch only (-1 = never)",
    )
    kill_in_checkpoint_phase: Literal["written", "writing"] = opt(
        "written",
        "Test hook: when it dies: its files written, before the save is marked "
        "complete; or as it starts writing them (a synchronous save), peers mid-save",
    )
    kill_rank: int = opt(0, "Test hook: the rank killed by debug.kill_in_checkpoint_step")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)
    memory: Memory = field(default_factory=Memory)
    debug: Debug = field(default_factory=Debug)
    # the sections model families own ([qwen3], ...): titan.config.family_options
    families: dict[str, Any] = field(default_factory=family_sections, repr=False)
    # the sections registered by optimizers, writers and plugins: titan.config.extensions
    extensions: dict[str, Any] = field(default_factory=extensions.sections, repr=False)
    # not a section: where each value set by a file or the command line came from
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # not a section: set by python -m titan.planner, which needs the tokenizer only for its
    # vocabulary size, so a missing one plans the flavor's vocabulary instead of failing
    plan_only: bool = field(default=False, repr=False, compare=False)

    def __getattr__(self, name: str):
        # job.<family> reaches a family's section; only called when no attribute has the name
        for added in ("families", "extensions"):
            sections = self.__dict__.get(added) or {}
            if name in sections:
                return sections[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")
