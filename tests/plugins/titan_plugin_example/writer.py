"""A metrics writer: each logged step as a CSV row, with its own [csv_metrics] section."""

import csv
import os
from dataclasses import dataclass

from titan.components.observability.writers import WriterSpec
from titan.config.extensions import register
from titan.config.job_config import opt


@dataclass
class CsvOptions:
    enable: bool = opt(False, "Write every logged step's figures as a CSV row")
    file: str = opt("metrics.csv", "CSV file, in the dump folder")


class CsvWriter:
    def __init__(self, cfg, options, context):
        path = os.path.join(context.dump_folder, options.file)
        # a resumed run keeps the rows up to its checkpoint's step
        rows = []
        if context.resume_step is not None and os.path.exists(path):
            with open(path) as f:
                rows = [r for r in csv.reader(f)]
            rows = rows[:1] + [r for r in rows[1:] if int(r[0]) <= context.resume_step]
        self.file = open(path, "w", newline="")
        self.out = csv.writer(self.file)
        self.out.writerows(rows)
        self.columns = rows[0] if rows else None

    def scalars(self, step, values):
        train = {k: v for k, v in values.items() if k.startswith("train/")}
        if not train:
            return
        if self.columns is None:
            self.columns = ["step", *train]
            self.out.writerow(self.columns)
        self.out.writerow([step, *(train.get(c, "") for c in self.columns[1:])])
        self.file.flush()

    def distribution(self, step, name, values):
        pass

    def close(self):
        self.file.close()


register(
    WriterSpec(
        "csv",
        build=f"{__name__}:CsvWriter",
        enabled=lambda cfg, options: options.enable,
        section="csv_metrics",
        options=CsvOptions,
    )
)
