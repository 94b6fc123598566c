"""What every rank runs: the plan of the run (run_plan: model args, layout, batches), the model
parts it builds (build), the forward/backward of a step's microbatches (microbatch) and the
training loop (train: `python -m titan.trainer`, which torchrun starts on each rank)."""
