"""TensorBoard events under `<dump_folder>/<metrics.save_tb_folder>/<start time>/rank_0`."""

import os
import time


class TensorBoardWriter:
    def __init__(self, cfg, options, context):
        from torch.utils.tensorboard import SummaryWriter

        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.tb = SummaryWriter(
            os.path.join(context.dump_folder, cfg.save_tb_folder, stamp, "rank_0")
        )

    def scalars(self, step: int, values: dict) -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def distribution(self, step: int, name: str, values: list[float]) -> None:
        """Values indexed by position (an expert's share of a layer's tokens): a histogram of
        the positions weighted by the values, so TensorBoard draws the load over experts."""
        import numpy as np

        n = len(values)
        edges = np.arange(n + 1, dtype=np.float64) - 0.5
        counts = np.asarray(values, dtype=np.float64)
        positions = np.arange(n, dtype=np.float64)
        self.tb.add_histogram_raw(
            name,
            min=0,
            max=n - 1,
            num=counts.sum(),
            sum=float((positions * counts).sum()),
            sum_squares=float((positions**2 * counts).sum()),
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()
