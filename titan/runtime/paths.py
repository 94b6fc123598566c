"""Resolve user paths: as given (relative to the working directory), else relative to the
repo checkout, so bundled assets are found wherever run_train.sh is started from."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p
