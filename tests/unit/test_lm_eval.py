"""lm-evaluation-harness through titan (titan.components.evaluation, titan.tools.eval): per
request the same log-likelihoods, rolling log-likelihoods and greedy strings as lm-eval's own
`hf` backend on a model transformers saved, and the same scores on every bundled offline task;
`python -m titan.tools.eval` gives a trained run's DCP checkpoint and its HF export the same
scores, on 1 process and with the requests split over 2."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.forked import free_port, run_trainer, run_workers, tiny_run
from tests.layouts import layouts
from titan.components.data.tokenizer import Tokenizer
from titan.runtime.paths import REPO_ROOT

pytestmark = [
    pytest.mark.needs("lm_eval"),
    pytest.mark.skipif(sys.platform != "linux", reason="needs fork"),
]

TASKS = ["kjv_verse_cloze", "kjv_verse_book", "kjv_bits_per_byte", "kjv_verse_completion"]
MAX_LEN = 128


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A small Llama of titan's tokenizer, saved by transformers (through titan's export)."""
    import transformers

    from titan.components.checkpoint import hf_io
    from titan.models.llama3.args import Llama3Args
    from titan.models.llama3.model import Transformer
    from titan.models.spec import get_train_spec

    tmp = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(str(REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"))
    args = Llama3Args(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=tok.vocab_size,
        multiple_of=32,
        rope_theta=10000.0,
        max_seq_len=MAX_LEN,
    )
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    hf_io.save_hf(model.state_dict(), get_train_spec("llama3"), args, tmp / "titan")
    tok.save_hf(tmp / "titan")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "titan", dtype=torch.float32)
    hf.save_pretrained(tmp / "hf")
    transformers.AutoTokenizer.from_pretrained(tmp / "titan").save_pretrained(tmp / "hf")
    return tmp / "hf"


@pytest.fixture(scope="module")
def both(hf_folder):
    """(titan's LM, lm-eval's hf LM) over the same folder."""
    from lm_eval.models.huggingface import HFLM

    from titan.components.evaluation.lm_eval_model import TitanLM, model_scores
    from titan.config import parse_args
    from titan.models.spec import get_train_spec
    from titan.tools.generate import load_model

    job = parse_args(["--model.name", "llama3"])
    model, _ = load_model(hf_folder, job, get_train_spec("llama3"), MAX_LEN, torch.device("cpu"))
    tok = Tokenizer(str(hf_folder / "tokenizer.json"))
    titan = TitanLM(
        model_scores(model),
        tok,
        max_length=MAX_LEN,
        device=torch.device("cpu"),
        batch_size=4,
        decode=model,
    )
    hf = HFLM(
        pretrained=str(hf_folder),
        dtype="float32",
        add_bos_token=True,
        batch_size=4,
        max_length=MAX_LEN,
        device="cpu",
    )
    return titan, hf


def instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.needs("transformers")
def test_each_request_scores_as_lm_evals_hf_backend(both):
    titan, hf = both
    pairs = [
        ("In the beginning God created", " the heaven and the earth."),
        ("And God said,", " Let there be light"),
        ("", "Jesus wept."),  # an empty context: BOS
        ("The LORD is my shepherd; " * 12, "I shall not want."),  # cut to the last 128
    ]
    got, want = (lm.loglikelihood(instances("loglikelihood", pairs)) for lm in both)
    for (a, greedy_a), (b, greedy_b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    text = [("And the earth was without form, and void. " * 20,)]  # several windows
    (a,), (b,) = (lm.loglikelihood_rolling(instances("loglikelihood_rolling", text)) for lm in both)
    assert a == pytest.approx(b, abs=1e-4 * len(text[0][0]))
    ask = [("In the beginning", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False})]
    assert titan.generate_until(instances("generate_until", ask)) == hf.generate_until(
        instances("generate_until", ask)
    )


@pytest.mark.needs("transformers")
@pytest.mark.slow("every bundled task, 20 documents each, on both backends")
def test_every_bundled_task_scores_as_lm_evals_hf_backend(both):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from titan.components.evaluation.tasks import BUNDLED_TASKS

    manager = TaskManager(include_path=str(BUNDLED_TASKS))
    scores = [
        simple_evaluate(model=lm, tasks=TASKS, limit=20, task_manager=manager)["results"]
        for lm in both
    ]
    for task in TASKS:
        got, want = scores[0][task], scores[1][task]
        numbers = {k: v for k, v in want.items() if isinstance(v, float) and "stderr" not in k}
        assert numbers, task
        for key, value in numbers.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, key)


# ------------------------------------------------------------------ the command


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run's last DCP checkpoint and its HF export (float32, the run's tokenizer)."""
    from tests.unit.test_qwen3 import _script

    tmp = tmp_path_factory.mktemp("trained")
    ck = ["--checkpoint.enable", "--checkpoint.interval", "20", "--training.seq_len", "64"]
    run_trainer(tmp, 1, [*tiny_run(20), *ck], deadline_s=120)
    step = tmp / "dump" / "checkpoint" / "step-20"
    tokenizer = REPO_ROOT / "assets" / "tokenizer"
    convert = [str(step), str(tmp / "hf"), "--dtype", "float32", "--max-seq-len", "64"]
    _script("convert_to_hf").main([*convert, "--tokenizer", str(tokenizer)])
    return step, tmp / "hf"


def eval_args(checkpoint, out, tasks=("kjv_verse_cloze", "kjv_bits_per_byte")) -> list[str]:
    return [
        *("--checkpoint", str(checkpoint), "--tasks", ",".join(tasks), "--limit", "16"),
        *("--output_path", str(out), "--log_samples"),
        # the length trained at: the HF export's positions (the checkpoint's flavor has 2048)
        *("--max_length", "64"),
    ]


def results_of(out: Path) -> dict:
    (path,) = out.glob("*/results_*.json")
    return json.loads(path.read_text())["results"]


@pytest.mark.slow("a 20-step training and two evaluations of 2 tasks")
def test_a_checkpoint_and_its_hf_export_score_alike(trained, tmp_path, capsys):
    from titan.tools.eval import main

    dcp, hf = trained
    main(eval_args(dcp, tmp_path / "dcp"))
    table = capsys.readouterr().out
    assert "kjv_verse_cloze" in table and "bits_per_byte" in table
    main(eval_args(hf, tmp_path / "hf"))
    got, want = results_of(tmp_path / "dcp"), results_of(tmp_path / "hf")
    for task in ("kjv_verse_cloze", "kjv_bits_per_byte"):
        for key in ("acc,none", "bits_per_byte,none"):
            if key in want[task]:
                assert got[task][key] == pytest.approx(want[task][key], rel=1e-5), (task, key)
    assert list((tmp_path / "dcp").glob("*/samples_kjv_verse_cloze_*.jsonl"))
    # a uniform guess spends log2(2048) = 11 bits a token, and a token holds a byte or more
    assert 0 < got["kjv_bits_per_byte"]["bits_per_byte,none"] < 11


def _eval_rank(rank, world_size, port, argv):
    from tests.forked import torchrun_env

    torchrun_env(rank, world_size, port)
    from titan.tools.eval import main

    main(argv)
    return True  # a result: the rank finished


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
COMMAND_LAYOUTS = {  # name: (ranks, the checkpoint: "dcp" or "hf", flags)
    "requests": (2, "dcp", []),  # each rank the whole model
    "tp2": (2, "dcp", TP2),  # each rank a slice of each layer
    # the training layouts, built as training builds them
    "pp2_from_hf": (2, "hf", ["--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, "dcp", ["--parallelism.context_parallel_degree", "2"]),
    "fsdp2_tp2": (4, "dcp", TP2),
}


@pytest.fixture(scope="module")
def one_process(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    from titan.tools.eval import main

    main(eval_args(trained[0], out))
    return results_of(out)


@pytest.mark.slow("2 or 4 ranks evaluating 2 tasks")
@pytest.mark.parametrize("layout", COMMAND_LAYOUTS)
def test_ranks_score_as_one_process(trained, one_process, tmp_path, layout):
    nproc, which, flags = COMMAND_LAYOUTS[layout]
    checkpoint = dict(zip(("dcp", "hf"), trained))[which]
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    argv = [*eval_args(checkpoint, tmp_path / "out"), *flags]
    run_workers(_eval_rank, nproc, ranks, free_port(), argv, init_pg=False)
    got = results_of(tmp_path / "out")
    assert got.keys() == one_process.keys()
    for task, metrics in one_process.items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert got[task][key] == pytest.approx(value, rel=1e-5), (task, key)


# ------------------------------------------------------------------ in the loop

EVAL = [
    *("--eval.tasks", "kjv_verse_cloze,kjv_bits_per_byte,kjv_verse_completion"),
    *("--eval.freq", "4", "--eval.limit", "8"),
]
# long enough for the tasks' requests (the training model's RoPE table is this long)
LOOP = [*tiny_run(8), "--training.seq_len", "128"]
CK = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]


def evals_of(dump: Path) -> list[dict]:
    lines = (dump / "eval.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in lines]


@pytest.fixture(scope="module")
def in_loop(tmp_path_factory):
    """8 steps evaluated at 4 and 8 with a checkpoint at each, and the same without evals."""
    tmp = tmp_path_factory.mktemp("loop")
    plain = run_trainer(tmp / "plain", 1, LOOP, deadline_s=120)
    evaluated = run_trainer(tmp / "eval", 1, [*LOOP, *EVAL, *CK], deadline_s=300)
    return plain, evaluated, tmp / "eval" / "dump"


@pytest.mark.slow("the module's two trainings, plain and evaluating, are set up under it")
def test_evals_in_the_loop_leave_training_as_it_was(in_loop):
    plain, evaluated, dump = in_loop
    assert [(r["loss"], r["grad_norm"]) for r in plain] == [
        (r["loss"], r["grad_norm"]) for r in evaluated
    ]
    scores = evals_of(dump)
    assert [s["step"] for s in scores] == [4, 8]
    assert {"kjv_verse_cloze/acc", "kjv_bits_per_byte/bits_per_byte"} <= set(scores[0])
    assert "kjv_verse_completion/exact_match" in scores[0]


@pytest.mark.slow("an evaluation of the step-8 checkpoint as the loop made it")
def test_the_loop_scores_as_the_command_on_its_checkpoint(in_loop, tmp_path):
    from titan.tools.eval import main

    _, _, dump = in_loop
    tasks = "kjv_verse_cloze,kjv_bits_per_byte,kjv_verse_completion"
    argv = ["--checkpoint", str(dump / "checkpoint" / "step-8"), "--tasks", tasks]
    main([*argv, "--limit", "8", "--max_length", "128", "--output_path", str(tmp_path)])
    got, want = results_of(tmp_path), evals_of(dump)[-1]
    for key, value in want.items():
        if key != "step":
            task, metric = key.split("/")
            assert got[task][f"{metric},none"] == pytest.approx(value, rel=1e-5), key


LAYOUTS = {
    **layouts("fsdp2", "tp2", "cp2"),
    # the last stage's scores sent to the first; the two pipelines' FSDP all-gathers in
    # lockstep, their shapes agreed (a stage's first batch of a shape infers it collectively)
    "pp2_fsdp2": (
        4,
        ["--parallelism.pipeline_parallel_degree", "2"]
        + ["--parallelism.data_parallel_shard_degree", "2"],
    ),
}


@pytest.mark.slow("a 2- or 4-rank training that evaluates twice")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_scores_as_one_rank(in_loop, tmp_path, layout):
    _, _, dump = in_loop
    nproc, flags = LAYOUTS[layout]
    run_trainer(tmp_path, nproc, [*LOOP, *EVAL, *flags], deadline_s=300)
    for a, b in zip(evals_of(dump), evals_of(tmp_path / "dump"), strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-5), key


def test_a_resumed_run_evaluates_each_due_step_once(in_loop, tmp_path):
    import shutil

    _, _, dump = in_loop
    shutil.copytree(dump, tmp_path / "dump")
    shutil.rmtree(tmp_path / "dump" / "checkpoint" / "step-8")
    run_trainer(tmp_path, 1, [*LOOP, *EVAL, *CK], deadline_s=300)
    assert evals_of(tmp_path / "dump") == evals_of(dump)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval.freq", "0"], "must be >= 1"),
        (["--eval.limit", "0"], "must be > 0"),
    ],
)
def test_bad_eval_settings_are_config_errors(flags, message):
    from titan.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(["--eval.tasks", "kjv_verse_cloze", *flags])


def test_an_unknown_task_is_one_line(hf_folder, capsys):
    from titan.tools.eval import main

    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(hf_folder), "--tasks", "kjv_verse_cloze,nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("titan.tools.eval: --tasks: no lm-eval task named nope")


def test_an_unknown_task_in_the_loop_stops_the_launch():
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    job = parse_args([*tiny_run(2), "--eval.tasks", "kjv_verse_cloze,nope"])
    with pytest.raises(ConfigError, match="eval.tasks: no lm-eval task named nope"):
        plan_run(job, 1)


def test_a_layout_the_ranks_cannot_hold_is_one_line(trained, capsys):
    from titan.tools.eval import main

    pp2 = ["--parallelism.pipeline_parallel_degree", "2"]
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(trained[0]), "--tasks", "kjv_verse_cloze", *pp2])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("titan.tools.eval: parallelism: world size 1 is not divisible")


def test_the_training_console_gets_lm_evals_warnings_only(caplog, capsys):
    """Within an in-loop evaluation: lm-eval's INFO lines, its `--metadata` advice and its
    notes on titan's own tasks' metrics are left out, as are tqdm's bars on stderr; its other
    warnings go through."""
    import logging

    from tqdm import tqdm

    from titan.components.evaluation.in_loop import quiet_lm_eval

    task = logging.getLogger("lm_eval.api.task")
    with caplog.at_level(logging.INFO), quiet_lm_eval():
        logging.getLogger("lm_eval.evaluator").info("Selected tasks:")
        task.warning("kjv_verse_cloze: Custom kwargs can be passed to `--metadata` in console")
        task.warning("[Task: kjv_bits_per_byte] metric x is defined, but aggregation is not.")
        task.warning("[Task: theirs] metric x is defined, but aggregation is not.")
        for _ in tqdm(range(3), desc="Tokenizing inputs"):
            pass
        print("a real error", file=sys.stderr)
    assert [r.getMessage() for r in caplog.records] == [
        "[Task: theirs] metric x is defined, but aggregation is not."
    ]
    err = capsys.readouterr().err  # (an earlier test's stale log handler may add its own)
    assert "a real error\n" in err and "Tokenizing" not in err and "it/s" not in err
    assert logging.getLogger("lm_eval").level == logging.NOTSET  # as it was
