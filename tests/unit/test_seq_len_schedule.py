"""training.seq_len_schedule: shorter sequences are pieces of training.seq_len windows, trained
in the stream's order on every layout, across a resume in the middle of the warm-up."""

import shutil

import pytest
import torch

from tests.forked import TWO_RANK_LAYOUTS, run_trainer, tiny_run
from titan.components.data.dataloader import DataShard, build_text_dataloader
from titan.plan.seq_len_schedule import SeqLenSchedule, StepShape

SEQ = 32
# global batches of 4 windows of 32 tokens in microbatches of 2: 8, 16 and 32 tokens divide
# over 1 and 2 ranks and both context-parallel chunks
BASE = [*tiny_run(6), "--training.local_batch_size", "2", "--training.global_batch_size", "4"]
WARMUP = ["--training.seq_len_schedule", "1:8,3:16,5:32"]
LENGTHS = [8, 8, 16, 16, 32, 32]
CK = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def losses(rows) -> list[float]:
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def warmup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warmup")
    return run_trainer(tmp, 1, [*BASE, *WARMUP, *CK], deadline_s=120), tmp / "dump"


def test_each_step_has_its_shape():
    s = SeqLenSchedule(32, ((1, 8), (3, 16), (5, 32)), "tokens")
    assert [s.length_at(k) for k in range(1, 7)] == LENGTHS
    assert SeqLenSchedule(32, ((3, 16),)).length_at(2) == 32  # before the first entry
    # 4 windows of 32 in microbatches of 2: as 16 sequences of 8 in microbatches of 8 ...
    assert s.shape(4, 2, 1, 1) == StepShape(8, 16, 8, 1, 4, 4)
    # ... or, keeping the sequences, 4 of 8 (one window) in microbatches of 2
    kept = SeqLenSchedule(32, ((1, 8),), "sequences")
    assert kept.shape(4, 2, 1, 1) == StepShape(8, 4, 2, 1, 1, 4)
    assert kept.shape(4, 2, 1, 9) == StepShape(8, 4, 2, 1, 1, 4)


def _loaders(tokenizer, dp: int, global_batch: int, local: int):
    return [
        build_text_dataloader(
            dataset="kjv",
            dataset_path=None,
            tokenizer=tokenizer,
            seq_len=SEQ,
            local_batch_size=local,
            global_batch_size=global_batch,
            shard=DataShard(dp_rank=r, dp_world_size=dp),
            seed=0,
        )
        for r in range(dp)
    ]


def _global_batches(loaders, shapes):
    """Each step's batch over all ranks ((inputs, labels), rank by rank), resized to its
    (windows, pieces, local batch) first."""
    its = [iter(ld) for ld in loaders]
    out = []
    for shape in shapes:
        parts = []
        for ld, it in zip(loaders, its):
            if shape is not None:
                ld.resize(*shape)
            parts.append(next(it))
        out.append([torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels")])
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_shorter_windows_are_pieces_of_the_longest(tokenizer, dp):
    """The rule: every step's sequences, over all ranks, are its seq_len windows cut in
    pieces, inputs and labels alike, the stream going on across each change of length."""
    whole = _global_batches(_loaders(tokenizer, dp, 4, 4 // dp), [None] * 6)
    # keeping tokens: 4 windows a step, cut in 4, 2, 1 (16, 8, 4 sequences)
    shapes = [(4, n, 4 * n // dp) for n in (4, 4, 2, 2, 1, 1)]
    cut = _global_batches(_loaders(tokenizer, dp, 4, 4 // dp), shapes)
    for (x, y), (cx, cy) in zip(whole, cut):
        assert torch.equal(cx.reshape(4, SEQ), x) and torch.equal(cy.reshape(4, SEQ), y)
    # keeping sequences: 4 sequences of 8 a step are one window; 4 steps take a whole batch
    kept = _global_batches(_loaders(tokenizer, dp, 4, 4 // dp), [(1, 4, 4 // dp)] * 8)
    for b in range(2):
        x, y = whole[b]
        steps = kept[4 * b : 4 * b + 4]
        assert torch.equal(torch.cat([s[0] for s in steps]).reshape(4, SEQ), x)
        assert torch.equal(torch.cat([s[1] for s in steps]).reshape(4, SEQ), y)


def test_the_trainer_trains_the_rules_sequences(warmup, tmp_path, tokenizer):
    """At a learning rate of 1e-30 no float32 weight moves (an update is below its resolution),
    so every step's loss is the initial model's on its batch: the trainer's losses equal the
    losses of the rule's pieces, computed here; the tokens counted are the same at every
    length."""
    from titan.config import parse_args
    from titan.plan.run_plan import plan_run

    rows = run_trainer(tmp_path, 1, [*BASE, *WARMUP, "--optimizer.lr", "1e-30"], deadline_s=120)
    job = parse_args(BASE)
    args = plan_run(job, 1).model_args
    from titan.models.spec import get_train_spec

    with torch.device("meta"):
        model = get_train_spec(job.model.name).model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(job.training.seed, buffer_device=torch.device("cpu"))
    whole = _global_batches(_loaders(tokenizer, 1, 4, 4), [None] * 6)
    expected = []
    with torch.no_grad():
        for (x, y), length in zip(whole, LENGTHS):
            logits = model(x.reshape(-1, length))
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.reshape(-1))
            expected.append(ce.item())
    assert losses(rows) == pytest.approx(expected, rel=1e-5)
    assert [r["tokens_seen"] for r in rows] == [4 * SEQ * k for k in range(1, 7)]
    assert [r["tokens_seen"] for r in warmup[0]] == [4 * SEQ * k for k in range(1, 7)]


LAYOUTS = {**TWO_RANK_LAYOUTS, "cp2": ["--parallelism.context_parallel_degree", "2"]}


@pytest.mark.slow("a 2-rank training of 6 steps")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_warms_up_as_one_rank(warmup, tmp_path, layout):
    rows, _ = warmup
    got = run_trainer(tmp_path, 2, [*BASE, *WARMUP, *LAYOUTS[layout]], deadline_s=180)
    assert losses(got) == pytest.approx(losses(rows), rel=1e-5)
    assert [r["tokens_seen"] for r in got] == [r["tokens_seen"] for r in rows]
    # the FLOPs a token at the step's length (context parallelism shards the batch in place)
    for a, b in zip(rows, got):
        assert b["tflops"] / b["tps"] == pytest.approx(a["tflops"] / a["tps"], rel=1e-9)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resume_inside_the_warmup_continues_it(warmup, tmp_path, nproc):
    """From step 4's checkpoint (length 16, the next step's 32): bitwise on 1 rank; on 2
    (FSDP 2) within 1e-5."""
    rows, dump = warmup
    shutil.copytree(dump / "checkpoint" / "step-4", tmp_path / "dump" / "checkpoint" / "step-4")
    resumed = run_trainer(tmp_path, nproc, [*BASE, *WARMUP, *CK], deadline_s=120)
    if nproc == 1:
        assert losses(resumed) == losses(rows[4:])
    else:
        assert losses(resumed) == pytest.approx(losses(rows[4:]), rel=1e-5)
    assert [r["tokens_seen"] for r in resumed] == [r["tokens_seen"] for r in rows[4:]]


def test_keeping_sequences_trains_fewer_tokens(tmp_path):
    rows = run_trainer(
        tmp_path, 1, [*BASE, *WARMUP, "--training.seq_len_schedule_keeps", "sequences"]
    )
    assert [r["tokens_seen"] for r in rows] == [32, 64, 128, 192, 320, 448]


def test_mfu_counts_each_steps_length(warmup):
    """A shorter sequence's attention costs less a token: the FLOPs logged follow the step's
    length (tflops / tps is the FLOPs a token)."""
    from titan.config import parse_args
    from titan.plan.run_plan import plan_run

    args = plan_run(parse_args(BASE), 1).model_args
    for r, length in zip(warmup[0], LENGTHS):
        per_token = r["tflops"] * 1e12 / r["tps"]
        assert per_token == pytest.approx(args.flops_per_token(length), rel=1e-9)
    assert args.flops_per_token(8) < args.flops_per_token(32)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--training.seq_len_schedule", "1:12"], r"'1:12': a length of 12 does not divide"),
        (["--training.seq_len_schedule", "1:64"], r"'1:64': a length of 64 does not divide"),
        (["--training.seq_len_schedule", "1:8,1:16"], r"'1:16': steps start at 1 and increase"),
        (["--training.seq_len_schedule", "8"], r"'8' is not 'step:length'"),
        (
            [*WARMUP, "--training.seq_len_schedule_keeps", "sequences"],
            r"step 1 trains 2 sequences of 8 tokens .* not a whole number of",
        ),
        (
            [
                *WARMUP,
                "--parallelism.context_parallel_degree",
                "2",
                "--training.seq_len_schedule",
                "1:2",
            ],
            r"step 1 at 2 tokens: .*divisible by 2 x context_parallel_degree",
        ),
        ([*WARMUP, "--training.dataset_streaming"], r"needs packed text read indexed"),
    ],
)
def test_a_schedule_the_run_cannot_take_is_refused(flags, message):
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    # the config's own problems are refused as it is read, the layout's when it is planned
    with pytest.raises(ConfigError, match=message):
        job = parse_args([*BASE, "--training.global_batch_size", "2", *flags])
        plan_run(job, 2 if "--parallelism.context_parallel_degree" in flags else 1)


def test_with_a_batch_ramp_each_step_takes_its_windows(tmp_path):
    """Both schedules: a step takes its global batch size in windows, at its length; on 2
    ranks as on 1."""
    ramp = ["--training.global_batch_schedule", "2:8,4:12"]
    one = run_trainer(tmp_path / "1", 1, [*BASE, *WARMUP, *ramp])
    two = run_trainer(tmp_path / "2", 2, [*BASE, *WARMUP, *ramp, *TWO_RANK_LAYOUTS["fsdp2"]])
    windows = [4, 8, 8, 12, 12, 12]
    assert [r["tokens_seen"] for r in one] == [SEQ * sum(windows[:k]) for k in range(1, 7)]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_moe_balance_is_per_sequence_of_the_steps_length(tmp_path):
    """Qwen3-MoE's per-sequence balancing loss divides by the step's sequence length: with
    near-uniform router probabilities at init each of its 3 layers' losses is about top_k = 2
    (x its weight 0.001), a little above (top-k picks the likelier experts; 8 tokens a sequence
    spread it more than 32); divided by the run's 32 tokens it would be a sixteenth."""
    moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
    rows = run_trainer(tmp_path, 1, [*moe, *BASE, *WARMUP, "--training.steps", "1"])
    balanced = 3 * 0.001 * 2
    assert 0.9 * balanced < rows[0]["moe_aux_loss"] < 1.5 * balanced
