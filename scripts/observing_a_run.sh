#!/usr/bin/env bash
# The README's "Observing a run" picture: the quick-start config with validation every 10
# steps, on 1 rank and on FSDP 2, drawn by the plot tool into assets/observing_a_run.png.
# About 3 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-./outputs/observing_a_run}
common=(--validation.enable --validation.freq 10 --metrics.no_enable_tensorboard)
NGPU=1 ./run_train.sh "${common[@]}" --job.dump_folder "$out/1-rank"
# the same global batches of 8 sequences, 4 on each rank, in training and validation
NGPU=2 ./run_train.sh "${common[@]}" --parallelism.data_parallel_shard_degree 2 \
    --training.local_batch_size 4 --validation.local_batch_size 4 --job.dump_folder "$out/FSDP-2"
python -m titan.tools.plot "$out" -o assets/observing_a_run.png
