"""Upcycle a dense model into its family's mixture-of-experts form (sparse upcycling,
Komatsuzaki et al. 2022), written as an HF folder the trainer starts from:

    python -m titan.tools.upcycle --checkpoint outputs/checkpoint/step-1000 --output moe_hf \\
        --experts 8 --top_k 2 [--granularity G] [--noise STD] [--seed S]
    ./run_train.sh --model.name qwen3 --model.flavor from_hf --checkpoint.initial_load_in_hf \\
        --checkpoint.initial_load_path moe_hf --model.tokenizer_path moe_hf

--checkpoint is a DCP step folder (or a checkpoint root: its newest intact step) or an HF
folder of a dense model; the family and shape are the ones it records (an HF folder's
config.json), else --model.name / --model.flavor. Every block's FFN becomes --experts routed
experts, each a copy of it, and a softmax router (seeded, std 0.02) picks --top_k of them
with weights that sum to 1, so the first forward is the dense model's. --granularity G splits
each copy along its hidden width into G experts (--experts and --top_k count those, so both
must be multiples of G) and keeps that forward exact too
(titan.models.common.upcycling). --noise STD multiplies every expert weight by
(1 + STD x a seeded normal): the experts differ from the start, the first forward no longer
equals the dense one. The tokenizer (--model.tokenizer_path, else the one the dense run
trained with, or the HF folder's) is written alongside. Bad input ends with one line on stderr
and exit code 2.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

PROG = "titan.tools.upcycle"


class UpcycleUsage(ValueError):
    """A command line that cannot be upcycled: one line for the user, exit 2."""


def _fail(why) -> None:
    print(f"{PROG}: {why}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_counts(experts: int, top_k: int, granularity: int, noise: float) -> None:
    """The numbers alone, before anything is read."""
    g = granularity
    problems = [
        (g >= 1, f"--granularity {g}: must be >= 1 (1: whole copies of the FFN)"),
        (experts >= 1, f"--experts {experts}: must be >= 1"),
        (
            experts % g == 0,
            f"--experts {experts} is not a multiple of --granularity {g}: each copy of the "
            f"FFN becomes {g} experts",
        ),
        (
            1 <= top_k <= experts,
            f"--top_k {top_k} must be between 1 and --experts {experts}: a token is routed "
            f"to at most every expert",
        ),
        (
            top_k % g == 0,
            f"--top_k {top_k} is not a multiple of --granularity {g}: a token takes all "
            f"{g} slices of each copy it is routed to",
        ),
        (noise >= 0, f"--noise {noise}: must be >= 0 (0: exact copies)"),
    ]
    for ok, why in problems:
        if not ok:
            raise UpcycleUsage(why)


def families_with_moe_form() -> list[str]:
    from titan.models.spec import get_train_spec, registered_names

    return [
        name
        for name in registered_names()
        if next(iter(get_train_spec(name).flavors.values())).upcycled(1, 1) is not None
        and get_train_spec(name).state_dict_adapter is not None
    ]


def upcycle(path: Path, job, spec, opts) -> tuple:
    """(MoE args, MoE state dict) of the dense model in `path`."""
    from titan.tools.generate import load_model, model_args, positions

    dense_args = model_args(path, job, spec)
    if dense_args.moe_args() is not None:
        raise UpcycleUsage(
            f"{path} holds an MoE model ({dense_args.moe_args().n_experts} experts): "
            "upcycling starts from a dense model; pass a dense checkpoint"
        )
    moe_args = dense_args.upcycled(opts.experts, opts.top_k, opts.granularity)
    routing = moe_args.moe_args()
    # what makes the first forward the dense one's (a family's form must keep it)
    assert routing.norm_topk_prob and routing.route_scale == 1.0, routing
    export = spec.state_dict_adapter.export_problems(moe_args)
    if export:
        raise UpcycleUsage("; ".join(export))
    from titan.models.common.upcycling import upcycled_state

    model, _ = load_model(path, job, spec, positions(dense_args), torch.device("cpu"))
    state = upcycled_state(
        model.state_dict(),
        model,
        spec.build_meta(moe_args),
        opts.granularity,
        opts.noise,
        opts.seed,
    )
    return moe_args, state


def tokenizer_for(path: Path, job):
    """The tokenizer to write beside the weights, or None (with a note) when there is none."""
    from titan.components.data.tokenizer import Tokenizer, TokenizerError
    from titan.tools.generate import _is_hf, trained_tokenizer

    named = "model.tokenizer_path" in job.sources
    if _is_hf(path) and not named:
        where = path if (path / "tokenizer.json").is_file() else None
    else:
        where = trained_tokenizer(path, job)
    try:
        return Tokenizer(str(where)) if where else None
    except TokenizerError as e:
        if named:
            raise UpcycleUsage(f"--model.tokenizer_path: {e}") from None
        print(f"{PROG}: note: no tokenizer written ({e})", file=sys.stderr, flush=True)
        return None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--checkpoint", required=True, help="the dense model: DCP step folder / root, or HF folder"
    )
    ap.add_argument("--output", required=True, help="the HF folder to write")
    ap.add_argument("--experts", type=int, required=True, help="routed experts per layer")
    ap.add_argument("--top_k", "--top-k", type=int, required=True, help="experts per token")
    ap.add_argument(
        "--granularity",
        type=int,
        default=1,
        help="split each copy of the FFN into this many experts along its width (default 1)",
    )
    ap.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="multiply each expert weight by (1 + NOISE x N(0, 1)) (default 0: exact copies)",
    )
    ap.add_argument("--seed", type=int, default=0, help="of the routers and the noise")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--overwrite", action="store_true", help="replace an HF model already in --output"
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    opts, overrides = _parser().parse_known_args(argv)

    from titan.components.checkpoint import hf_io
    from titan.components.checkpoint.folders import CheckpointError
    from titan.components.checkpoint.identity import family_in
    from titan.config import ConfigError, parse_args
    from titan.models.common.upcycling import UpcycleError
    from titan.models.spec import get_train_spec
    from titan.tools.generate import GenerateError, checkpoint_folder

    t0 = time.time()
    out = Path(opts.output)
    try:
        check_counts(opts.experts, opts.top_k, opts.granularity, opts.noise)
        job = parse_args(overrides)
        path = Path(opts.checkpoint)
        if not path.is_dir():
            raise CheckpointError(f"--checkpoint {path}: no such folder")
        path = checkpoint_folder(path)
        if "model.name" not in job.sources:
            job.model.name = family_in(path) or job.model.name
        spec = get_train_spec(job.model.name)
        able = families_with_moe_form()
        if spec.name not in able:
            raise UpcycleUsage(
                f"{spec.name} has no mixture-of-experts form to upcycle into; the families "
                f"that have one: {', '.join(able)} (upcycle a dense checkpoint of one of them)"
            )
        if hf_io.holds_hf_model(out) and not opts.overwrite:
            raise UpcycleUsage(
                f"--output {out} already holds an HF model: pass --overwrite to replace it, "
                "or choose another folder"
            )
        tokenizer = tokenizer_for(path, job)
        moe_args, state = upcycle(path, job, spec, opts)
        if opts.overwrite:
            hf_io.remove_hf_model(out)
        hf_io.HFModelIO(spec, moe_args, tokenizer).save(state, out, opts.dtype)
    except (
        ConfigError,
        CheckpointError,
        GenerateError,
        UpcycleError,
        UpcycleUsage,
        OSError,
    ) as e:
        _fail(e)
    except KeyError as e:  # an unregistered model name
        _fail(e.args[0])
    routing = moe_args.moe_args()
    total, active = moe_args.num_params() / 1e6, moe_args.num_params(active=True) / 1e6
    tok = " --model.tokenizer_path " + str(out) if tokenizer is not None else ""
    print(
        f"wrote {out} in {time.time() - t0:.1f}s: {spec.name}, {routing.n_experts} experts "
        f"of width {routing.hidden_dim}, top {routing.top_k}, "
        f"{total:.1f}M parameters ({active:.1f}M active). Train it with:\n"
        f"  ./run_train.sh --model.name {spec.name} --model.flavor "
        f"from_hf --checkpoint.initial_load_in_hf --checkpoint.initial_load_path {out}{tok}"
    )


if __name__ == "__main__":
    main()
