"""Which model a checkpoint holds, and whether it is the model a run builds.

A resume loads weights by name, and DCP ignores names the model does not ask for: without a
check, a checkpoint of an untied flavor "resumed" into a tied one dropped its output matrix and
trained on (the loss jumped from 6.9 to 64). Every save records the family, the flavor and the
architecture in its marker; a load compares them, and the tensor names and shapes too (which
also covers saves older than the record), before a byte of state is read.

The one mismatch that loads is a tied weight stored under both names (saves from before
`tied_state`, and `convert_from_hf`'s): its two tensors are equal, an untied model's are not,
which is how the two are told apart.

What is compared is the architecture: what determines the parameters and the function they
compute. Training settings that a family keeps in its args (an MoE's balancing rates and
coefficients: `training_knobs` of the args class) are recorded too, but a run may change
them; the load logs what changed.
"""

import json
import logging
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

import torch

from titan.components.checkpoint.folders import (
    MODEL_KEY,
    _quiet_no_dist,
    dcp_model_metadata,
    saved_model,
)
from titan.components.checkpoint.storage import as_path, dcp_reader
from titan.components.checkpoint.tied_state import saved_form

logger = logging.getLogger(__name__)

RESUME_FIX = (
    "Resume with the model it was saved from (model.name / model.flavor), or start a "
    "new run in another job.dump_folder or checkpoint.folder"
)
INITIAL_LOAD_FIX = (
    "Set model.name / model.flavor to the model it was saved from, or point "
    "checkpoint.initial_load_path at a checkpoint of this one"
)
# the RoPE table's length is the run's seq_len, not a weight: a resume may change it
_RUN_SETTINGS = ("max_seq_len",)
# RoPE's settings are the args named rope_*: no weight depends on them (qk_rope_head_dim is
# a shape, interleaved_rope a layout; neither is named so), and a long-context phase changes
# them on purpose (checkpoint.allow_rope_change)
ROPE_PREFIX = "rope_"
ROPE_FIX = (
    "If this is a long-context phase that changes RoPE on purpose, add "
    "--checkpoint.allow_rope_change"
)


class Fixed(str):
    """A problem whose text ends with its own fix: the generic one is not added to it."""


def refusal(what: str, path, why: str, fix: str) -> str:
    """The one line refusing to load `path`: the problem, and `fix` unless it has its own."""
    return f"{what} {path}: {why}" + ("" if isinstance(why, Fixed) else f". {fix}")


@dataclass(frozen=True)
class ModelIdentity:
    family: str
    flavor: str
    args: dict  # the architecture and the training knobs, as JSON holds them
    shapes: dict[str, tuple[int, ...]]  # every saved tensor of the whole model
    ties: tuple[tuple[str, str], ...]  # (owner, copy) of tied weights
    # the training knobs of `args`: dotted name -> (record path, value)
    knobs: dict = field(default_factory=dict)
    # when training changes only adapters (LoRA): their settings, and the tensors a training
    # save holds (the base is loaded from where the run started)
    adapters: dict = field(default_factory=dict)
    adapter_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # the args field of blocks only training uses, and this model's block count: a base may
    # hold more of those blocks (ModelArgsBase.training_blocks)
    training_blocks: str | None = None
    block_count: int = 0

    def record(self) -> dict:
        out = {"family": self.family, "flavor": self.flavor, "args": self.args}
        return {**out, "adapters": self.adapters} if self.adapters else out

    def describe(self) -> str:
        return f"{self.family} {self.flavor}"

    def problem(
        self, path: Path, allow_rope_change: bool = False, base: bool = False
    ) -> str | None:
        """Why the checkpoint folder `path` does not hold this model (None if it does).
        `allow_rope_change`: differences in RoPE's settings are logged, not refused. `base`:
        the folder is the base model a run with adapters starts from (a resume's holds the
        adapters)."""
        saved = saved_model(path)
        if saved is not None:
            why = self._record_problem(saved, allow_rope_change, base)
            if not why and not base:
                why = self._adapters_problem(saved.get("adapters") or {})
            if why:
                return why
        expected = self.adapter_shapes if self.adapters and not base else self.shapes
        return self._tensor_problem(path, expected, base)

    def _record_problem(self, saved: dict, allow_rope_change: bool, base: bool) -> str | None:
        theirs = f"{saved.get('family')} {saved.get('flavor')}"
        if saved.get("family") != self.family:
            return f"it holds a {theirs} model and this run builds {self.describe()}"
        args = saved.get("args") or {}
        knobs = self.knobs
        theirs_arch, ours_arch = _without(args, knobs), _without(self.args, knobs)
        from titan.config.family_options import option_names

        # an arg the family's section sets is named by its key, which is what to change
        options = option_names(self.family)
        key = {k: f"{self.family}.{k}" if k in options else k for k in ours_arch}
        diffs = {
            k: f"{key[k]} {theirs_arch.get(k)} (checkpoint) vs {v} (this run)"
            for k, v in ours_arch.items()
            if theirs_arch.get(k) != v
        }
        extra = self.training_blocks
        if base and extra in diffs and (theirs_arch.get(extra) or 0) > ours_arch[extra]:
            logger.info(
                "the base holds %s %s, this run %s: the blocks beyond this run's are not loaded",
                extra,
                theirs_arch.get(extra),
                ours_arch[extra],
            )
            del diffs[extra]
        rope = [k for k in diffs if k.startswith(ROPE_PREFIX)]
        if allow_rope_change and rope:
            logger.info(
                "RoPE changed since the checkpoint was saved (checkpoint.allow_rope_change): %s",
                ", ".join(f"{k} {theirs_arch.get(k)} -> {ours_arch[k]}" for k in rope),
            )
            diffs = {k: v for k, v in diffs.items() if k not in rope}
        if diffs:
            only_rope = not allow_rope_change and set(diffs) == set(rope)
            settable = [k for k in diffs if k in options and k not in rope]
            # only the family's options differ: setting them is the fix
            kind = Fixed if settable and len(settable) == len(diffs) else str
            return kind(
                f"it was saved from {theirs} and this run builds {self.describe()}: "
                + ", ".join(diffs.values())
                + (f". {ROPE_FIX}" if only_rope else "")
                + (
                    "; set "
                    + ", ".join(f"--{key[k]} {theirs_arch.get(k)}" for k in settable)
                    + " to load it"
                    if settable
                    else ""
                )
            )
        changed = [
            f"{name} {_at(args, path)} -> {value}"
            for name, (path, value) in knobs.items()
            if _at(args, path) is not None and _at(args, path) != value
        ]
        if changed:
            logger.info(
                "training settings changed since the checkpoint was saved (allowed: "
                "they are no part of the architecture): %s",
                ", ".join(changed),
            )
        return None

    def _adapters_problem(self, saved: dict) -> str | None:
        """Why adapters saved with the settings `saved` do not resume here: other settings,
        or another base under them (the base is not in the checkpoint: it must be the one
        they were trained on). A base folder that moved is only logged."""
        theirs = {k: v for k, v in saved.items() if k != "base"}
        ours = {k: v for k, v in self.adapters.items() if k != "base"}
        if theirs != ours:
            return Fixed(
                f"it holds {_adapters(theirs)} and this run trains {_adapters(ours)}; resume "
                "with the [lora] settings it was saved with"
            )
        was, now = saved.get("base") or {}, self.adapters.get("base") or {}
        if set(was) != set(now) or was.get("seed") != now.get("seed"):
            return Fixed(
                f"its adapters were trained on {_base(was)} and this run's base is "
                f"{_base(now)}; resume on the base they were trained on"
                + (f" (checkpoint.initial_load_path = {was['path']!r})" if "path" in was else "")
            )
        if was.get("path") != now.get("path"):
            logger.warning(
                "the adapters were trained on the base %s; this run loads %s (moved?)",
                was.get("path"),
                now.get("path"),
            )
        return None

    def _tensor_problem(self, path: Path, expected: dict, base: bool = False) -> str | None:
        held = {name: tuple(size) for name, (size, _) in dcp_model_metadata(path).items()}
        if base and self.training_blocks:  # a base's blocks beyond this model's: not loaded
            held = {n: s for n, s in held.items() if not _beyond(n, self.block_count)}
        missing = [n for n in expected if n not in held]
        shapes = [
            f"{n} {list(held[n])} (checkpoint) vs {list(s)} (this run)"
            for n, s in expected.items()
            if n in held and held[n] != s
        ]
        copies = {copy: owner for owner, copy in self.ties}
        extra = [n for n in held if n not in expected and n not in copies]
        if missing or shapes or extra:
            parts = [
                f"lacks {_few(missing)}" if missing else "",
                f"holds {_few(extra)} that this model has not" if extra else "",
                f"shapes differ: {_few(shapes)}" if shapes else "",
            ]
            return f"its weights are not this {self.describe()} model's: " + "; ".join(
                p for p in parts if p
            )
        for copy, owner in copies.items():
            if copy in held and not _equal_tensors(path, owner, copy):
                return (
                    f"it holds {copy} apart from {owner}: it was saved from a model that "
                    f"does not tie them, and this {self.describe()} model does"
                )
        return None


def _beyond(name: str, blocks: int) -> bool:
    """Whether `name` is a parameter of a block numbered `blocks` or higher."""
    parts = name.split(".")
    return (
        len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= blocks
    )


def _adapters(settings: dict | None) -> str:
    if not settings:
        return "the whole model"
    shown = {k: v for k, v in settings.items() if k != "base"}
    return "LoRA adapters (" + ", ".join(f"{k} {v}" for k, v in shown.items()) + ")"


def _base(base: dict) -> str:
    if "path" in base:
        return f"the weights of {base['path']}"
    return f"the weights made from seed {base.get('seed')}" if base else "an unrecorded base"


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _equal_tensors(path: Path, a: str, b: str) -> bool:
    """Whether the checkpoint's tensors `a` and `b` are equal (read in this process only)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp_model_metadata(path)
    state = {n: torch.empty(meta[n][0], dtype=meta[n][1]) for n in (a, b)}
    with _quiet_no_dist():
        dcp.load({MODEL_KEY: state}, storage_reader=dcp_reader(as_path(path)), no_dist=True)
    return torch.equal(state[a], state[b])


def model_identity(spec, flavor: str, args, adapted=None, adapters: dict | None = None):
    """The identity of the model `spec` builds from `args` (flavor as configured); `adapted`:
    that model with adapters (a meta model), whose trainable tensors a training save holds,
    trained with the settings `adapters`."""
    record = asdict(args) if is_dataclass(args) else dict(vars(args))
    record = json.loads(json.dumps({k: v for k, v in record.items() if k not in _RUN_SETTINGS}))
    meta = spec.build_meta(args)
    ties = tuple(tuple(pair) for pair in meta.tied_parameters())
    shapes = saved_form({n: tuple(t.shape) for n, t in meta.state_dict().items()}, list(ties))
    knobs = {".".join(path): (path, _at(record, path)) for path in knob_paths(args)}
    adapter_shapes = (
        {n: tuple(p.shape) for n, p in adapted.named_parameters() if p.requires_grad}
        if adapted is not None
        else {}
    )
    return ModelIdentity(
        family=spec.name,
        flavor=flavor,
        args=record,
        shapes=shapes,
        ties=ties,
        knobs=knobs,
        adapters=dict(adapters or {}) if adapted is not None else {},
        adapter_shapes=adapter_shapes,
        training_blocks=args.training_blocks,
        block_count=args.block_count(),
    )


def knob_paths(args, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The record paths of the training knobs of `args`: the fields its class lists in
    `training_knobs`, also inside nested settings (an MoE's)."""
    if not is_dataclass(args):
        return []
    # nested settings (an MoE's) may declare knobs of their own, or none
    knobs = set(getattr(type(args), "training_knobs", ()))
    out = []
    for f in fields(args):
        if f.name in knobs:
            out.append((*prefix, f.name))
        else:
            out.extend(knob_paths(getattr(args, f.name), (*prefix, f.name)))
    return out


def _at(record: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record


def _without(record: dict, knobs: dict) -> dict:
    """`record` less the knobs' paths."""
    out = json.loads(json.dumps(record))
    for path, _ in knobs.values():
        parent = _at(out, path[:-1]) if len(path) > 1 else out
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    return out


def family_in(path: Path) -> str | None:
    """The model family a step folder (its marker's record) or an HF folder (config.json's
    model_type) holds; None when it does not say."""
    from titan.models.spec import family_of_hf_config

    if (path / "config.json").is_file():
        from titan.components.checkpoint.hf_io import read_hf_config

        return family_of_hf_config(read_hf_config(path))
    record = saved_model(path)
    return record.get("family") if record else None


def args_in_record(spec, record: dict, max_seq_len: int):
    """The ModelArgs a marker's model record describes (any flavor, from_hf's too)."""
    base = next(iter(spec.flavors.values()))
    known = {
        k: _from_json(v, _field_type(type(base), k))
        for k, v in record["args"].items()
        if hasattr(base, k)
    }
    return base.with_updates(**known, max_seq_len=max_seq_len)


def _field_type(cls, name: str):
    import typing

    try:
        return typing.get_type_hints(cls).get(name)
    except (NameError, TypeError):
        return None


def _from_json(value, hint):
    """A field's value as JSON held it, back in its type: nested settings (an MoE's) as their
    dataclass, lists as the tuples the args hold."""
    import typing

    if value is None or hint is None:
        return value
    import types

    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for t in typing.get_args(hint) if union else (hint,):  # `X | None`: try X
        if is_dataclass(t) and isinstance(value, dict):
            return t(**{k: _from_json(v, _field_type(t, k)) for k, v in value.items()})
        if typing.get_origin(t) is tuple and isinstance(value, list):
            return tuple(value)
    return value
