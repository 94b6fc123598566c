"""titan.tools.loss_compare refuses, before training anything, runs whose global batches
differ (the README's example compared 8 sequences a step with 16), naming both sizes and the
override that makes them equal."""

import pytest

from titan.tools.loss_compare import Run, check_same_global_batch, main


def test_different_global_batches_are_refused_before_training(capsys, tmp_path):
    out = tmp_path / "runs"
    code = main(
        [
            "--baseline",
            "1:",
            "--candidate",
            "2:",
            "--common",
            "--training.steps 10",
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert err.startswith(
        "loss_compare: the runs train different global batches (baseline "
        "(1 rank) 8, candidate (2 ranks) 16 sequences)"
    )
    assert err.rstrip().endswith('--common "... --training.global_batch_size 16"')


def test_same_global_batch_passes():
    common = ["--training.global_batch_size", "16"]
    check_same_global_batch(
        {
            "a": Run.parse("1:"),
            "b": Run.parse("2:"),
            "c": Run.parse("4:--parallelism.tensor_parallel_degree 2"),
        },
        common,
    )
    # tp and pp ranks read the same batch: 2 ranks of TP train what one rank does
    check_same_global_batch(
        {"a": Run.parse("1:"), "b": Run.parse("2:--parallelism.tensor_parallel_degree 2")}, []
    )
    with pytest.raises(
        ValueError,
        match=r"a \(1 rank\) 8, b \(4 ranks --training.local_batch_size"
        r" 3"
        r" --parallelism.tensor_parallel_degree 2\) 6 sequences.*"
        r"global_batch_size 24",
    ):
        check_same_global_batch(
            {
                "a": Run.parse("1:"),
                "b": Run.parse(
                    "4:--training.local_batch_size 3 --parallelism.tensor_parallel_degree 2"
                ),
            },
            [],
        )


def test_a_config_error_is_one_line(capsys):
    assert main(["--baseline", "1:", "--candidate", "2:--training.stepz 3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loss_compare: config error: unknown config key 'training.stepz'")
    assert err.count("\n") == 1


def test_keys_name_what_the_runs_log(capsys, tmp_path):
    """val_loss comes from validation.jsonl (on the steps that validated); asked for without
    validation, or a key no run logs, it is one line, exit 2, not a KeyError."""
    from titan.tools.loss_compare import compare_key

    assert (
        main(
            [
                "--baseline",
                "1:",
                "--candidate",
                "1:",
                "--keys",
                "loss,val_loss",
                "--out",
                str(tmp_path / "runs"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err == (
        "loss_compare: --keys val_loss: the baseline run does not validate; add "
        "--validation.enable to --common\n"
    )
    base = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "val_loss": 1.7}]
    other = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "val_loss": 1.7}]
    assert compare_key(base, other, "val_loss") == [(2, 1.7, 1.7, 0.0)]
    with pytest.raises(
        ValueError,
        match=r"--keys gradnorm: step 1 logged no 'gradnorm'; the "
        r"runs log loss",
    ):
        compare_key(base, other, "gradnorm")
