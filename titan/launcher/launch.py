"""Entry point of run_train.sh: validate the job, then hand over to torchrun.

`python -m titan.launcher [torchrun args] -- [trainer overrides]`. Validation happens here,
in one process, so a bad config fails in a second with exit code 2 and one message,
before torchrun starts workers or anything is written to disk. It uses the real world size:
nodes x ranks per node, for every node count an elastic job (`--nnodes MIN:MAX`) may run on.

Its plan checks read a little of the data and weight files (titan/components/data/
content_check.py: empty or garbled files, token shards of another tokenizer or cut short, HF
folders missing a shard), the checkpoint folders and the memory plan, once: the workers skip
them (titan.runtime.inputs_checked). It runs torchrun so that an error a restart would meet
again stops the job with one line (final_error.py).

With `DRY_RUN=1` it prints the torchrun command line this node would run, and exits.
"""

import hashlib
import os
import shlex
import sys

from titan.config import ConfigError, extensions, help_text, parse_args, to_toml
from titan.launcher import dump_mirror
from titan.runtime.console import plural, print_out
from titan.runtime.final_error import run_torchrun
from titan.runtime.inputs_checked import INPUTS_CHECKED
from titan.runtime.paths import is_remote


def rendezvous_id(dump_folder: str) -> str:
    """A job id every node derives alike from the (shared) dump folder, so a restarted job
    meets its own nodes and no other job's."""
    where = dump_folder if is_remote(dump_folder) else os.path.abspath(dump_folder)
    digest = hashlib.sha1(where.encode()).hexdigest()[:12]
    return f"titan-{digest}"


def validate_world_sizes(job, min_nodes: int, max_nodes: int, nproc: int):
    """plan_run for every world size the job may see (returns the last plan); ConfigError
    names the node count."""
    from titan.plan.run_plan import plan_run  # imports torch: only once the config parses

    elastic = min_nodes < max_nodes
    if elastic and job.training.global_batch_size == -1:
        raise ConfigError(
            f"NNODES={min_nodes}:{max_nodes} (elastic) with training.global_batch_size = -1: "
            "the global batch would shrink with the job and the loss curve change; set "
            "training.global_batch_size (the gradient accumulation then grows instead)"
        )
    plan = None
    for nodes in range(max_nodes, min_nodes - 1, -1):
        try:
            # the fewest nodes hold the most each: the run's data, checkpoints and memory are
            # checked at that plan
            plan = plan_run(
                job,
                world_size=nodes * nproc,
                tokenizer=plan.tokenizer if plan else None,
                starting=nodes == min_nodes,
            )
        except ConfigError as e:
            if not elastic:
                raise
            raise ConfigError(
                f"with {nodes} of NNODES={min_nodes}:{max_nodes} nodes ({nodes * nproc} ranks): "
                f"{e}. Raise the minimum node count or change the parallel degrees"
            ) from None
    return plan


def node_counts(text: str, parse) -> tuple[int, int]:
    """NNODES as (min, max) node counts; `parse`: torchrun's parse_min_max_nnodes."""
    try:
        low, high = parse(text)
    except (RuntimeError, ValueError):
        low = high = 0
    if not 1 <= low <= high:
        raise ConfigError(
            f"NNODES={text!r}: a node count >= 1 (e.g. NNODES=4), or MIN:MAX with "
            "1 <= MIN <= MAX for an elastic job (e.g. NNODES=2:4)"
        )
    return low, high


def check_node_rank(rank: int, max_nodes: int) -> None:
    """NODE_RANK (-1: unset, the rendezvous assigns one) must name a node of the job."""
    if rank != -1 and not 0 <= rank < max_nodes:
        raise ConfigError(
            f"NODE_RANK={rank}: a job of {max_nodes} node(s) has node ranks 0 to "
            f"{max_nodes - 1}; unset NODE_RANK to let the rendezvous assign one"
        )


def ranks_per_node(text: str) -> int:
    """NGPU as a rank count (torchrun's "auto"/"gpu" would pick a count the checks never saw)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(
            f"NGPU={text!r}: the ranks per node must be a whole number >= 1, e.g. "
            "NGPU=1 (one CPU process) or NGPU=8 (a node of 8 GPUs)"
        )
    return int(text)


def check_log_ranks(text: str, nproc: int) -> None:
    """LOG_RANK must name local ranks of this node: torchrun would show nothing for a rank
    that does not exist, and fail with a traceback on a non-number."""
    if not text:
        return
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"LOG_RANK={text!r}: a comma-separated list of local ranks, e.g. "
            "LOG_RANK=0 or LOG_RANK=0,1"
        ) from None
    missing = [r for r in ranks if not 0 <= r < nproc]
    if missing:
        raise ConfigError(
            f"LOG_RANK={text}: this node has no local rank {missing[0]} (NGPU="
            f"{nproc}: ranks 0 to {nproc - 1}); e.g. LOG_RANK=0"
        )


def dry_run(text: str) -> bool:
    """DRY_RUN as a switch: 1/true/yes/on, or 0/false/no/off/unset."""
    value = text.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"DRY_RUN={text!r}: use DRY_RUN=1 to only print the command, or unset it")


def main() -> None:
    argv = sys.argv[1:]
    sep = argv.index("--") if "--" in argv else len(argv)
    torchrun_args, trainer_args = argv[:sep], argv[sep + 1 :]
    try:
        if "--help" in trainer_args or "-h" in trainer_args:
            print_out(help_text(trainer_args))
            sys.exit(0)
        job = parse_args(trainer_args)
        dump_url = job.job.dump_folder  # the rendezvous id is the URL's, not a mirror's
        mirror = dump_mirror.for_job(job)
        if mirror is not None:  # the checks below see the folders the workers will
            trainer_args = [*trainer_args, *mirror.redirect(job)]
        dry = dry_run(os.environ.get("DRY_RUN", ""))
        from torch.distributed.run import get_args_parser, parse_min_max_nnodes

        ta = get_args_parser().parse_args([*torchrun_args, "-m", "titan.trainer"])
        min_nodes, max_nodes = node_counts(ta.nnodes, parse_min_max_nnodes)
        check_node_rank(ta.node_rank, max_nodes)
        nproc = ranks_per_node(ta.nproc_per_node)
        check_log_ranks(ta.local_ranks_filter, nproc)
        plan = validate_world_sizes(job, min_nodes, max_nodes, nproc)
    except ConfigError as e:
        print(f"titan: config error: {e}", file=sys.stderr)
        sys.exit(2)
    from titan.plan.run_plan import vocabulary_note

    ignored = extensions.ignored_warning(job)
    if ignored:
        print(f"titan: warning: {ignored}", file=sys.stderr, flush=True)
    note = vocabulary_note(job, plan)
    if note:
        print(f"titan: note: {note}", file=sys.stderr, flush=True)
    if not ta.standalone and ta.rdzv_id == "none":
        torchrun_args = [*torchrun_args, f"--rdzv-id={rendezvous_id(dump_url)}"]
    if job.job.print_config:
        print(to_toml(job), flush=True)
        # printed once, here: a last override wins over every form (flag, =true, TOML)
        trainer_args = [*trainer_args, "--job.no_print_config"]
    command = [*torchrun_args, "-m", "titan.trainer", *trainer_args]
    if dry:
        print_out("torchrun " + shlex.join(command))
        sys.exit(0)
    from titan.components.fault_tolerance import interrupts

    stopped = lambda: interrupts.status(job.checkpoint, job.job.dump_folder)  # noqa: E731
    reports = job.job.dump_folder  # a URL's local mirror, which is uploaded
    os.environ[INPUTS_CHECKED] = "1"  # the workers' plans skip what was read here
    try:
        supervise(command, mirror, stopped, reports, dump_url)
    finally:
        os.environ.pop(INPUTS_CHECKED, None)  # main() runs in tests' own process too


def supervise(command: list[str], mirror, stopped, reports: str, dump_url: str) -> None:
    """torchrun with `command`, the dump folder's mirror (if any) uploaded while it runs."""
    if mirror is None:
        run_torchrun(command, stopped=stopped, reports=reports)
        return
    fetched = mirror.fetch()
    print(
        f"titan: job.dump_folder {dump_url}: the ranks write into {mirror.local}, uploaded "
        f"every {mirror.interval_s:g} s and when the run ends"
        + (f" ({plural(fetched, 'file')} of the earlier run fetched)" if fetched else ""),
        file=sys.stderr,
        flush=True,
    )
    mirror.start()
    try:
        run_torchrun(command, stopped=stopped, reports=reports)
    finally:
        mirror.finish()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while the config is checked, before torchrun starts
        print("titan: stopped by Ctrl-C (SIGINT) before training started", file=sys.stderr)
        sys.exit(130)
