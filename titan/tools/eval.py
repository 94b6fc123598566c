"""Evaluate a checkpoint on lm-evaluation-harness tasks.

    python -m titan.tools.eval --checkpoint outputs/checkpoint/step-100 \\
        --tasks kjv_verse_cloze,kjv_bits_per_byte [--num_fewshot N --limit N --batch_size N \\
        --output_path DIR --log_samples --include_path DIR]

`--checkpoint`: a DCP step folder (or a checkpoint root: its newest intact step) or an HF
folder. The flags are lm-eval's own (`lm_eval --tasks ...`), its table is printed and its
results (and, with --log_samples, samples) files written under --output_path. titan's offline
tasks (assets/eval_tasks: kjv_verse_cloze, kjv_verse_book, kjv_bits_per_byte,
kjv_verse_completion) are always found; any other task of lm-eval's, or of --include_path.
Under `torchrun --nproc_per_node N` each rank loads the model and scores its share of the
requests; with `--parallelism.tensor_parallel_degree N` too, the ranks split the model instead
(each reads only its shards) and score every request together. Any other training layout
(`--parallelism.pipeline_parallel_degree`, `--parallelism.context_parallel_degree`, FSDP x TP)
builds the model as training would on those ranks, the data-parallel ranks splitting the
requests. Other arguments are titan
config overrides (e.g. --model.tokenizer_path). Needs lm-eval: pip install -e ".[eval]".
"""

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from titan.components.evaluation.tasks import task_manager

logger = logging.getLogger("titan")

MISSING = "titan.tools.eval needs lm-eval: pip install -e '.[eval]'"


def _fail(why) -> None:
    print(f"titan.tools.eval: {why}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m titan.tools.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--checkpoint", required=True, help="DCP step folder / checkpoint root, or an HF folder"
    )
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    ap.add_argument("--include_path", default=None, help="a folder of more task YAMLs")
    ap.add_argument("--num_fewshot", type=int, default=None, help="examples in each prompt")
    ap.add_argument(
        "--limit", type=float, default=None, help="at most this many documents a task (< 1: share)"
    )
    ap.add_argument("--batch_size", type=int, default=8, help="requests scored at once")
    ap.add_argument("--max_length", type=int, default=None, help="default: the model's positions")
    ap.add_argument("--output_path", default=None, help="where lm-eval's results files go")
    ap.add_argument("--log_samples", action="store_true", help="also write each task's samples")
    ap.add_argument("--seed", type=int, default=0, help="lm-eval's seeds (few-shot sampling)")
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts, overrides = parse(argv)
    if opts.log_samples and not opts.output_path:
        _fail("--log_samples writes files: give --output_path too")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        _fail(MISSING)
    from titan.components.checkpoint.folders import CheckpointError
    from titan.components.data.tokenizer import TokenizerError
    from titan.config import ConfigError
    from titan.runtime.logging_setup import init_logging
    from titan.tools import generate as gen

    init_logging()
    try:
        job, path, spec, tokenizer = gen.open_checkpoint(opts.checkpoint, overrides)
        limit = gen.positions(gen.model_args(path, job, spec))
        max_length = opts.max_length or limit
        if not 0 < max_length <= limit:
            raise gen.GenerateError(f"--max_length {max_length}: the model has {limit} positions")
    except (ConfigError, CheckpointError, TokenizerError, gen.GenerateError) as e:
        _fail(e)
    except KeyError as e:
        _fail(e.args[0])
    world, p = int(os.environ.get("WORLD_SIZE", "1")), job.parallelism
    tp = p.tensor_parallel_degree
    if p.pipeline_parallel_degree > 1 or p.context_parallel_degree > 1 or 1 < tp < world:
        results = _on_layout(job, path, spec, tokenizer, opts, max_length)
    else:
        results = _whole_or_tensor_parallel(job, path, spec, tokenizer, opts, max_length, world)
    if results is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        report(results, opts, f"titan__{path.name}")
    if dist.is_initialized():
        dist.destroy_process_group()


def _whole_or_tensor_parallel(job, path, spec, tokenizer, opts, max_length: int, world: int):
    """Each rank the whole model and its share of the requests, or (tensor parallel = the
    rank count) a slice of each layer, every request scored together."""
    from titan.components.checkpoint.folders import CheckpointError
    from titan.components.evaluation.lm_eval_model import model_scores
    from titan.parallelisms.parallel_dims import ParallelDims
    from titan.runtime.distributed import init_distributed, pick_device
    from titan.tools import generate as gen

    device = pick_device(job.training.device)
    tp = job.parallelism.tensor_parallel_degree
    group, tp_dims = None, None
    if world > 1:
        init_distributed(device, job.comm.init_timeout_seconds)
        if tp > 1:  # every rank holds a slice of each layer and scores every request
            tp_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, world_size=tp)
            tp_dims.build_mesh(device.type)
            job = gen._tp_job(job, tp)
        else:
            group = dist.group.WORLD
    try:
        model, _ = gen.load_model(path, job, spec, max_length, device, tp_dims)
    except (CheckpointError, gen.GenerateError) as e:
        _fail(e)
    return evaluate(model_scores(model), model, tokenizer, opts, max_length, device, group)


def _on_layout(job, path, spec, tokenizer, opts, max_length: int):
    """The model on the training layout the flags give (pipeline stages, context-parallel
    ranks, FSDP x TP), the data-parallel ranks splitting the requests in lockstep."""
    from titan.components.checkpoint.folders import CheckpointError
    from titan.config import ConfigError
    from titan.tools.eval_layout import layout_forward
    from titan.tools.generate import GenerateError

    try:
        fb, group = layout_forward(job, path, spec, max_length)
    except (ConfigError, CheckpointError, GenerateError) as e:
        _fail(e)
    decode = fb.logits if fb.decodes else None
    return evaluate(fb.token_scores, decode, tokenizer, opts, max_length, fb.device, group, True)


def evaluate(
    scores, decode, tokenizer, opts, max_length: int, device, group, lockstep: bool = False
):
    """lm-eval's results (rank 0; None elsewhere) of the model (`scores`, `decode`: TitanLM's)
    on opts.tasks."""
    from lm_eval import simple_evaluate

    from titan.components.evaluation.lm_eval_model import TitanLM

    lm = TitanLM(
        scores,
        tokenizer,
        max_length=max_length,
        device=device,
        batch_size=opts.batch_size,
        group=group,
        lockstep=lockstep,
        decode=decode,
    )
    tasks = [t.strip() for t in opts.tasks.split(",") if t.strip()]
    try:
        manager = task_manager(tasks, opts.include_path)
    except ValueError as e:
        _fail(f"--tasks: {e}")
    with torch.no_grad():
        return simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=opts.num_fewshot,
            limit=opts.limit,
            log_samples=opts.log_samples,
            task_manager=manager,
            random_seed=opts.seed,
            numpy_random_seed=opts.seed,
            torch_random_seed=opts.seed,
            fewshot_random_seed=opts.seed,
        )


def report(results: dict, opts, name: str) -> None:
    """lm-eval's table, and its files under opts.output_path/<name>/."""
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import make_table, sanitize_model_name

    samples = results.pop("samples", None)
    if opts.output_path:
        tracker = EvaluationTracker(output_path=opts.output_path)
        config = tracker.general_config_tracker
        config.model_name, config.model_name_sanitized = name, sanitize_model_name(name)
        tracker.save_results_aggregated(results=results, samples=samples)
        if opts.log_samples:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))


if __name__ == "__main__":
    main()
