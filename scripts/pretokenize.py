"""Tokenize a corpus once into token shards that training reads memory-mapped.

    python scripts/pretokenize.py data/raw/ data/shards/ --num-proc 8
    python scripts/pretokenize.py allenai/c4:en data/c4_shards --max-documents 1000000

The input is what training.dataset / dataset_path accept: a jsonl/json/parquet/txt file or a
folder of them (read in sorted order), a bundled name (kjv), or an HF hub dataset (streamed).
Every document becomes BOS ... EOS, in input order, so the shards hold exactly the stream the
on-the-fly path would build from the same files. Then train with

    [training]
    dataset_path = "data/shards"

The folder's meta.json records the tokenizer's fingerprint: training with another tokenizer
is refused. Resident memory stays flat with corpus size while writing and while training.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.components.data.dataset import DataError, iter_texts, local_files, open_hub  # noqa: E402
from titan.components.data.token_shards import ShardWriter, encode_documents, is_shard_folder  # noqa: E402
from titan.components.data.tokenizer import Tokenizer  # noqa: E402


def hub_texts(name: str, text_field: str, batch_size: int):
    ds = open_hub(name)
    for n, batch in enumerate(ds.iter(batch_size=batch_size)):
        texts = batch.get(text_field)
        if texts is None:
            raise DataError(
                f"{name} has no field '{text_field}' (fields: {sorted(batch)}); pass --text-field"
            )
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise DataError(
                f"{name}: record {n * batch_size + bad} has no text in field '{text_field}'"
            )
        yield texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("source", help="file, folder, bundled name or hub name[:subset]")
    ap.add_argument("output", help="shard folder to create (must not exist)")
    ap.add_argument(
        "--tokenizer",
        default="assets/tokenizer/tokenizer.json",
        help="tokenizer.json (or folder) training will use (model.tokenizer_path)",
    )
    ap.add_argument("--text-field", default="text", help="column holding the document text")
    ap.add_argument("--num-proc", type=int, default=1, help="tokenizing processes")
    ap.add_argument("--batch-size", type=int, default=1024, help="documents per task")
    ap.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 28,
        help="tokens per shard file, cut between documents (default 2^28)",
    )
    ap.add_argument(
        "--max-documents",
        type=int,
        default=None,
        help="stop after this many documents (hub datasets are unbounded)",
    )
    args = ap.parse_args(argv)

    out = Path(args.output)
    if out.exists():
        print(
            f"error: {out} exists{' (a shard folder)' if is_shard_folder(out) else ''}; "
            "choose a new output folder or remove it",
            file=sys.stderr,
        )
        return 2
    try:
        tokenizer = Tokenizer(args.tokenizer)
        files = local_files(args.source, None, key="source")
        if files is not None and len(files) == 1 and is_shard_folder(files[0]):
            raise DataError(f"{files[0]} is already a shard folder")
        texts = (
            iter_texts(files, args.text_field, args.batch_size)
            if files is not None
            else hub_texts(args.source, args.text_field, args.batch_size)
        )
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_documents is not None:
        texts = _limit(texts, args.max_documents)

    from tqdm import tqdm

    writer = ShardWriter(
        out,
        tokenizer,
        shard_tokens=args.shard_tokens,
        sources=[str(f) for f in files] if files else [args.source],
    )
    t0 = time.perf_counter()
    try:
        with tqdm(unit="doc", desc="tokenizing", dynamic_ncols=True) as bar:
            for docs in encode_documents(tokenizer, texts, num_proc=args.num_proc):
                writer.add(docs)
                bar.update(len(docs))
                bar.set_postfix(tokens=f"{writer.tokens:.3g}", refresh=False)
        writer.close()
    except DataError as e:
        writer.abort()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        writer.abort()
        raise
    docs = sum(s["documents"] for s in writer.meta["shards"])
    secs = time.perf_counter() - t0
    print(
        f"wrote {writer.tokens:,} tokens of {docs:,} documents in "
        f"{len(writer.meta['shards'])} shard(s) to {out} ({writer.dtype.name}, "
        f"{writer.tokens / max(secs, 1e-9):,.0f} tokens/s)"
    )
    return 0


def _limit(batches, n: int):
    left = n
    for texts in batches:
        if left <= 0:
            return
        yield texts[:left]
        left -= len(texts)


if __name__ == "__main__":
    sys.exit(main())
