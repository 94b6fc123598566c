"""What runs before the workers: `python -m titan.launcher` (run_train.sh's entry) checks the
config, the data, the checkpoints and the memory of the run it is given, then starts torchrun
with `python -m titan.trainer` on every rank."""
