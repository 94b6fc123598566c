"""Weights & Biases beside TensorBoard: the same keys at the same steps, the merged config as
the run's config, and one run across restarts.

The run id is kept in `<dump_folder>/wandb_run_id`: a job resumed from a checkpoint continues
that run (W&B's resume="allow"). W&B keeps a run's steps increasing, so the steps a crashed
run logged after its last checkpoint stay as that run logged them; the resumed run's values
appear from the next new step (metrics.jsonl holds the resumed run's own).
"""

import logging
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
MISSING = "metrics.enable_wandb needs the wandb package: pip install 'titan[wandb]' (or wandb)"


class WandbWriter:
    """A metrics writer (titan.components.observability.writers); `cfg` is the metrics
    section, and the run's config the context's merged job config."""

    def __init__(self, cfg, options, context):
        import wandb

        folder = Path(context.dump_folder)
        id_file = folder / RUN_ID_FILE
        resumed = context.resume_step is not None
        run_id = (
            id_file.read_text().strip() if resumed and id_file.exists() else uuid.uuid4().hex[:12]
        )
        id_file.write_text(run_id + "\n")
        self._wandb = wandb
        # silent: W&B's own banner and closing summary (~40 lines) say nothing the run line
        # below and metrics.jsonl do not
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=cfg.wandb_run_name or folder.resolve().name,
            tags=list(cfg.wandb_tags) or None,
            config=context.run_config,
            id=run_id,
            resume="allow",
            dir=str(folder),
            settings=wandb.Settings(silent=True),
        )
        where = (
            f"offline, in {folder / 'wandb'} (wandb sync to upload)"
            if self.run.offline
            else self.run.url
        )
        logger.info(
            "W&B run %s (%s): %s; id kept in %s", self.run.name, self.run.id, where, id_file
        )

    def scalars(self, step: int, values: dict) -> None:
        self.run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def distribution(self, step: int, tag: str, values: list[float]) -> None:
        """Values indexed by position (an expert's share of a layer's tokens), drawn as a
        histogram over the positions, as TensorBoard's."""
        edges = [i - 0.5 for i in range(len(values) + 1)]
        self.run.log({tag: self._wandb.Histogram(np_histogram=(list(values), edges))}, step=step)

    def close(self) -> None:
        self.run.finish()
