"""Entry point of run_train.sh: validate the job, then hand over to torchrun.

`python -m titan.launch [torchrun args] -- [trainer overrides]`. Validation happens here,
in one process, so a bad config fails in a second with exit code 2 and one message,
before torchrun starts workers or anything is written to disk.
"""

import os
import sys

from titan.config import ConfigError, help_text, parse_args, to_toml


def _torchrun_nproc(torchrun_args: list[str]) -> int:
    for i, a in enumerate(torchrun_args):
        if a.startswith("--nproc_per_node=") or a.startswith("--nproc-per-node="):
            return int(a.split("=", 1)[1])
        if a in ("--nproc_per_node", "--nproc-per-node"):
            return int(torchrun_args[i + 1])
    return 1


def _world_size(torchrun_args: list[str]) -> int:
    nnodes = os.environ.get("NNODES", "1")
    return _torchrun_nproc(torchrun_args) * int(nnodes.split(":")[-1])


def main() -> None:
    argv = sys.argv[1:]
    sep = argv.index("--") if "--" in argv else len(argv)
    torchrun_args, trainer_args = argv[:sep], argv[sep + 1:]
    if "--help" in trainer_args or "-h" in trainer_args:
        print(help_text())
        sys.exit(0)
    try:
        job = parse_args(trainer_args)
        from titan.preflight import plan_run  # imports torch: only once the config parses

        plan_run(job, world_size=_world_size(torchrun_args))
    except ConfigError as e:
        print(f"titan: config error: {e}", file=sys.stderr)
        sys.exit(2)
    if job.job.print_config:
        print(to_toml(job), flush=True)
        # printed once, here: a last override wins over every form (flag, =true, TOML)
        trainer_args = [*trainer_args, "--job.no_print_config"]
    from torch.distributed.run import main as torchrun

    torchrun([*torchrun_args, "-m", "titan.train", *trainer_args])


if __name__ == "__main__":
    main()
