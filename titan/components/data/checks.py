"""The data's checks once the run is planned: local datasets exist, a mix is well formed, and
streams are not combined with what needs a global index (worker processes, torchft healing).
Registered with titan.config.extensions, as every component's are."""

from titan.config.entry import Entry, register


def check_datasets(job, plan=None) -> None:
    """Local datasets must exist; a streamed one cannot be combined with torchft healing."""
    from titan.components.data.dataset import DataError, local_files
    from titan.config import ConfigError

    sets = [("training", job.training)]
    if job.validation.enable:
        sets.append(("validation", job.validation))
    if job.training.dataset_mix:
        check_mix(job)
        if job.training.skip_documents:
            check_skip_documents(job, streamed=False)
    for section, cfg in sets:
        if section == "training" and cfg.dataset_mix:
            continue
        try:
            files = local_files(cfg.dataset, cfg.dataset_path, key=f"{section}.dataset_path")
        except DataError as e:
            raise ConfigError(
                str(e) if str(e).startswith(section) else f"{section}.dataset: {e}"
            ) from None
        streamed = files is None or cfg.dataset_streaming
        if cfg.dataset_streaming and files is not None and len(files) == 1 and files[0].is_dir():
            raise ConfigError(
                f"{section}.dataset_streaming with {files[0]}, which holds token shards: they "
                "are read indexed; unset dataset_streaming"
            )
        if section == "training" and streamed and cfg.dataloader_num_workers:
            raise ConfigError(
                f"training.dataloader_num_workers = {cfg.dataloader_num_workers} with the "
                f"streamed dataset {cfg.dataset!r}: streams are read in the trainer's process. "
                "Set dataloader_num_workers = 0, or pretokenize the data "
                "(scripts/pretokenize.py) and train on the shard folder"
            )
        if section == "training" and cfg.skip_documents:
            check_skip_documents(job, streamed)
        if section == "training" and streamed and job.fault_tolerance.enable:
            raise ConfigError(
                f"fault_tolerance.enable with the streamed dataset {cfg.dataset!r}: a group that "
                "heals from a live one must jump to its data position, and a stream has no "
                "global index to jump to. Train on local files without "
                "training.dataset_streaming, or disable fault_tolerance"
            )


def check_skip_documents(job, streamed: bool) -> None:
    """training.skip_documents: packed, indexed text, and a file whose lines name its
    sources (their indices are checked against the data when it is read)."""
    from titan.components.data.dataset import DataError, parse_mix
    from titan.components.data.document_index import parse_skip_file, skip_refusal
    from titan.config import ConfigError

    t = job.training
    refusal = skip_refusal(t.dataset_format == "chat", streamed, t.skip_documents)
    if refusal:
        raise ConfigError(refusal)
    names = [name for name, _ in parse_mix(t.dataset_mix)] if t.dataset_mix else [t.dataset]
    try:
        parse_skip_file(t.skip_documents, names)
    except DataError as e:
        raise ConfigError(str(e)) from None


def check_mix(job) -> None:
    """Weighted sources: well-formed, local (indexed), and not combined with a single one."""
    from titan.components.data.dataset import (
        DataError,
        check_same_fields,
        local_files,
        parse_mix,
    )
    from titan.config import ConfigError
    from titan.config.manager import require, source_of

    t = job.training
    try:
        mix = parse_mix(t.dataset_mix)
        for name, _ in mix:
            if local_files(name, None, key="training.dataset_mix") is None:
                raise DataError(
                    f"training.dataset_mix source {name!r} is neither a local path "
                    "nor a bundled name; mixed sources are read indexed, so "
                    "pretokenize a hub dataset first (scripts/pretokenize.py)"
                )
        check_same_fields([name for name, _ in mix])
    except DataError as e:
        raise ConfigError(str(e)) from None
    for key in ("training.dataset_path", "training.dataset_streaming"):
        require(
            job,
            source_of(job, key) == "the default",
            key,
            "cannot be combined with training.dataset_mix (its entries name the sources, "
            "which are read indexed)",
        )


register(Entry("datasets", plan_check=check_datasets))
# what the files hold, read when a run is about to start (titan.components.data.content_check)
_CONTENT = "titan.components.data.content_check:plan_check"
register(Entry("data content", plan_check=_CONTENT, reads_inputs=True))
