"""muP's coordinate check: `python -m titan.tools.coord_check [--widths 64,128,256,512]`.

Trains the debug model at several widths for a few steps on one batch of the bundled corpus,
with muP (base width --base_width) and without (titan's standard parametrization), and records
the size of each kind of activation (mean |x| per coordinate: embedding, attention and FFN
outputs, the last block's residual stream, the logits) at every step, and its change since
init (mean |x_t - x_0|). Under muP the changes are flat across the widths; without it they
grow with the width. Prints both tables (--json writes the numbers); --plot draws the changes
where matplotlib is installed (pip install 'titan[plot]').
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from titan.components.mup.converter import MupConverter
from titan.components.optim.muon_spec import MuonOptions
from titan.components.optim.optimizer import build_optimizer
from titan.components.optim.optimizer_spec import Optimizer
from titan.models.spec import get_train_spec

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "assets" / "corpus" / "kjv_train.jsonl"
TOKENIZER = ROOT / "assets" / "tokenizer" / "tokenizer.json"
KINDS = ("embedding", "attention", "ffn", "residual", "logits")
MISSING = "the plot needs matplotlib: pip install 'titan[plot]' (or matplotlib)"


@dataclass(frozen=True)
class Setup:
    """One model and optimizer of a sweep over widths."""

    family: str = "llama3"
    flavor: str = "debugmodel"
    n_layers: int | None = None  # None: the flavor's
    n_heads: int | None = None  # fixed in number at every width (see widened)
    seq_len: int = 64
    optimizer: str = "AdamW"
    lr: float = 1e-2
    weight_decay: float = 0.0
    adjust_lr: str = "match_rms_adamw"  # Muon's
    seed: int = 0


def corpus_tokens(n_tokens: int, path: Path = CORPUS) -> torch.Tensor:
    """The first `n_tokens` tokens of a bundled corpus (its documents in order; default the
    training corpus)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    ids: list[int] = []
    with open(path) as f:
        for line in f:
            ids += tok.encode(json.loads(line)["text"]).ids
            if len(ids) >= n_tokens:
                break
    return torch.tensor(ids[:n_tokens])


def widened(flavor, width: int, n_heads: int | None):
    """The flavor at dim `width` with every hidden width grown in proportion, as muP's single
    multiplier assumes: a family's own FFN width (qwen3's ffn_hidden_dim) scaled with dim; a
    fixed head width (qwen3's head_dim) with heads that grow in number, else (llama3)
    `n_heads` query and key/value heads (None: the flavor's) whose width grows."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(flavor)}
    grow = width / flavor.dim
    changes: dict = {"dim": width}
    if "ffn_hidden_dim" in fields:
        changes["ffn_hidden_dim"] = round(flavor.ffn_hidden_dim * grow)
    if n_heads:
        changes["n_heads"] = changes["n_kv_heads"] = n_heads
    elif "head_dim" in fields:
        changes["n_heads"] = max(1, round(flavor.n_heads * grow))
        changes["n_kv_heads"] = max(1, round(flavor.n_kv_heads * grow))
    return flavor.with_updates(**changes)


def build(setup: Setup, width: int, base_width: int | None):
    """The model of `width` (muP with `base_width`, or standard when None), materialized on
    CPU and initialized as the trainer does, and its titan optimizer (constant lr)."""
    spec = get_train_spec(setup.family)
    args = widened(spec.flavors[setup.flavor], width, setup.n_heads)
    changes = {"max_seq_len": setup.seq_len}
    if setup.n_layers:
        changes["n_layers"] = setup.n_layers
    args = args.with_updates(**changes)
    muon = MuonOptions(adjust_lr=setup.adjust_lr, ns_dtype="float32")
    conv = None
    if base_width is not None:
        conv = MupConverter(base_width, optimizer=setup.optimizer, muon=muon)
    model = spec.build_meta(args)
    if conv:
        conv.convert(model)
    model.to_empty(device="cpu")
    model.init_weights(setup.seed)
    if conv:
        conv.init_weights(model, setup.seed)
    cfg = Optimizer(
        name=setup.optimizer,
        lr=setup.lr,
        weight_decay=setup.weight_decay,
        implementation="foreach",
    )
    opt = build_optimizer([model], cfg, {"muon": muon}, conv.lr_scale if conv else None)
    return model, opt


def _record(model) -> tuple[dict, list]:
    """Forward hooks that keep each kind's outputs of one forward (layers in order)."""
    outs: dict[str, list[torch.Tensor]] = {k: [] for k in KINDS}

    def hook(kind):
        return lambda mod, inp, out: outs[kind].append(out.detach().clone())

    layers = list(model.layers.values())
    handles = [model.tok_embeddings.register_forward_hook(hook("embedding"))]
    for layer in layers:
        handles.append(layer.attention.register_forward_hook(hook("attention")))
        handles.append(layer.feed_forward.register_forward_hook(hook("ffn")))
    handles.append(layers[-1].register_forward_hook(hook("residual")))
    handles.append(model.output.register_forward_hook(hook("logits")))
    return outs, handles


def _mean_abs(xs: list[torch.Tensor]) -> float:
    return sum(x.abs().mean().item() for x in xs) / len(xs)


def coord_sizes(model, opt, batch: torch.Tensor, steps: int) -> list[dict[str, float]]:
    """Each step's activation sizes (mean |x| of a kind's layers averaged: `kind`) and their
    change since init (mean |x_t - x_0|: `kind`+"_change"), measured in the forward of that
    step's training on `batch` (step 0: at init)."""
    import torch.nn.functional as F

    out, first = [], None
    for _ in range(steps):
        outs, handles = _record(model)
        logits = model(batch[:, :-1])
        for h in handles:
            h.remove()
        first = first or outs
        row = {k: _mean_abs(v) for k, v in outs.items()}
        for k, v in outs.items():
            row[k + "_change"] = _mean_abs([x - x0 for x, x0 in zip(v, first[k], strict=True)])
        out.append(row)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out


def run(
    setup: Setup, widths: list[int], base_width: int, steps: int = 4, batch_size: int = 4
) -> dict:
    """{"mup"|"standard": {width: [per-step {kind: size}]}} on one batch of the corpus."""
    torch.manual_seed(setup.seed)
    batch = corpus_tokens(batch_size * (setup.seq_len + 1)).view(batch_size, -1)
    results: dict = {}
    for mode, base in (("standard", None), ("mup", base_width)):
        results[mode] = {}
        for w in widths:
            model, opt = build(setup, w, base)
            results[mode][w] = coord_sizes(model, opt, batch, steps)
    return results


def growth(results: dict, mode: str, kind: str, step: int) -> float:
    """The size of `kind` at `step` at the largest width over that at the smallest."""
    by_width = results[mode]
    widths = sorted(by_width)
    return by_width[widths[-1]][step][kind] / by_width[widths[0]][step][kind]


def table(results: dict, change: bool = False) -> str:
    """One row per (mode, kind, step), one column per width, and the largest/smallest ratio;
    `change`: of the change since init (from step 1)."""
    widths = sorted(next(iter(results.values())))
    steps = len(results["mup"][widths[0]])
    col = "change" if change else "activation"
    head = f"{'mode':9} {col:17} {'step':>4} " + "".join(f"{w:>9}" for w in widths)
    lines = [head + f"{'ratio':>8}", "-" * (len(head) + 8)]
    for mode in results:
        for kind in KINDS:
            if change:
                if kind == "embedding":
                    continue
                kind += "_change"
            for s in range(1 if change else 0, steps):
                row = "".join(f"{results[mode][w][s][kind]:9.4f}" for w in widths)
                ratio = growth(results, mode, kind, s)
                lines.append(f"{mode:9} {kind:17} {s:>4} {row}{ratio:8.2f}")
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    """Each kind's change since init against the width, a line per step; a row per mode, the
    y axis shared down each column so the modes compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, kinds = list(results), KINDS[1:]
    fig, axes = plt.subplots(
        len(modes),
        len(kinds),
        figsize=(3.2 * len(kinds), 3 * len(modes)),
        squeeze=False,
        sharey="col",
    )
    widths = sorted(results[modes[0]])
    steps = len(results[modes[0]][widths[0]])
    for r, mode in enumerate(modes):
        for c, kind in enumerate(kinds):
            ax = axes[r][c]
            for s in range(1, steps):
                sizes = [results[mode][w][s][kind + "_change"] for w in widths]
                ax.plot(widths, sizes, "o-", label=f"step {s}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{mode}: {kind}", fontsize=9)
            ax.set_xlabel("width")
        axes[r][0].set_ylabel("mean |x_t - x_0|")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _fixed_head_dim(family: str, flavor: str) -> bool:
    import dataclasses

    args = get_train_spec(family).flavors[flavor]
    return "head_dim" in {f.name for f in dataclasses.fields(args)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan.tools.coord_check", description=__doc__)
    p.add_argument("--family", default="llama3", help="llama3 or qwen3 (dense)")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--widths", default="64,128,256,512", help="model dims, comma-separated")
    p.add_argument("--base_width", type=int, default=64, help="muP's base width")
    p.add_argument("--steps", type=int, default=4, help="training steps recorded (step 0: init)")
    p.add_argument("--optimizer", default="AdamW", choices=("AdamW", "Adam", "Muon"))
    p.add_argument(
        "--adjust_lr", default="match_rms_adamw", choices=("match_rms_adamw", "original")
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--n_layers", type=int, default=None, help="default: the flavor's")
    p.add_argument(
        "--n_heads",
        type=int,
        default=0,
        help="query = kv heads at every width; 0: 4 where the head width follows dim "
        "(llama3), heads of the flavor's width growing in number where it is fixed (qwen3)",
    )
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the sizes here")
    p.add_argument("--plot", type=Path, help="draw them into this PNG (needs matplotlib)")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    setup = Setup(
        family=a.family,
        flavor=a.flavor,
        n_layers=a.n_layers,
        n_heads=a.n_heads or (None if _fixed_head_dim(a.family, a.flavor) else 4),
        seq_len=a.seq_len,
        optimizer=a.optimizer,
        lr=a.lr,
        adjust_lr=a.adjust_lr,
        seed=a.seed,
    )
    widths = [int(w) for w in a.widths.split(",")]
    results = run(setup, widths, a.base_width, a.steps, a.batch_size)
    print(table(results))
    print()
    print(table(results, change=True))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    if a.plot:
        try:
            plot(results, a.plot)
        except ImportError:
            print(MISSING, file=sys.stderr)
            return 1
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
