"""Resolve user paths: as given (relative to the working directory), else relative to the
repo checkout, so bundled assets are found wherever run_train.sh is started from. A URL
(`s3://bucket/key`, any fsspec scheme but file://) is a path of its store, through
universal-pathlib (`as_path`), which answers the pathlib calls titan's folder rules make."""

import importlib.util
import os
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# the optional extra that installs each scheme's fsspec package
EXTRAS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
}
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def scheme(path) -> str | None:
    """The URL scheme of `path` ("s3", "gs", ...), None for a local path (file:// too)."""
    m = _URL.match(str(path))
    return None if m is None or m[1] == "file" else m[1].lower()


def is_remote(path) -> bool:
    return scheme(path) is not None


def missing_package(url: str) -> str | None:
    """Why `url` cannot be opened here for lack of a package (naming the extra), or None."""
    kind = scheme(url)
    if kind is None:
        return None
    package, extra = EXTRAS.get(kind, (None, None))
    needed = ["upath"] + ([package] if package else [])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    names = ", ".join("universal-pathlib" if m == "upath" else m for m in missing)
    how = f"pip install 'titan[{extra}]'" if extra else f"install fsspec's {kind} package"
    return f"{kind}:// paths need {names}: {how}"


def as_path(path) -> Path:
    """`path` as a pathlib-like object: a Path, or a UPath for a URL (ValueError naming the
    extra to install when its packages are missing)."""
    if isinstance(path, Path) or not is_remote(path):
        return Path(path)
    if why := missing_package(str(path)):
        raise ValueError(why)
    from upath import UPath

    return UPath(str(path))


def resolve(path: str) -> Path:
    if is_remote(path):
        return as_path(path)
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p


def cache_dir() -> Path:
    """titan's local cache (token caches, copies of remote folders): TITAN_CACHE_DIR, by
    default ~/.cache/titan."""
    return Path(os.environ.get("TITAN_CACHE_DIR", "~/.cache/titan")).expanduser()


def local_copy(files: list, name: str) -> Path:
    """`files` (paths of one folder in object storage) copied into `cache_dir()/name`, once:
    made aside and renamed into place, so the folder is whole or absent, and processes copying
    at once leave one copy. `name` should change with the files (a hash of their listing)."""
    import shutil
    import tempfile

    dest = cache_dir() / name
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=dest.parent))
    for f in files:
        f.fs.get_file(f.path, str(aside / f.name))
    try:
        aside.rename(dest)
    except OSError:  # another process's copy is in place
        shutil.rmtree(aside, ignore_errors=True)
    return dest
