"""Generate text from a titan DCP checkpoint or an HF folder:

    python -m titan.tools.generate --checkpoint outputs/checkpoint --prompt "In the beginning"
    python -m titan.tools.generate --checkpoint exports/llama_hf --prompt "A" --prompt "B" \\
        --temperature 0.8 --top-p 0.9 --seed 1
    python -m titan.tools.generate --checkpoint outputs/checkpoint/step-50 --chat \\
        --prompt "What does Genesis 1:3 say?"      # a user turn, in the chat template
    torchrun --nproc_per_node 2 -m titan.tools.generate --checkpoint ... --prompt ...   # TP 2

A DCP checkpoint (a step folder, or a checkpoint root: its newest complete step) is read
with the model of the training config (--job.config_file, --model.flavor, ...; any titan
override is accepted); its vocabulary comes from the checkpoint. An HF folder brings its
own architecture (config.json) and tokenizer. The tokenizer is the HF folder's; for DCP,
--model.tokenizer_path when given, else the one the run trained with (its marker records it).
With --chat each prompt is a user turn (after --system's text, when given) rendered with the
tokenizer's chat template (or --chat.template), and the answer ends at the tokenizer's EOS
(the end of an assistant turn). Several ranks split the model by tensor parallelism and each
reads only its shards. A LoRA run's training save (adapters only) is read as its base with
the adapters folded in, in one process. Decoding keeps a KV cache; temperature 0 is greedy.

A prompt plus --max-new-tokens must fit the model's positions (an HF folder's
max_position_embeddings; for DCP the flavor's published context, else training.seq_len), and
a DCP checkpoint must hold --model.flavor's shapes. These and out-of-range options end with
one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titan.models.common.generation import Sampling, generate, sample  # noqa: F401

logger = logging.getLogger("titan.tools.generate")


# ----------------------------------------------------------------------------- loading


def _is_hf(path: Path) -> bool:
    return (path / "config.json").is_file()


def checkpoint_folder(path: Path) -> Path:
    """A step folder or HF folder as given, its files checked against their checksums; for a
    checkpoint root, its newest intact step (which may be a final HF save), with a warning for
    each newer one that is damaged. Raises CheckpointError when none is usable."""
    from titan.components.checkpoint import folders as checkpoint

    if _is_hf(path):
        return path

    def warn(message: str) -> None:
        print(f"titan.tools.generate: warning: {message}", file=sys.stderr, flush=True)

    return checkpoint.intact_folder(path, "--checkpoint", "generating from", warn)


def readable_folder(checkpoint: str, flag: str = "--checkpoint") -> Path:
    """`checkpoint`, a folder or a URL of one in object storage, as checkpoint_folder gives
    it; an HF folder in a bucket copied once to the local cache (safetensors maps local
    files). CheckpointError naming `flag` when it cannot be read."""
    from titan.components.checkpoint.folders import CheckpointError
    from titan.runtime.paths import as_path, is_remote, missing_package

    if why := missing_package(checkpoint):
        raise CheckpointError(f"{flag} {checkpoint}: {why}")
    path = as_path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"{flag} {path}: no such folder")
    path = checkpoint_folder(path)
    if is_remote(path) and _is_hf(path):
        from titan.components.checkpoint.hf_io import local_hf_copy

        path = local_hf_copy(path)
    return path


class GenerateError(ValueError):
    """A command line or checkpoint that cannot be used: one line for the user, exit 2."""


def positions(args) -> int:
    """Positions the model was made for: a long-context flavor's published context, else the
    sequence length it was trained at (an HF folder's max_position_embeddings)."""
    return args.context_len or args.max_seq_len


def model_args(path: Path, job, spec):
    """The args of the model in `path` (a folder as `checkpoint_folder` gives it), with
    max_seq_len its positions: an HF folder's own; for DCP, those its marker records (at the
    training seq_len), else --model.flavor's with the checkpoint's vocabulary, after checking
    that the shapes are the flavor's."""
    from titan.components.checkpoint import folders as checkpoint
    from titan.components.checkpoint import hf_io

    if _is_hf(path):
        return hf_io.args_from_hf(path, spec)
    checkpoint.check_complete(path)
    shapes = {n: s for n, (s, _) in checkpoint.dcp_model_metadata(path).items()}
    name = job.model.flavor
    saved = checkpoint.saved_model(path) or {}
    named = "model.flavor" in job.sources and job.model.flavor != saved.get("flavor")
    if saved.get("family") == spec.name and not named:
        # the architecture it records (the flavor with the family's options it trained
        # with: an MTP depth, say), unless another flavor is named
        from titan.components.checkpoint.identity import args_in_record

        args = args_in_record(spec, saved, job.training.seq_len)
        flavor = spec.flavors.get(saved.get("flavor"))
        if flavor is None:
            return args
        # the training settings (balancing rates) are the flavor's: they train, not generate
        return args.with_updates(**{k: getattr(flavor, k) for k in args.training_knobs})
    if name not in spec.flavors:
        raise GenerateError(
            f"--model.flavor {name}: {spec.name} has flavors {', '.join(spec.flavors)}"
        )
    args = _flavor_args(spec, spec.flavors[name], shapes, job.training.seq_len)
    if args is None:
        from titan.config.manager import source_of

        fits = [
            f
            for f, a in spec.flavors.items()
            if _flavor_args(spec, a, shapes, job.training.seq_len) is not None
        ]
        fix = (
            f"it holds flavor {fits[0]!r}: pass --model.flavor {fits[0]}"
            if fits
            else "pass the flavor it was trained with (--model.flavor or its --job.config_file)"
        )
        raise GenerateError(
            f"{path} does not hold a {spec.name} {name!r} model (model.flavor "
            f"from {source_of(job, 'model.flavor')}): "
            f"{_shape_difference(spec, spec.flavors[name], shapes)}; {fix}"
        )
    from titan.components.checkpoint.identity import model_identity

    # shapes alike, models not: a tied flavor reading an untied checkpoint, or a record that
    # names another architecture (rope, norms)
    why = model_identity(spec, name, args).problem(path)
    if why:
        saved = checkpoint.saved_model(path) or {}
        fix = (
            f"pass --model.flavor {saved['flavor']}"
            if saved.get("flavor") in spec.flavors
            else "pass the flavor it was trained with"
        )
        raise GenerateError(f"{path} does not hold this model: {why}; {fix}")
    return args


def _flavor_args(spec, flavor, shapes: dict, seq_len: int):
    """The flavor's args at the checkpoint's vocabulary when every shape is the flavor's, else
    None (a tied copy the checkpoint stores under its owner's name only is no difference)."""
    try:
        args = flavor.with_updates(
            vocab_size=spec.vocab_size_of(shapes, flavor), max_seq_len=seq_len
        )
    except ValueError:  # no vocabulary-sized tensor: another family's checkpoint
        return None
    want = spec.state_shapes(args)
    copies = {c for owner, c in spec.build_meta(args).tied_parameters() if owner in shapes}
    same = set(want) - copies <= set(shapes) <= set(want) and all(
        tuple(shapes[n]) == tuple(want[n]) for n in shapes
    )
    return args if same else None


def _shape_difference(spec, flavor, shapes: dict) -> str:
    """The first few differences between a checkpoint's shapes and the flavor's."""
    try:
        flavor = flavor.with_updates(vocab_size=spec.vocab_size_of(shapes, flavor))
    except ValueError:
        pass
    want = spec.state_shapes(flavor)
    diff = [
        f"{n} {tuple(shapes[n])} vs {tuple(want[n])}"
        for n in want
        if n in shapes and tuple(shapes[n]) != tuple(want[n])
    ]
    diff += [f"{n} only in the checkpoint" for n in sorted(set(shapes) - set(want))]
    if not diff:
        diff = [f"{n} missing" for n in sorted(set(want) - set(shapes))]
    return f"{'; '.join(diff[:3])}{' ...' if len(diff) > 3 else ''} (checkpoint vs flavor)"


def load_model(path: Path, job, spec, max_len: int, device: torch.device, tp_dims=None):
    """The model of a DCP checkpoint or HF folder, on `device`, split over `tp_dims` when
    given (each rank reads only its shards); returns (model, args)."""
    from titan.components.checkpoint import folders as checkpoint
    from titan.components.checkpoint import hf_io
    from titan.components.checkpoint.train_state import ModelState
    from titan.components.lora.merged import adapters_of, merged_state

    path = checkpoint_folder(path)
    args = model_args(path, job, spec).with_updates(max_seq_len=max_len)
    model = spec.build_meta(args)
    if tp_dims is not None:
        model = spec.parallelize_fn(model, tp_dims, job)
    model.to_empty(device=device)
    model.init_weights(0, buffer_device=device)  # builds the RoPE table; weights come next
    state = ModelState([model])
    adapters = {} if _is_hf(path) else adapters_of(checkpoint.saved_model(path))
    if _is_hf(path):
        loaded, _ = hf_io.load_hf_into(state.state_dict(), path, spec, args)
    elif adapters:  # a LoRA run's save: its base, with the adapters folded in
        if tp_dims is not None:
            raise GenerateError(
                f"{path} holds LoRA adapters only: generate from it in one process (the "
                "adapters are folded into the base there)"
            )
        loaded = merged_state(path, spec, args, adapters)
    else:
        import torch.distributed.checkpoint as dcp

        from titan.components.checkpoint.storage import dcp_reader

        loaded = state.state_dict()
        with checkpoint._quiet_no_dist():  # one process without a group: meant
            dcp.load({checkpoint.MODEL_KEY: loaded}, storage_reader=dcp_reader(path))
    state.load_state_dict(loaded)
    logger.info("loaded %s (%.1fM parameters)", path, args.num_params() / 1e6)
    return model.eval(), args


def _tp_job(job, world: int):
    """The config a TP-only inference layout needs: no SP (one token at a time), full logits."""
    p = job.parallelism
    p.tensor_parallel_degree, p.data_parallel_shard_degree = world, 1
    p.enable_sequence_parallel, p.disable_loss_parallel = False, True
    job.activation_checkpoint.mode = "none"
    job.compile.enable = False
    return job


class TextStream:
    """The text each new token adds, for printing as it comes. A character whose UTF-8 bytes
    span several tokens decodes to U+FFFD until its last byte arrives: that tail is held back."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special=True)
        end = len(text.rstrip("\ufffd"))
        new, self.shown = text[self.shown : end], max(self.shown, end)
        return new

    def flush(self) -> str:
        """What is left at the end (a character that never completed stays U+FFFD)."""
        return self.tokenizer.decode(self.ids, skip_special=True)[self.shown :]


def check_options(opts) -> None:
    """Sampling options out of range fail before anything is loaded."""
    problems = [
        (opts.max_new_tokens >= 1, f"--max-new-tokens {opts.max_new_tokens}: must be >= 1"),
        (opts.temperature >= 0, f"--temperature {opts.temperature}: must be >= 0 (0 = greedy)"),
        (opts.top_k >= 0, f"--top-k {opts.top_k}: must be >= 0 (0 = no limit)"),
        (0 < opts.top_p <= 1, f"--top-p {opts.top_p}: must lie in (0, 1] (1 = no cut)"),
        (
            opts.system is None or opts.chat,
            "--system is the system turn of a chat prompt: add --chat (or drop --system)",
        ),
    ]
    for ok, why in problems:
        if not ok:  # also NaN, which compares false either way
            raise GenerateError(why)


def check_positions(prompts: list[list[int]], max_new_tokens: int, limit: int) -> None:
    """Every prompt and its new tokens must fit the positions the model was made for."""
    for i, p in enumerate(prompts):
        if len(p) >= limit:
            raise GenerateError(
                f"prompt {i} is {len(p)} tokens, the model has {limit} "
                "positions (max_seq_len): shorten the prompt"
            )
        if len(p) + max_new_tokens > limit:
            raise GenerateError(
                f"prompt {i} ({len(p)} tokens) + --max-new-tokens {max_new_tokens} need "
                f"{len(p) + max_new_tokens} positions, the model has {limit} (max_seq_len): "
                f"pass --max-new-tokens {limit - len(p)} or less, or a shorter prompt"
            )


def _fail(why) -> None:
    print(f"titan.tools.generate: {why}", file=sys.stderr, flush=True)
    sys.exit(2)


def chat_prompts(tokenizer, prompts: list[str], system: str | None, template: str = ""):
    """Each prompt as a user turn (after `system`), ready for the assistant's answer."""
    from titan.components.data.chat_template import ChatTemplate

    chat = ChatTemplate.load(tokenizer, template)
    head = [{"role": "system", "content": system}] if system else []
    # the template writes BOS itself, where the format has one
    return [
        tokenizer.encode(
            chat.render([*head, {"role": "user", "content": p}], add_generation_prompt=True),
            bos=False,
            eos=False,
        )
        for p in prompts
    ]


def trained_tokenizer(path: Path, job) -> str:
    """The tokenizer a DCP step folder's model was trained with (its marker's record), unless
    --model.tokenizer_path names one; saves older than the record: the config's."""
    from titan.components.checkpoint.trained_with import saved_trained_with

    saved = (saved_trained_with(path).get("tokenizer") or {}).get("path")
    if "model.tokenizer_path" in job.sources or saved is None:
        return job.model.tokenizer_path
    if not Path(saved).exists():
        raise GenerateError(
            f"{path} was trained with the tokenizer {saved}, which is not there: pass the "
            "same tokenizer with --model.tokenizer_path"
        )
    return saved


def refuse_parametrized(path: Path) -> None:
    """A model whose converters parametrized its weights (muP's multipliers, recorded in the
    marker) computes other outputs when built plainly, as this tool builds it."""
    from titan.components.checkpoint.trained_with import saved_trained_with

    parametrization = saved_trained_with(path).get("parametrization")
    if parametrization:
        raise GenerateError(
            f"{path} was trained parametrized as {parametrization}, which the model built "
            "here would not apply (its outputs would be another model's); export it "
            "(checkpoint.last_save_model_only or last_save_in_hf: the export folds the "
            "multipliers into the weights), or evaluate it in the training loop ([eval], "
            "[validation])"
        )


def open_checkpoint(checkpoint: str, overrides: list[str]):
    """(job, folder, train spec, tokenizer) of a --checkpoint and titan overrides: the family
    the folder holds unless --model.name names one; the tokenizer an HF folder brings, else
    the one the run trained with. Raises ConfigError, CheckpointError, TokenizerError,
    GenerateError, or KeyError for an unregistered family."""
    from titan.components.checkpoint.identity import family_in
    from titan.components.data.tokenizer import Tokenizer
    from titan.config import parse_args
    from titan.models.spec import get_train_spec

    job = parse_args(overrides)
    path = readable_folder(checkpoint)
    if "model.name" not in job.sources:  # the family the folder holds, unless one is named
        job.model.name = family_in(path) or job.model.name
    spec = get_train_spec(job.model.name)
    if not _is_hf(path):
        refuse_parametrized(path)
    hf_tokenizer = _is_hf(path) and (path / "tokenizer.json").is_file()
    tokenizer = Tokenizer(str(path if hf_tokenizer else trained_tokenizer(path, job)))
    return job, path, spec, tokenizer


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m titan.tools.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--checkpoint", required=True, help="DCP step folder / checkpoint root, or an HF folder"
    )
    ap.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    ap.add_argument(
        "--max-new-tokens",
        "--max_new_tokens",
        type=int,
        default=64,
        help="at most this many tokens per prompt (>= 1; prompt + these must fit "
        "the model's positions)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument(
        "--top-k", "--top_k", type=int, default=0, help="sample among the k likeliest (0: all)"
    )
    ap.add_argument(
        "--top-p",
        "--top_p",
        type=float,
        default=1.0,
        help="nucleus sampling mass, in (0, 1] (1: all)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--chat", action="store_true", help="each prompt is a user turn of the chat template"
    )
    ap.add_argument("--system", default=None, help="with --chat: a system prompt before it")
    ap.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image every prompt is about (a vision-language model); repeat for several",
    )
    return ap


def image_prompts(opts, job, path: Path, tokenizer, args):
    """(each prompt's ids, the batch fields of their images) for --image: BOS, the images,
    the prompt; or with --chat the user turn holding the images then the prompt."""
    from titan.components.data.image_sources import decoded
    from titan.components.data.image_text import (
        VisionTokens,
        image_fields,
        image_rule,
        prompt_batch,
        prompt_tokens,
        with_images,
    )
    from titan.components.data.images import image_patches

    if getattr(args, "vision", None) is None:
        raise GenerateError(f"--image: {job.model.name} {job.model.flavor!r} has no vision tower")
    rule = image_rule(args.vision, job.extensions.get("images"), path if _is_hf(path) else None)
    cut = [image_patches(decoded(f, f"--image {f}"), rule) for f in opts.image]
    pixels, grids = [p for p, _ in cut], [tuple(g.tolist()) for _, g in cut]
    vt, merge = VisionTokens.of(tokenizer), rule.merge_size
    out = []
    for text in opts.prompt:
        if opts.chat:
            from titan.components.data.chat_template import ChatTemplate

            parts = [*({"type": "image"} for _ in grids), {"type": "text", "text": text}]
            head = [{"role": "system", "content": opts.system}] if opts.system else []
            chat = ChatTemplate.load(tokenizer, job.chat.template)
            rendered = chat.render(
                [*head, {"role": "user", "content": parts}], add_generation_prompt=True
            )
            ids, kinds = with_images(
                tokenizer.encode(rendered, bos=False, eos=False), grids, vt, merge
            )
        else:
            text_ids = tokenizer.encode(text, bos=False, eos=False)
            ids, kinds = prompt_tokens(grids, text_ids, vt, merge, tokenizer.bos_id)
        out.append((ids, image_fields(kinds, grids, pixels, merge)))
    return [ids for ids, _ in out], prompt_batch(out)


def main(argv: list[str] | None = None) -> None:
    opts, overrides = _parser().parse_known_args(argv)
    try:
        check_options(opts)
    except GenerateError as e:
        _fail(e)

    from titan.components.checkpoint.folders import CheckpointError
    from titan.components.data.dataset import DataError
    from titan.components.data.tokenizer import TokenizerError
    from titan.config import ConfigError
    from titan.parallelisms.parallel_dims import ParallelDims
    from titan.runtime.distributed import init_distributed, pick_device
    from titan.runtime.logging_setup import init_logging

    init_logging()
    # every rank checks alike, so with torchrun all of them stop at the same line
    try:
        job, path, spec, tokenizer = open_checkpoint(opts.checkpoint, overrides)
        args, fields = model_args(path, job, spec), None
        if opts.image:
            prompts, fields = image_prompts(opts, job, path, tokenizer, args)
        elif opts.chat:
            prompts = chat_prompts(tokenizer, opts.prompt, opts.system, job.chat.template)
        else:
            prompts = [tokenizer.encode(p, bos=True, eos=False) for p in opts.prompt]
        check_positions(prompts, opts.max_new_tokens, positions(args))
    except (ConfigError, CheckpointError, TokenizerError, GenerateError, DataError) as e:
        _fail(e)
    except KeyError as e:  # an unregistered model name
        _fail(e.args[0])
    device = pick_device(job.training.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp_dims = None
    if world > 1:
        init_distributed(device, job.comm.init_timeout_seconds)
        tp_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, world_size=world)
        tp_dims.build_mesh(device.type)
        job = _tp_job(job, world)
    max_len = max(len(p) for p in prompts) + opts.max_new_tokens
    try:
        model, _ = load_model(path, job, spec, max_len, device, tp_dims)
    except CheckpointError as e:
        _fail(e)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    stream = len(prompts) == 1 and rank0
    text_stream = TextStream(tokenizer)

    def on_step(ids):
        print(text_stream.push(int(ids[0])), end="", flush=True)

    if stream and not opts.chat:
        print(opts.prompt[0], end="", flush=True)
    out = generate(
        model,
        prompts,
        max_new_tokens=opts.max_new_tokens,
        eos_id=tokenizer.eos_id,
        sampling=Sampling(opts.temperature, opts.top_k, opts.top_p, opts.seed),
        on_step=on_step if stream else None,
        fields=fields,
    )
    if stream:
        print(text_stream.flush())
    elif rank0:
        for i, (p, ids) in enumerate(zip(opts.prompt, out)):
            answer = tokenizer.decode(ids, skip_special=True)
            print(f"[{i}] {p}\n{answer}" if opts.chat else f"[{i}] {p}{answer}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    import signal

    # piped into head & co, the text ends as GNU tools' does when the reader goes: quietly
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
