"""Fetch a model's tokenizer (and optionally its safetensors weights) from the HF hub.

    python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B [--weights]

Files land in assets/hf/<model name>/, the folder train_configs/llama3_*.toml point at.
Gated repos need `huggingface-cli login` (or HF_TOKEN) first.
"""

import argparse
import sys
from pathlib import Path

TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repo", required=True, help="HF repo id, e.g. meta-llama/Llama-3.1-8B")
    ap.add_argument("--out", default="assets/hf", help="parent folder (default assets/hf)")
    ap.add_argument("--weights", action="store_true", help="also fetch *.safetensors weights")
    args = ap.parse_args()

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = TOKENIZER_FILES + (
        ["*.safetensors", "*.safetensors.index.json"] if args.weights else []
    )
    dest = Path(args.out) / args.repo.split("/")[-1]
    try:
        snapshot_download(args.repo, allow_patterns=patterns, local_dir=dest)
    except GatedRepoError:
        fail(
            f"{args.repo} is gated: accept its license on huggingface.co, then "
            "`huggingface-cli login` (or set HF_TOKEN) and run this again"
        )
    except RepositoryNotFoundError:
        fail(
            f"{args.repo}: no such repo on the hub (or it is private: log in first); check "
            "the id, e.g. meta-llama/Llama-3.1-8B"
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(
            f"could not download {args.repo} ({first[:200]}): check the network (HF_HUB_OFFLINE "
            "unset, a proxy if needed), or copy the files into " + str(dest)
        )
    print(f"downloaded {args.repo} to {dest}")


def fail(why: str) -> None:
    print(f"download_hf_assets: {why}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
