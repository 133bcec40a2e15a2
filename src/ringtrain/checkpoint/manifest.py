"""The manifest: what a checkpoint holds, written last, committed by rename, checked before use.

A checkpoint directory is complete when ``manifest.json`` is in it. The committing writer
writes it only after every rank's part and DCP's ``.metadata`` are on disk (fsynced), as
``manifest.json.tmp`` and then ``os.replace`` (atomic on POSIX), and only then renames the
directory from ``.<name>.partial`` to ``<name>``. So a crash at any moment leaves either the
previous checkpoints untouched and a ``.partial`` directory that nothing loads, or a complete one.

:func:`verify` checks the whole checkpoint before anything is loaded: every file listed is
present with its size and SHA-256, and (sealed) the manifest's MAC. Errors name the file.
This module imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import TypedDict

from ringtrain.errors import CheckpointError, SecurityError

MANIFEST = "manifest.json"
FORMAT = "ringtrain-checkpoint"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d+)$")


class FileEntry(TypedDict):
    """A data file's size and SHA-256, as the manifest lists it."""

    sha256: str
    bytes: int


class Manifest(TypedDict, total=False):
    """``manifest.json`` as :func:`ringtrain.checkpoint.store.commit` writes it (read back from
    disk, any key may be missing: :func:`read` checks the format)."""

    format: str
    format_version: int
    save_id: str
    step: int
    world_size: int
    layout: dict[str, object]  # the cut: optimizer kind, compressor, sync_every
    versions: dict[str, str]
    dcp_version: str
    sealed: bool
    created_unix: float
    files: dict[str, FileEntry]
    run: str  # the run the checkpoint belongs to (absent in files written before runs)
    mac: str  # sealed: the HMAC over the rest


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def partial_name(name: str) -> str:
    return f".{name}.partial"


def canonical(manifest: Mapping[str, object]) -> bytes:
    """The bytes a sealed manifest's MAC covers: everything but the MAC itself."""
    body = {k: v for k, v in manifest.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write(directory: str, manifest: Mapping[str, object], mac_key: bytes | None = None) -> None:
    """Write ``manifest`` into ``directory`` atomically (temp file, fsync, rename, dir fsync)."""
    manifest = dict(manifest)
    if mac_key is not None:
        manifest["mac"] = hmac.new(mac_key, canonical(manifest), hashlib.sha256).hexdigest()
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(directory: str, secure: bool = False) -> Manifest:
    """The manifest; in secure mode an unreadable one is a :class:`SecurityError` (it cannot be
    authenticated)."""
    path = os.path.join(directory, MANIFEST)
    error = SecurityError if secure else CheckpointError
    try:
        with open(path) as f:
            manifest: Manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: {directory} is not a complete checkpoint (its save did not "
            "finish, or this is not a checkpoint directory).\nHINT: load the directory that "
            "holds the checkpoints (the newest complete one is chosen), or an earlier step."
        ) from None
    except (OSError, ValueError) as e:
        raise error(
            f"{path} cannot be read as a checkpoint manifest ({e}).\n"
            "HINT: the file is damaged; load an earlier checkpoint."
        ) from None
    if not isinstance(manifest, dict):
        raise error(
            f"{path} cannot be read as a checkpoint manifest (it holds a JSON "
            f"{type(manifest).__name__}, not an object).\nHINT: the file is damaged; load an "
            "earlier checkpoint."
        )
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise error(
            f"{path} is not a {FORMAT} v{FORMAT_VERSION} manifest (format "
            f"{manifest.get('format')!r}, version {manifest.get('format_version')!r}).\n"
            "HINT: load it with the ringtrain version that wrote it."
        )
    return manifest


def check_mac(directory: str, manifest: Manifest, mac_key: bytes | None) -> None:
    path = os.path.join(directory, MANIFEST)
    if not manifest.get("sealed"):
        if mac_key is not None:
            raise SecurityError(
                f"{path} describes an unsealed checkpoint, but this job runs in secure mode.\n"
                "HINT: secure jobs load only sealed checkpoints; load it outside secure mode."
            )
        return
    if mac_key is None:
        raise SecurityError(
            f"{path} describes a sealed checkpoint and this job has no key to open it.\n"
            "HINT: load it in secure mode with the job key it was saved under "
            "(RINGTRAIN_KEY_FILE)."
        )
    want = hmac.new(mac_key, canonical(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, str(manifest.get("mac", ""))):
        raise SecurityError(
            f"{path} failed authentication: it was changed, or sealed under another key.\n"
            "HINT: load it with the job key it was saved under; otherwise it cannot be trusted."
        )


def sha256_file(path: str) -> tuple[str, int]:
    """A file's SHA-256 and size, read through one reused 1 MiB buffer."""
    h = hashlib.sha256()
    n = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            h.update(view[:got])
            n += got
    return h.hexdigest(), n


def missing(path: str) -> CheckpointError:
    """The error for a file the manifest lists that is not there."""
    return CheckpointError(
        f"{path} is missing: the checkpoint is incomplete (a shard was lost or deleted).\n"
        "HINT: load an earlier checkpoint."
    )


def check_file(
    directory: str,
    name: str,
    entry: FileEntry,
    data: bytes | None = None,
    sealed: bool = False,
    hashed: bool = True,
) -> None:
    """Raise :class:`CheckpointError` naming ``name`` unless it has the manifest's size and
    hash; a :class:`SecurityError` for a sealed checkpoint (whose manifest was authenticated).
    ``hashed=False`` checks the size only (the file is hashed elsewhere: another rank's share)."""
    error = SecurityError if sealed else CheckpointError
    path = os.path.join(directory, name)
    digest: str | None
    if data is None:
        try:
            digest, size = sha256_file(path) if hashed else (None, os.path.getsize(path))
        except FileNotFoundError:
            raise missing(path) from None
    else:
        digest, size = hashlib.sha256(data).hexdigest(), len(data)
    if size != entry["bytes"]:
        raise error(
            f"{path} has {size} bytes, the manifest says {entry['bytes']}: the file is "
            "truncated or was replaced.\nHINT: load an earlier checkpoint."
        )
    if digest is not None and digest != entry["sha256"]:
        raise error(
            f"{path} does not match its SHA-256 in the manifest: the file is corrupted, or "
            "belongs to another checkpoint or job.\nHINT: load an earlier checkpoint."
        )


def committed(root: str) -> list[tuple[int, str]]:
    """``(step, directory)`` of every committed checkpoint under ``root``, oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def resolve(path: str) -> str:
    """A checkpoint directory: ``path`` itself, or the newest committed one under it."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if os.path.isfile(path):  # a file of one (its manifest, a part), or a torch.save file
        raise CheckpointError(
            f"{path} is a file, not a checkpoint: a checkpoint is the directory a save wrote.\n"
            f"HINT: give {os.path.dirname(os.path.abspath(path))} if this file is in one, or "
            "the directory above the step-N ones for the newest."
        )
    found = committed(path)
    if found:
        return found[-1][1]
    if not os.path.isdir(path):
        raise CheckpointError(
            f"no checkpoint at {path}: the directory does not exist.\n"
            "HINT: give the directory a save wrote to (or --checkpoint-dir's)."
        )
    raise CheckpointError(
        f"{path} holds no complete checkpoint ({MANIFEST} missing, and no step-N directory "
        "with one).\nHINT: a save may have been interrupted; load an earlier checkpoint."
    )


def save_root(path: str) -> str:
    """Where a job resumed from ``path`` keeps saving: the root a ``step-N`` checkpoint lies
    in (else its later saves would nest inside the step), or ``path`` itself."""
    path = os.path.normpath(path)
    if STEP_DIR.match(os.path.basename(path)) and os.path.isfile(os.path.join(path, MANIFEST)):
        return os.path.dirname(os.path.abspath(path))
    return path


def earlier_than(directory: str) -> str:
    """For a damaged ``step-N`` checkpoint: the committed ones of earlier steps beside it (the
    newest three) and how to resume from one; "" when there are none."""
    m = STEP_DIR.match(os.path.basename(os.path.normpath(directory)))
    if m is None:
        return ""
    root = os.path.dirname(os.path.abspath(directory))
    found = [(s, p) for s, p in committed(root) if s < int(m.group(1))][-3:]
    if not found:
        return ""
    listed = ", ".join(f"step {s} ({p})" for s, p in reversed(found))
    return (
        f"Earlier checkpoints beside it: {listed}. Load one by its directory; to resume a job "
        f"from it: ringtrain run --resume {found[-1][1]} (it keeps saving into {root})."
    )


def run_of(directory: str) -> str:
    """The run a committed checkpoint belongs to: the id its manifest records ("" when it
    records none: a plain :func:`ringtrain.checkpoint.save`, or a checkpoint written before
    runs were recorded; also when the manifest cannot be read)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            run = json.load(f).get("run")
    except (OSError, ValueError, AttributeError):
        return ""
    return run if isinstance(run, str) else ""


def of_other_runs(root: str, run: str | None) -> list[tuple[int, str]]:
    """``(step, directory)`` of the committed checkpoints under ``root`` that belong to a run
    other than ``run`` (None: a run that has saved nothing yet, so every one), oldest first."""
    return [(s, path) for s, path in committed(root) if run is None or run_of(path) != run]


def prune(
    root: str, keep: int, remove: Callable[[str], None] = shutil.rmtree, run: str | None = None
) -> list[str]:
    """Remove all but the newest ``keep`` committed checkpoints of ``run`` (None: of every
    run, as a plain ``save(..., keep=K)`` does). Another run's checkpoints are never counted
    or removed: a new job in a used directory must not delete them, nor its own for them."""
    if keep <= 0:
        return []
    mine = [(s, path) for s, path in committed(root) if run is None or run_of(path) == run]
    gone = []
    for _, path in mine[:-keep]:
        remove(path)
        gone.append(path)
    return gone
