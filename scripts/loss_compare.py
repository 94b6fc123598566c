"""Compare per-step losses of parallel layouts against a baseline run.

    python scripts/loss_compare.py --common "--training.steps 10 --training.seq_len 64" \
        --baseline "1:" --candidate "4:--parallelism.data_parallel_shard_degree 4"
"""

import sys

from titan.tools.loss_compare import main

if __name__ == "__main__":
    sys.exit(main())
