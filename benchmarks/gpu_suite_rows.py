"""What the GPU suite runs: its rows, the model shapes behind them, and the targets.

A shape is a titan flavor, or a flavor cut to fewer layers, named `<flavor>_cut<layers>`
(e.g. `8B_cut8`: Llama 3 8B's width, heads and FFN with 8 of its 32 layers, so the model,
AdamW state and seq_len-8192 activations fit one GPU). gpu_suite_titan.py registers such
names in the trainer process; the torchtitan peer is built from the same numbers.
"""

import re
from dataclasses import asdict, dataclass

TARGET_TPS_RATIO = 1.05  # titan tokens/s >= 1.05 x torchtitan's
TARGET_MEM_RATIO = 1.0  # titan peak memory <= torchtitan's
TARGET_MFU_PCT = 45.0  # bf16 at the 8B shape, against the datasheet peak
TARGET_ASYNC_PCT = 10.0  # an async save blocks training < 10% of a sync save


@dataclass
class Row:
    kind: str  # train (titan), peer (torchtitan, same settings as the train row before it),
    #            checkpoint (titan, sync vs async saves) or tests (pytest on the device)
    name: str
    shape: str = ""
    model: str = "llama3"  # the family (model.name) whose flavor `shape` names
    seq_len: int = 0
    batch: int = 0
    steps: int = 0
    warmup: int = 0  # steps left out of tokens/s (compilation, autotuning, allocator growth)
    dtype: str = "bfloat16"
    float8: bool = False
    ac: str = "selective"
    compile: bool = False
    checkpoint_mode: str = ""  # disabled (sync) or async / async_with_pinned_mem
    pytest_args: tuple = ()

    def as_dict(self) -> dict:
        return asdict(self)


def profile_flags(steps: int) -> list[str]:
    """Trace step `steps` (a run's last) after one profiler warm-up step: titan's profiling
    options, which torchtitan's CLI names alike."""
    return [
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        str(steps),
        "--profiling.profiler_warmup",
        "1",
        "--profiling.profiler_active",
        "1",
    ]


def split_shape(shape: str) -> tuple[str, int | None]:
    """'8B_cut8' -> ('8B', 8); '1B' -> ('1B', None)."""
    m = re.fullmatch(r"(.+)_cut(\d+)", shape)
    return (m[1], int(m[2])) if m else (shape, None)


def model_args(shape: str, vocab_size: int, seq_len: int, model: str = "llama3"):
    """titan's model args for a shape of family `model`, with the tokenizer's vocabulary, as
    the trainer builds them."""
    from titan.models.spec import get_train_spec

    base, layers = split_shape(shape)
    args = (
        get_train_spec(model).flavors[base].with_updates(vocab_size=vocab_size, max_seq_len=seq_len)
    )
    return args.with_updates(n_layers=layers) if layers else args


def _label(shape, dtype, float8, ac, compile_):
    prec = "float8" if float8 else {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    ac_name = {"selective": "SAC", "full": "full AC", "none": "no AC"}[ac]
    return f"{shape} {prec} {ac_name}{' compile' if compile_ else ''}"


def plan(
    device: str,
    tiny: bool,
    cut_layers: int,
    steps: int | None,
    kinds: set[str],
    tests: list[str] | None,
    moe_batch: int = 4,
) -> list[Row]:
    """The rows in run order: each titan training row directly followed by its torchtitan
    peer, so drift of the machine hits both alike. The MoE rows run `moe_batch` sequences a
    step (their names say how many)."""
    if tiny:
        # debug-model-sized stand-ins; fp32, as bf16 matmuls on CPUs without bf16 units run
        # 20x slower; compile on one row only (its compilation dominates a tiny run)
        big, small, ckpt_shape = "debugmodel_cut2", "debugmodel", "debugmodel"
        moes = {"deepseek_v3": "debugmodel", "qwen3": "debugmodel_moe"}
        seq, big_batch, small_batch, n, warm, dtype = 64, 2, 2, steps or 6, 2, "float32"
        compile_rows = {0}
    else:
        big, small, ckpt_shape = f"8B_cut{cut_layers}", "1B", "1B_cut4"
        # Moonlight-16B-A3B's width (64 experts, 6 a token, 2 shared) and Qwen3-30B-A3B's
        # (128 experts, 8 a token), 4 layers each (Moonlight's first one dense)
        moes = {"deepseek_v3": "16B_cut4", "qwen3": "30B-A3B_cut4"}
        seq, big_batch, small_batch, n, warm, dtype = 8192, 1, 2, steps or 20, 8, "bfloat16"
        compile_rows = {0, 1, 2, 3}

    def pair(label: str, **common) -> list[Row]:
        kind_rows = [k for k in ("train", "peer") if k in kinds]
        return [Row(k, label, **common) for k in kind_rows]

    # the order is what a short lease should get first: the eager MoE pairs (the open
    # question), the 8B pair, the compiled MoE pairs, the CUDA tests, the 1B pair and the
    # saves; full AC and float8 last (see --budget). A device call of 10 minutes holds the
    # first 8-9 rows
    moe_pairs = {}
    # compiled on the GPU only (on the CPU, compilation would dominate the dry run)
    for c in (False,) if tiny else (False, True):
        for model, shape in moes.items():
            family = {"deepseek_v3": "DeepSeek-V3", "qwen3": "Qwen3-MoE"}[model]
            moe_pairs.setdefault(c, []).extend(
                pair(
                    f"{family} {_label(shape, dtype, False, 'selective', c)} batch {moe_batch}",
                    shape=shape,
                    model=model,
                    seq_len=seq,
                    batch=moe_batch,
                    steps=n,
                    warmup=warm,
                    dtype=dtype,
                    compile=c,
                )
            )
    rows = list(moe_pairs[False])
    train = [
        (big, False, "selective"),
        (small, False, "selective"),
        (big, False, "full"),
        (big, True, "selective"),
    ]
    pairs = []
    for i, (shape, f8, ac) in enumerate(train):
        c = i in compile_rows
        pairs.append(
            pair(
                _label(shape, dtype, f8, ac, c),
                shape=shape,
                seq_len=seq,
                batch=big_batch if shape == big else small_batch,
                steps=n,
                warmup=warm,
                dtype=dtype,
                float8=f8,
                ac=ac,
                compile=c,
            )
        )
    rows += pairs[0] + moe_pairs.get(True, [])
    if "tests" in kinds:
        if tests is None:
            # on the GPU: the gpu-marked tests and the debug model's learning run on CUDA;
            # no context-parallel test (one GPU has no peer rank); the train rows are the
            # bf16 smoke runs. --tests "-m 'integration or gpu' tests" runs them all (long)
            tests = (
                ["tests/unit/test_preflight.py::test_cuda_device_needs_a_gpu"]
                if tiny
                else [
                    "-m",
                    "integration or gpu",
                    "tests/unit/test_preflight.py",
                    "tests/unit/test_observability.py",
                    "tests/integration/test_train_e2e.py::test_debug_model_learns_and_logs",
                ]
            )
        rows.append(
            Row("tests", f"pytest on {device}: {' '.join(tests)}", pytest_args=tuple(tests))
        )
    rows += pairs[1]
    if "checkpoint" in kinds:
        # saves every 2 steps: the first async save allocates (and pins) the staging buffers,
        # the last is always blocking; the ones between are the steady state compared
        async_mode = "async" if device == "cpu" else "async_with_pinned_mem"
        for mode in ("disabled", async_mode):
            what = "sync" if mode == "disabled" else mode
            rows.append(
                Row(
                    "checkpoint",
                    f"{ckpt_shape} save {what}",
                    shape=ckpt_shape,
                    seq_len=seq if tiny else 2048,
                    batch=1,
                    steps=5 if tiny else 7,
                    dtype=dtype,
                    ac="none",
                    checkpoint_mode=mode,
                )
            )
    for pair in pairs[2:]:
        rows += pair
    return rows
