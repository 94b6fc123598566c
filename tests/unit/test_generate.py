"""Generation: KV-cache decoding equals a full recompute, padding of a batch changes nothing,
sampling options, tensor-parallel generation equals one rank, and the CLI on DCP and HF
checkpoints."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.forked import free_port, run_workers
from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint import hf_io
from titan.models.spec import get_train_spec
from titan.tools.generate import Sampling, generate, load_model, sample

LLAMA = get_train_spec("llama3")
ARGS = LLAMA.flavors["debugmodel"].with_updates(vocab_size=2048, max_seq_len=128)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    m = LLAMA.build_meta(ARGS)
    m.to_empty(device="cpu")
    m.init_weights(7)
    return m.eval()


def prompt(n, seed=0):
    return torch.randint(
        3, ARGS.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_cached_greedy_decoding_equals_full_recompute(model):
    p = prompt(9)
    new = generate(model, [p], max_new_tokens=64, eos_id=None)[0]
    assert len(new) == 64
    with torch.no_grad():
        logits = model(torch.tensor([p + new]))[0]
    # every generated token is the argmax of a full (uncached) forward at its position
    assert logits[len(p) - 1 : -1].argmax(-1).tolist() == new


def test_left_padding_changes_nothing(model):
    short, long = prompt(4, 1), prompt(11, 2)
    alone = [generate(model, [p], max_new_tokens=12, eos_id=None)[0] for p in (short, long)]
    assert generate(model, [short, long], max_new_tokens=12, eos_id=None) == alone


def test_stops_at_eos(model):
    p = prompt(5)
    first = generate(model, [p], max_new_tokens=8, eos_id=None)[0]
    eos = first[3]
    assert generate(model, [p], max_new_tokens=8, eos_id=eos)[0] == first[: first.index(eos) + 1]


def test_sampling_options():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert sample(logits, Sampling(), g()).item() == 1
    assert sample(logits, Sampling(temperature=1.0, top_k=1), g()).item() == 1
    assert sample(logits, Sampling(temperature=1.0, top_p=0.01), g()).item() == 1
    # top_k 2 keeps tokens 1 and 3 only; the seed makes draws repeatable
    draws = [sample(logits, Sampling(temperature=5.0, top_k=2), g()).item() for _ in range(3)]
    assert set(draws) <= {1, 3} and len(set(draws)) == 1
    # probabilities 0.024, 0.479, 0.065, 0.433: tokens 1 and 3 hold 0.912 of the mass
    for top_p, kept in ((0.9, {1, 3}), (0.95, {1, 2, 3})):
        many = sample(
            logits.expand(4000, 4),
            Sampling(temperature=1.0, top_p=top_p),
            torch.Generator().manual_seed(1),
        )
        assert set(many.unique().tolist()) == kept, top_p


def _tp_generate(rank, world_size, port, hf_dir, prompts, sampling):

    from tests.forked import torchrun_env
    from titan.config import parse_args
    from titan.parallelisms.parallel_dims import ParallelDims
    from titan.tools.generate import _tp_job

    torchrun_env(rank, world_size, port)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, world_size=world_size
    )
    dims.build_mesh("cpu")
    job = _tp_job(parse_args([]), world_size)
    model, _ = load_model(hf_dir, job, LLAMA, 64, torch.device("cpu"), dims)
    return generate(model, prompts, max_new_tokens=24, eos_id=None, sampling=sampling)


@pytest.mark.parametrize(
    "sampling", [Sampling(), Sampling(temperature=0.9, top_k=40, seed=3)], ids=["greedy", "sampled"]
)
def test_tensor_parallel_generation_equals_one_rank(model, sampling, tmp_path):
    hf_dir = hf_io.save_hf(model.state_dict(), LLAMA, ARGS, tmp_path / "hf")
    prompts = [prompt(6, 3), prompt(10, 4)]
    one, _ = load_model(hf_dir, None, LLAMA, 64, torch.device("cpu"))
    expected = generate(one, prompts, max_new_tokens=24, eos_id=None, sampling=sampling)
    ranks = run_workers(
        _tp_generate, 2, tmp_path, free_port(), hf_dir, prompts, sampling, init_pg=False
    )
    assert ranks[0] == ranks[1] == expected


def test_cli_on_dcp_and_hf_checkpoints(model, tmp_path):
    root = tmp_path / "checkpoint"
    checkpoint.save_dcp_model_state(model.state_dict(), root / "step-3")
    # the newest step of the root is a final HF save (last_save_in_hf)
    hf_dir = hf_io.HFModelIO(LLAMA, ARGS, _tokenizer()).save(
        model.state_dict(), root / "step-5", torch.float32
    )
    checkpoint.write_complete_marker(hf_dir, 5, model_only=True, fmt="hf")

    def run(*argv):
        return subprocess.run(
            [sys.executable, "-m", "titan.tools.generate", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    a = run(
        "--checkpoint",
        str(root / "step-3"),
        "--prompt",
        "In the beginning",
        "--max-new-tokens",
        "16",
    )
    b = run("--checkpoint", str(root), "--prompt", "In the beginning", "--max-new-tokens", "16")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout.startswith("In the beginning") and len(a.stdout) > len("In the beginning\n")
    assert a.stdout == b.stdout  # the same weights, read from DCP and from HF
    batch = run(
        "--checkpoint",
        str(hf_dir),
        "--prompt",
        "And God said",
        "--prompt",
        "Let",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
    )
    assert batch.returncode == 0, batch.stderr
    assert batch.stdout.startswith("[0] And God said") and "\n[1] Let" in batch.stdout
    bad = run("--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x")
    assert bad.returncode != 0 and "no such folder" in bad.stderr


def flip_bytes(step: Path, n: int = 4096) -> None:
    """Corrupt n bytes in the middle of the step's data file, its size unchanged."""
    (data,) = step.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + n] = bytes(b ^ 0xFF for b in raw[mid : mid + n])
    data.write_bytes(bytes(raw))


def test_damaged_steps_are_skipped_or_refused_and_output_is_pipe_safe(model, tmp_path, capsys):
    """Checksums as the trainer checks them: a root's damaged newest step is skipped with a
    warning, a damaged step given by name or a root with no intact step is one line, exit 2;
    and the text piped into a reader that goes away ends quietly (SIGPIPE, no traceback)."""
    from titan.tools.generate import checkpoint_folder

    root = tmp_path / "checkpoint"
    for step in (3, 5):
        checkpoint.save_dcp_model_state(model.state_dict(), root / f"step-{step}")
    flip_bytes(root / "step-5")
    assert checkpoint_folder(root) == root / "step-3"
    warning = capsys.readouterr().err
    assert (
        warning.startswith("titan.tools.generate: warning: step-5 is unusable (")
        and warning.rstrip().endswith("generating from step-3 instead")
        and warning.count("\n") == 1
    )
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"step-5 is damaged: .*pass another "
        "step folder, or the checkpoint root to use its newest intact step",
    ):
        checkpoint_folder(root / "step-5")

    read, write = os.pipe()
    os.close(read)  # the reader (head) has gone before the first line
    try:
        piped = subprocess.run(
            [
                sys.executable,
                "-m",
                "titan.tools.generate",
                "--checkpoint",
                str(root),
                "--prompt",
                "In the beginning",
            ],
            cwd=REPO,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert piped.returncode == -signal.SIGPIPE, piped.stderr
    assert "Traceback" not in piped.stderr and "step-5 is unusable" in piped.stderr

    flip_bytes(root / "step-3")
    bad = subprocess.run(
        [sys.executable, "-m", "titan.tools.generate", "--checkpoint", str(root), "--prompt", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith(
        f"titan.tools.generate: --checkpoint {root} holds no intact step folder (step-5: "
    )
    assert bad.stderr.rstrip().endswith("pass an intact step folder or an HF folder")


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--temperature", "-0.5"], "--temperature -0.5: must be >= 0 (0 = greedy)"),
        (["--top-p", "0"], "--top-p 0.0: must lie in (0, 1]"),
        (["--top-p", "1.5"], "--top-p 1.5: must lie in (0, 1]"),
        (["--top-k", "-1"], "--top-k -1: must be >= 0"),
    ],
)
def test_out_of_range_options_exit_2_in_one_line(argv, why, capsys):
    from titan.tools.generate import main

    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", "nowhere", "--prompt", "x", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("titan.tools.generate: " + why)
    assert err.count("\n") == 1


def test_prompt_must_fit_the_model_positions():
    from titan.tools.generate import GenerateError, check_positions

    check_positions([[1] * 100, [1] * 3], 28, 128)  # 100 + 28 = 128: fits exactly
    with pytest.raises(
        GenerateError,
        match=r"prompt 0 \(100 tokens\) \+ --max-new-tokens 29 "
        r"need 129 positions, the model has 128 .*--max-new-tokens 28 or less",
    ):
        check_positions([[1] * 100], 29, 128)
    with pytest.raises(GenerateError, match="prompt 1 is 128 tokens, the model has 128 positions"):
        check_positions([[1], [1] * 128], 1, 128)


def test_checkpoint_of_another_flavor_is_named(model, tmp_path):
    from titan.config import parse_args
    from titan.tools.generate import GenerateError, model_args, positions

    step = checkpoint.save_dcp_model_state(model.state_dict(), tmp_path / "step-1")
    job = parse_args(["--training.seq_len", "96"])
    args = model_args(step, job, LLAMA)
    assert args == ARGS.with_updates(max_seq_len=96) and positions(args) == 96
    with pytest.raises(GenerateError) as e:
        model_args(step, parse_args(["--model.flavor", "1B"]), LLAMA)
    assert "does not hold a llama3 '1B' model (model.flavor from command line" in str(e.value)
    assert "tok_embeddings.weight (2048, 256) vs (2048, 2048)" in str(e.value)
    assert str(e.value).endswith("it holds flavor 'debugmodel': pass --model.flavor debugmodel")
    # a tied model's checkpoint stores the shared matrix once: the untied flavor misses one
    tied = LLAMA.build_meta(LLAMA.flavors["debugmodel_tied"].with_updates(vocab_size=2048))
    tied.to_empty(device="cpu")
    tied.init_weights(1)
    state = {k: v for k, v in tied.state_dict().items() if k != "output.weight"}
    tied_step = checkpoint.save_dcp_model_state(state, tmp_path / "tied" / "step-1")
    with pytest.raises(
        GenerateError,
        match=r"output.weight missing \(checkpoint vs flavor\); "
        "it holds flavor 'debugmodel_tied': pass --model.flavor debugmodel_tied",
    ):
        model_args(tied_step, parse_args([]), LLAMA)
    assert model_args(tied_step, parse_args(["--model.flavor", "debugmodel_tied"]), LLAMA)
    # the untied checkpoint has every name the tied flavor asks for: its output matrix, apart
    # from the embedding, is what tells them apart
    with pytest.raises(GenerateError, match="output.weight apart from tok_embeddings.weight"):
        model_args(step, parse_args(["--model.flavor", "debugmodel_tied"]), LLAMA)


def test_cli_refuses_a_long_prompt_and_a_wrong_flavor(model, tmp_path):
    step = checkpoint.save_dcp_model_state(model.state_dict(), tmp_path / "step-1")

    def run(*argv):
        return subprocess.run(
            [sys.executable, "-m", "titan.tools.generate", "--checkpoint", str(step), *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    long = run("--prompt", "In the beginning " * 40, "--training.seq_len", "64")
    assert long.returncode == 2 and long.stdout == "", long.stderr
    assert (
        long.stderr.startswith("titan.tools.generate: prompt 0 is ")
        and long.stderr.count("\n") == 1
    )
    assert "the model has 64 positions (max_seq_len)" in long.stderr
    other = run("--prompt", "In", "--model.flavor", "3B")
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert other.stderr.startswith("titan.tools.generate: ") and "Traceback" not in other.stderr
    assert other.stderr.rstrip().endswith("pass --model.flavor debugmodel")


def _tokenizer():
    from titan.components.data.tokenizer import Tokenizer

    return Tokenizer(str(REPO / "assets" / "tokenizer" / "tokenizer.json"))


def test_streamed_text_never_shows_half_a_character(tokenizer):
    from titan.tools.generate import TextStream

    text = "café naïve — 😀 done"
    ids = tokenizer.encode(text, bos=False, eos=False)
    # the emoji's four bytes are separate tokens: decoding a prefix ends in U+FFFD
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text


@pytest.mark.parametrize(
    "family,flavor",
    [("qwen3", "debugmodel_moe"), ("deepseek_v3", "debugmodel"), ("gpt_oss", "debugmodel")],
)
def test_moe_families_generate_from_hf_with_the_cache(family, flavor, tmp_path):
    """Qwen3-MoE and DeepSeek-V3 (MLA: keys and values of two widths in the cache) read from
    an HF folder: cached decoding gives the argmax of full forwards, left padding changes
    nothing."""
    spec = get_train_spec(family)
    args = spec.flavors[flavor].with_updates(max_seq_len=64)
    m = spec.build_meta(args)
    m.to_empty(device="cpu")
    m.init_weights(5)
    hf_dir = hf_io.save_hf(m.state_dict(), spec, args, tmp_path / "hf")
    model, _ = load_model(hf_dir, None, spec, 64, torch.device("cpu"))
    p, short = prompt(7, 1), prompt(3, 2)
    new = generate(model, [p], max_new_tokens=16, eos_id=None)[0]
    with torch.no_grad():
        logits = model(torch.tensor([p + new]))[0]
    assert logits[len(p) - 1 : -1].argmax(-1).tolist() == new
    assert generate(model, [short, p], max_new_tokens=16, eos_id=None)[1] == new
