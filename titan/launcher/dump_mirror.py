"""A URL as `job.dump_folder` (`s3://bucket/run`, any fsspec scheme).

The ranks append to metrics.jsonl and write TensorBoard events, traces and watchdog reports a
few bytes at a time, which an object store cannot take (an object is written whole). So each
node's ranks write into a local folder, the dump folder's mirror under TITAN_CACHE_DIR, and
that node's launcher uploads what changed there: every `job.dump_sync_interval_s` seconds and
once more when torchrun returns (also after a failure or a signal). Before the workers start
it fetches the URL's top-level files (the histories a resumed run continues: metrics.jsonl,
validation.jsonl, spikes.jsonl, the W&B run id), so a job restarted on another machine goes on
with them. A relative `checkpoint.folder` is taken under the URL: checkpoints go straight to
the store. Nothing is ever deleted from the store.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from pathlib import Path

from titan.runtime.paths import cache_dir, is_remote

# the mirror's record of what the store holds; the HF export's local staging is uploaded by
# the checkpointer itself, to its own place
MANIFEST = ".titan-mirror.json"
NOT_UPLOADED = (MANIFEST, ".hf_export")


def mirror_folder(url: str) -> Path:
    """The local folder mirroring `url` on this machine: readable, and one per URL."""
    digest = hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", url.split("://", 1)[1].strip("/"))[-60:]
    return cache_dir() / "dumps" / f"{readable}-{digest}"


class DumpMirror:
    """One node's mirror of a URL dump folder (see the module doc)."""

    def __init__(self, url: str, local: Path, interval_s: float):
        from fsspec.core import url_to_fs

        self.url, self.local, self.interval_s = url.rstrip("/"), Path(local), interval_s
        self.fs, self.root = url_to_fs(self.url)
        self._uploaded: dict[str, list[int]] = {}  # relative path -> [size, mtime_ns]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the job's folders

    def redirect(self, job) -> list[str]:
        """Point `job` at the mirror (dump folder) and the store (a relative checkpoint
        folder); the same as trainer overrides, for the workers."""
        ck = job.checkpoint
        overrides = ["--job.dump_folder", str(self.local)]
        if not is_remote(ck.folder) and not os.path.isabs(ck.folder):
            ck.folder = f"{self.url}/{ck.folder.strip('/')}"
            overrides += ["--checkpoint.folder", ck.folder]
        job.job.dump_folder = str(self.local)
        return overrides

    # ------------------------------------------------------------------ fetch and upload

    def fetch(self) -> int:
        """Upload what an earlier launch on this machine left unsent, then copy the URL's
        top-level files into the mirror; returns how many were copied."""
        self.local.mkdir(parents=True, exist_ok=True)
        self._uploaded = self._read_manifest()
        unsent = dict(self.push())
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:  # a new run: nothing there yet
            entries = []
        fetched = 0
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry["type"] != "file" or name in NOT_UPLOADED or name in unsent:
                continue  # an unsent file is newer than the store's copy
            target = self.local / name
            part = target.with_name(name + ".fetching")
            self.fs.get_file(entry["name"], str(part))
            os.replace(part, target)
            self._uploaded[name] = self._stat(target)
            fetched += 1
        self._write_manifest()
        return fetched

    def push(self) -> list[tuple[str, str]]:
        """Upload every file of the mirror that changed since its last upload; returns the
        files that could not be uploaded, each with why (tried again on the next push)."""
        with self._lock:
            failed = []
            for rel in self._changed():
                try:
                    self.fs.put_file(str(self.local / rel), f"{self.root}/{rel}")
                except FileNotFoundError:  # renamed or removed meanwhile (a .tmp replaced)
                    continue
                except Exception as e:  # noqa: BLE001  retried at the next push
                    failed.append((rel, f"{type(e).__name__}: {e}"))
                    continue
                self._uploaded[rel] = self._stat(self.local / rel)
            self._write_manifest()
            return failed

    def _changed(self) -> list[str]:
        changed = []
        for folder, dirs, files in os.walk(self.local):
            rel_folder = os.path.relpath(folder, self.local)
            if rel_folder == ".":
                dirs[:] = [d for d in dirs if d not in NOT_UPLOADED]
            for name in files:
                rel = name if rel_folder == "." else f"{rel_folder}/{name}"
                if name in NOT_UPLOADED or name.endswith((".tmp", ".fetching")):
                    continue
                try:
                    stat = self._stat(self.local / rel)
                except FileNotFoundError:
                    continue
                if self._uploaded.get(rel) != stat:
                    changed.append(rel)
        return sorted(changed)

    @staticmethod
    def _stat(path: Path) -> list[int]:
        st = os.stat(path)
        return [st.st_size, st.st_mtime_ns]

    def _read_manifest(self) -> dict:
        try:
            record = json.loads((self.local / MANIFEST).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return record.get("uploaded", {}) if record.get("url") == self.url else {}

    def _write_manifest(self) -> None:
        tmp = self.local / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"url": self.url, "uploaded": self._uploaded}))
        os.replace(tmp, self.local / MANIFEST)

    # ------------------------------------------------------------------ while torchrun runs

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dump-mirror", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push()  # a failure is retried at the next interval, and said at the end

    def finish(self) -> None:
        """Stop the periodic uploads and upload what is left, saying what could not be."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        failed = self.push()
        if failed:
            some = "; ".join(f"{rel} ({why})" for rel, why in failed[:3])
            print(
                f"titan: warning: {len(failed)} file(s) of the dump folder could not be "
                f"uploaded to {self.url}: {some}. They are in {self.local}; "
                "the next launch on this machine uploads them",
                file=sys.stderr,
                flush=True,
            )


def for_job(job) -> DumpMirror | None:
    """The mirror of a URL `job.dump_folder` (None for a local one); ConfigError when its
    store cannot be used."""
    url = job.job.dump_folder
    if not is_remote(url):
        return None
    from titan.components.checkpoint.storage import store_problem
    from titan.config import ConfigError

    if why := store_problem(url):
        raise ConfigError(f"job.dump_folder = {url!r}: {why}")
    return DumpMirror(url, mirror_folder(url), job.job.dump_sync_interval_s)
