"""What a run trained with besides its model: the optimizer whose state a checkpoint holds,
the tokenizer its weights read, and the parametrization the model converters give its weights
(muP's multipliers: the same weights compute other outputs without them). Each save records
them in its marker; a resume onto another optimizer, tokenizer or parametrization is refused in
one line before any state is read (DCP would fail deep in the load on missing optimizer keys,
another tokenizer's ids silently mean other tokens, other multipliers silently train another
model). Saves older than the record are not checked."""

from pathlib import Path

from titan.components.checkpoint.folders import _marker


def trained_with(optimizer: str, tokenizer, parametrization: dict | None = None) -> dict:
    """The record of a run with the optimizer named `optimizer`, `tokenizer` (a titan
    Tokenizer, or None when unknown: its folder, or file if not named tokenizer.json, and
    fingerprint) and the converters' `parametrization` (Converters.parametrization)."""
    from titan.components.data.token_shards import tokenizer_fingerprint

    record = {"optimizer": optimizer, "parametrization": parametrization or {}}
    if tokenizer is None:
        return record
    file = tokenizer.path
    where = file.parent if file.name == "tokenizer.json" else file
    fingerprint = tokenizer_fingerprint(tokenizer)
    return {**record, "tokenizer": {"path": str(where), "fingerprint": fingerprint}}


def saved_trained_with(path: Path) -> dict:
    """The record of a complete step folder's marker ({} for saves older than it)."""
    return _marker(path).get("trained_with") or {}


def tokenizer_problem(path: Path, ours: dict) -> str | None:
    """Why the step folder `path`'s model, trained with another tokenizer than this run's
    (`trained_with`), cannot resume; None where it was trained with this one (or either is
    not recorded). Asked before the model's shapes: another tokenizer changes the vocabulary,
    which the model's identity would blame on the model."""
    saved = _marker(path).get("trained_with") or {}
    theirs_tok, our_tok = saved.get("tokenizer") or {}, ours.get("tokenizer") or {}
    if our_tok and theirs_tok and theirs_tok.get("fingerprint") != our_tok.get("fingerprint"):
        return (
            f"its model was trained with the tokenizer {theirs_tok.get('path')} and this run "
            f"reads {our_tok.get('path')}, which maps text to other ids: resume with "
            f"--model.tokenizer_path {theirs_tok.get('path')}, or start a new run from these "
            "weights with checkpoint.initial_load_path"
        )
    return None


def resume_problem(path: Path, ours: dict, exclude: list[str]) -> str | None:
    """Why the step folder `path` does not resume into a run that trains with `ours`
    (`trained_with`), not loading the state parts `exclude`; None if it does."""
    marker = _marker(path)
    saved = marker.get("trained_with") or {}
    theirs_opt, our_opt = saved.get("optimizer"), ours.get("optimizer")
    loads_optimizer = "optimizer" not in exclude and not marker.get("model_only")
    if loads_optimizer and theirs_opt and our_opt and theirs_opt != our_opt:
        return (
            f"its optimizer state is {theirs_opt}'s and this run's optimizer is {our_opt}: "
            f"resume with --optimizer.name {theirs_opt}, or start {our_opt}'s state afresh "
            "with --checkpoint.exclude_from_loading optimizer"
        )
    why = tokenizer_problem(path, ours)
    if why:
        return why
    if "parametrization" in saved and "parametrization" in ours:
        theirs_p, our_p = saved["parametrization"], ours["parametrization"]
        if theirs_p != our_p:
            return (
                f"its weights were trained parametrized as {theirs_p or 'the family defines'} "
                f"and this run's are {our_p or 'the family defines'}: resume with the "
                "checkpoint's settings, or start a new run from these weights with "
                "checkpoint.initial_load_path"
            )
    return None
