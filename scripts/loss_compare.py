"""Compare per-step losses of parallel layouts against a baseline run.

    python scripts/loss_compare.py --baseline "1:" \\
        --candidate "4:--parallelism.data_parallel_shard_degree 4" \\
        --common "--training.steps 10 --training.seq_len 64 --training.global_batch_size 32"

Every run must train the same global batch (set it in --common); runs that would not are
refused before training.
"""

import sys

from titan.tools.loss_compare import main

if __name__ == "__main__":
    sys.exit(main())
