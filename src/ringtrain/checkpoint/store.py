"""Writing a rank's part and committing a checkpoint; opening one verified, and reading its items.

No collective here: this runs in the training process (a blocking save) or in the background
writer (:mod:`ringtrain.checkpoint.process_writer`, ``thread_writer``). Every rank writes its
data file and a part record (JSON: what it wrote where, and the file's SHA-256) into the save's
partial directory;
rank 0's writer waits for all the records of this save (by its save id; a save that lacks
the part of a rank that left the job is given up, :mod:`ringtrain.checkpoint.peers`), writes DCP's
``.metadata`` and the manifest (last, by rename), renames the directory into place, and prunes
old checkpoints of its run (never another run's). A write that fails (a full disk) is a
:class:`CheckpointError` naming the file, and the failed save's files are removed. A shared file
system is assumed (as DCP assumes) when ranks span hosts.

The other ranks learn rank 0's outcome from the same directories (:func:`verdict`): the save's
directory renamed into place with their save id in its manifest is a commit; a commit that
failed leaves rank 0's words in the save's directory, or removes that directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ringtrain.checkpoint import layout, manifest
from ringtrain.checkpoint.layout import Item, Record
from ringtrain.checkpoint.manifest import Manifest
from ringtrain.checkpoint.sealed import Keys, Sealer, open_sealed, seal
from ringtrain.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex


GIVEN_UP = "given up"  # a writer's outcome: a rank whose part the save lacks left the job


def said(e: BaseException) -> str:
    """A failed write as the writer reports it (a CheckpointError's own words, with its HINT)."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


@dataclass
class Job:
    """One save, as every rank knows it."""

    final: str  # the committed checkpoint's directory
    partial: str  # where its files are written first
    save_id: str
    rank: int
    size: int
    step: int
    keep: int  # keep-last-K under the parent directory (0: keep all)
    timeout_s: float
    facts: dict[str, object]  # layout facts for the manifest
    # The run this save belongs to (see manifest.run_of): keep-last counts only its checkpoints,
    # and a checkpoint of another run is never replaced. None: a plain save, which counts every
    # checkpoint beside it and replaces one of its own name.
    run: str | None = None


def write_part(job: Job, items: list[Item], keys: Keys | None) -> Record:
    """Write this rank's data file and part record into the save's partial directory. A write
    that fails (a full disk) is a :class:`CheckpointError` naming the file; this rank's files of
    the save are removed, so the space they took is free again and earlier checkpoints stay."""
    refuse_foreign(job.final, job.step)  # before a byte is written: every rank tells the same
    name = layout.data_file(job.rank)
    data = os.path.join(job.partial, name)
    tmp = os.path.join(job.partial, layout.part_file(job.rank) + ".tmp")
    try:
        os.makedirs(job.partial, exist_ok=True)
        sealer = Sealer(keys.files, name) if keys is not None else None
        digest, nbytes, entries = layout.write_part_file(data, items, sealer)
        record = Record(job.rank, name, digest, nbytes, entries)
        with layout.open_for_writing(tmp) as f:
            f.write(json.dumps({"save_id": job.save_id, "record": asdict(record)}).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(job.partial, layout.part_file(job.rank)))
    except OSError as e:
        for path in (data, tmp):
            with contextlib.suppress(OSError):
                os.remove(path)
        raise unwritable(e, job.final) from e
    return record


def unwritable(e: OSError, final: str) -> CheckpointError:
    """A failed write, as an error that names the file, the cause (a full disk says "no space
    left on device", errno ENOSPC) and what to do."""
    path = e.filename or final
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    if e.errno == errno.ENOSPC:
        hint = (
            "free space there, or save to a file system with room for a whole checkpoint; "
            "earlier checkpoints are untouched."
        )
        cause = "no space left on device"
    else:
        hint = "check the directory's permissions and space; earlier checkpoints are untouched."
        cause = (e.strerror or str(e)).lower()
    return CheckpointError(
        f"could not write {path} (saving {final}): {cause} ({code}).\nHINT: {hint}"
    )


class SaveGivenUp(CheckpointError):
    """A save that cannot commit: a rank whose part it lacks left the job. Not a failed write:
    the departure is the failure, reported where it happened; the save stays uncommitted."""


def _records(job: Job) -> list[Record]:
    """Every rank's part record of this save (rank 0's writer waits for them), until a rank
    whose part is missing is noted to have left (:mod:`ringtrain.checkpoint.peers`)."""
    deadline = time.monotonic() + job.timeout_s
    found: dict[int, Record] = {}
    pause = 0.02
    while True:
        # Read before the parts: a part written before its rank left is found below.
        left = _left(job, [r for r in range(job.size) if r not in found])
        for r in range(job.size):
            if r in found:
                continue
            path = os.path.join(job.partial, layout.part_file(r))
            try:
                with open(path) as f:
                    got = json.load(f)
            except (FileNotFoundError, ValueError):
                continue
            if got.get("save_id") == job.save_id:
                rec = got["record"]
                rec["entries"] = [tuple(e) for e in rec["entries"]]
                found[r] = Record(**rec)
        if len(found) == job.size:
            return [found[r] for r in range(job.size)]
        lacking = {r: why for r, why in left.items() if r not in found}
        if lacking:
            ranks = ", ".join(map(str, lacking))
            who = f"ranks {ranks} left the job before writing their parts"
            if len(lacking) == 1:
                who = f"rank {ranks} left the job before writing its part"
            raise SaveGivenUp(
                f"gave up the save into {job.final}: {who} ({'; '.join(lacking.values())}). "
                f"It stays uncommitted in {job.partial}, as after a crash; earlier checkpoints "
                "are untouched."
            )
        if time.monotonic() > deadline:
            missing = sorted(set(range(job.size)) - set(found))
            raise CheckpointError(
                f"the save into {job.final} did not complete: ranks {missing} wrote no part "
                f"into {job.partial} within {job.timeout_s:g} s.\nHINT: those ranks failed or "
                "cannot reach this directory (ranks on several hosts need a shared file system)."
            )
        time.sleep(pause)
        pause = min(0.25, pause * 1.5)  # ranks still writing: poll less, wake training less


def _left(job: Job, ranks: list[int]) -> dict[int, str]:
    """The notes of ``ranks`` that left the job, left in the save's directory by rank 0."""
    notes = {}
    for r in ranks:
        path = os.path.join(job.partial, layout.left_file(r))
        with contextlib.suppress(OSError), open(path) as f:
            notes[r] = f.read().strip() or f"rank {r} left the job"
    return notes


def commit(job: Job, keys: Keys | None) -> None:
    """Rank 0's writer: metadata, manifest (last), rename into place, prune. A commit that fails
    leaves its words for the other ranks (:func:`verdict`) where the save's directory stays."""
    try:
        _commit(job, keys)
    except BaseException as e:
        _tell(job, GIVEN_UP if isinstance(e, SaveGivenUp) else "error", said(e))
        raise


def _tell(job: Job, status: str, message: str) -> None:
    path = os.path.join(job.partial, layout.VERDICT_FILE)
    with contextlib.suppress(OSError):  # removed with its files: verdict() tells that apart
        with open(path + ".tmp", "w") as f:
            f.write(f"{status}\n{message}")
        os.replace(path + ".tmp", path)


def verdict(job: Job) -> tuple[str, str] | None:
    """Rank 0's outcome of ``job`` as a rank other than 0 finds it once its own part is written:
    ``("ok", final)``, ``(GIVEN_UP, why)`` or ``("error", why)``; None while rank 0 is at it.
    (A later save of this rank cannot commit before it writes its part, so the committed
    directory is not yet pruned or replaced when this looks.)"""
    try:
        with open(os.path.join(job.partial, layout.VERDICT_FILE)) as f:
            status, _, message = f.read().partition("\n")
        return status, message
    except OSError:
        pass
    if os.path.isdir(job.partial):
        return None
    try:  # renamed into place, or removed with the failure
        with open(os.path.join(job.final, manifest.MANIFEST)) as f:
            ours = json.load(f).get("save_id") == job.save_id
    except (OSError, ValueError, AttributeError):
        ours = False
    if ours:
        return "ok", job.final
    return "error", (
        f"rank 0 did not commit the save into {job.final}: its commit failed and removed the "
        "save's files.\nHINT: rank 0 raises its error, which says why; earlier checkpoints are "
        "untouched."
    )


def _commit(job: Job, keys: Keys | None) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import StorageMeta

    import ringtrain

    records = _records(job)
    md = layout.build_metadata(records)
    md.storage_meta = StorageMeta(checkpoint_id=job.final, save_id=job.save_id)
    data = layout.metadata_bytes(md)
    if keys is not None:
        data = seal(keys.files, layout.METADATA_FILE, data)
    files = {rec.file: {"sha256": rec.sha256, "bytes": rec.nbytes} for rec in records}
    try:
        files[layout.METADATA_FILE] = {
            "sha256": layout.write_file(os.path.join(job.partial, layout.METADATA_FILE), data),
            "bytes": len(data),
        }
        for r in range(job.size):
            os.remove(os.path.join(job.partial, layout.part_file(r)))
            with contextlib.suppress(FileNotFoundError):  # its part came in the end
                os.remove(os.path.join(job.partial, layout.left_file(r)))
        contents = {
            "format": manifest.FORMAT,
            "format_version": manifest.FORMAT_VERSION,
            "save_id": job.save_id,
            "step": job.step,
            "world_size": job.size,
            "layout": job.facts,
            "versions": {"ringtrain": ringtrain.__version__, "torch": torch.__version__},
            "dcp_version": layout.DCP_VERSION,
            "sealed": keys is not None,
            "created_unix": time.time(),
            "files": files,
        }
        if job.run is not None:
            contents["run"] = job.run
        manifest.write(job.partial, contents, keys.manifest if keys is not None else None)
    except OSError as e:
        # Nothing will use this save's files: free their space for the next save.
        shutil.rmtree(job.partial, ignore_errors=True)
        if e.filename is None:  # the manifest's json.dump says no more than the errno
            e = OSError(e.errno, e.strerror, os.path.join(job.partial, manifest.MANIFEST))
        raise unwritable(e, job.final) from e
    place(job)


def refuse_foreign(final: str, step: int = 0) -> None:
    """Raise :class:`CheckpointError` if ``final`` holds something a save must not replace.

    A save replaces the directory at its path whole (the older checkpoint of that name goes),
    so only a checkpoint or an empty directory may be there: anything else (a directory of the
    user's files, the current directory, a root of ``step-N`` checkpoints, a file, a link)
    would be deleted with it."""
    if not os.path.lexists(final):
        return
    if os.path.islink(final) or not os.path.isdir(final):
        what = "a link" if os.path.islink(final) else "a file"
    elif os.path.isfile(os.path.join(final, manifest.MANIFEST)) or not os.listdir(final):
        return
    elif manifest.committed(final):
        what = "a directory of step-N checkpoints"
    else:
        what = "a directory of other files, not a checkpoint"
    hint = (
        "give each save a directory of its own, as ringtrain.checkpoint.Checkpointer(root) "
        f"does (root/step-N), e.g. {os.path.join(final, manifest.step_name(step))}"
        if what.startswith("a directory")
        else "give the save the path of a new or empty directory"
    )
    raise CheckpointError(
        f"{final} is {what}: a save replaces the directory at its path whole, so it would be "
        f"deleted. It was left as it was, and nothing was saved.\nHINT: {hint}."
    )


def place(job: Job) -> None:
    """Rename the finished directory into place; an older one of the same name goes after,
    unless it belongs to another run (then the save fails and the older one stays), or what
    is there is not a checkpoint (:func:`refuse_foreign`: the save fails and it stays)."""
    parent = os.path.dirname(os.path.abspath(job.final)) or "."
    old = None
    try:
        refuse_foreign(
            job.final, job.step
        )  # again: something may have been put there while writing
    except CheckpointError:
        shutil.rmtree(job.partial, ignore_errors=True)
        raise
    if os.path.exists(job.final):
        theirs = manifest.run_of(job.final)
        if job.run is not None and theirs != job.run:
            shutil.rmtree(job.partial, ignore_errors=True)
            raise CheckpointError(
                f"{job.final} already holds a checkpoint of another run "
                f"({theirs or 'no run recorded'}; this run is {job.run}): it was left as it "
                "was, and this save was dropped.\nHINT: give each new run a fresh checkpoint "
                "directory, or continue that run with --resume."
            )
        old = f"{job.final}.old-{job.save_id}"
        os.replace(job.final, old)
    os.replace(job.partial, job.final)
    manifest.fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    base = os.path.basename(job.final)
    for name in os.listdir(parent):  # saves of this name, or of steps, that never finished
        stale = ".partial-" in name and name.startswith((f".{base}.", ".step-"))
        if stale and not _later(name.split(".partial-", 1)[1], job.save_id):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    if job.keep > 0:
        manifest.prune(parent, job.keep, run=job.run)


def _later(save_id: str, than: str) -> bool:
    """Whether ``save_id`` is a later save of the same series as ``than`` (``<prefix>-<count>``,
    see :class:`ringtrain.checkpoint.Checkpointer`): other ranks may be writing it already."""
    prefix, _, count = than.rpartition("-")
    other, _, later = save_id.rpartition("-")
    return (
        bool(prefix)
        and other == prefix
        and count.isdigit()
        and later.isdigit()
        and (int(later) > int(count))
    )


@dataclass
class Opened:
    directory: str
    manifest: Manifest
    metadata: Metadata
    plain: dict[str, bytes]  # sealed: data file name -> plaintext (GCM opens a file whole)

    def read(self, name: str, offset: int, length: int) -> bytes | memoryview:
        """``length`` bytes of data file ``name`` from ``offset``. An unsealed file is read an
        item at a time, so no rank holds a whole file (the host's page cache serves its ranks)."""
        if self.manifest["sealed"]:
            return memoryview(self.plain[name])[offset : offset + length]
        path = os.path.join(self.directory, name)
        with open(path, "rb") as f:
            f.seek(offset)
            got = f.read(length)
        if len(got) != length:
            raise CheckpointError(
                f"{path} ends before byte {offset + length}, which the metadata points to: the "
                "file changed while it was loaded.\nHINT: load an earlier checkpoint."
            )
        return got


def open_checkpoint(path: str, keys: Keys | None, share: tuple[int, int] = (0, 1)) -> Opened:
    """Resolve ``path``, check the manifest (and its MAC), and verify the files (size,
    SHA-256; sealed: open it). Nothing is returned unless all of it is whole.

    ``share`` is ``(i, n)``: this process hashes every n-th data file from the i-th, and checks
    the others' sizes; the ranks of a host, each given its local rank and the host's rank
    count, hash every file once between them and agree on the outcome before using any
    (``api.load``). Small files (``.metadata``) and sealed ones (authenticated whole, and held
    for reading) are opened by every process. A damaged ``step-N`` checkpoint's error names
    the earlier ones beside it, and how to resume from one."""
    directory = manifest.resolve(path)
    try:
        return _open_verified(directory, keys, share)
    except CheckpointError as e:
        earlier = manifest.earlier_than(directory)
        if not earlier:
            raise
        raise CheckpointError(f"{e}\n{earlier}") from e


def _open_verified(directory: str, keys: Keys | None, share: tuple[int, int]) -> Opened:
    man = manifest.read(directory, secure=keys is not None)
    manifest.check_mac(directory, man, keys.manifest if keys is not None else None)
    if layout.METADATA_FILE not in man["files"]:
        raise CheckpointError(
            f"{directory}: its manifest lists no {layout.METADATA_FILE}: the checkpoint is "
            "damaged.\nHINT: load an earlier checkpoint."
        )
    meta_blob = _opened_whole(directory, layout.METADATA_FILE, man, keys)
    mine, every = share
    whole: dict[str, bytes] = {}
    data_names = sorted(n for n in man["files"] if n != layout.METADATA_FILE)
    for i, name in enumerate(data_names):
        if man["sealed"]:
            whole[name] = _opened_whole(directory, name, man, keys)
        else:
            manifest.check_file(directory, name, man["files"][name], hashed=i % every == mine)
    listed = {n for n in os.listdir(directory) if n.endswith(".distcp")}
    extra = listed - set(man["files"])
    if extra:
        raise CheckpointError(
            f"{directory} holds {sorted(extra)}, which its manifest does not list: files of "
            "another checkpoint or job were mixed in.\nHINT: load an earlier checkpoint."
        )
    return Opened(directory, man, _metadata(directory, man, meta_blob), whole)


def _opened_whole(directory: str, name: str, man: Manifest, keys: Keys | None) -> bytes:
    """A file read whole and checked (sealed: its plaintext, authenticated)."""
    full = os.path.join(directory, name)
    try:
        with open(full, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise manifest.missing(full) from None
    sealed = bool(man["sealed"])
    manifest.check_file(directory, name, man["files"][name], blob, sealed=sealed)
    return open_sealed(keys.files, name, full, blob) if sealed and keys else blob


def _metadata(directory: str, man: Manifest, blob: bytes) -> Metadata:
    """DCP's metadata, checked to belong to the manifest's save."""
    metadata: Metadata = pickle.loads(blob)
    saved = getattr(metadata.storage_meta, "save_id", None)
    if saved != man["save_id"]:
        raise CheckpointError(
            f"{os.path.join(directory, layout.METADATA_FILE)} belongs to another save "
            f"({saved!r}, the manifest says {man['save_id']!r}).\n"
            "HINT: load an earlier checkpoint."
        )
    return metadata


def reader(opened: Opened) -> Callable[[MetadataIndex], object]:
    """``read(MetadataIndex)``: one stored item."""

    def read(index: MetadataIndex) -> object:
        info = opened.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(
                f"{opened.directory}: {index.fqn} has no stored bytes in the metadata.\n"
                "HINT: the checkpoint is damaged; load an earlier one."
            )
        name = info.relative_path
        if name == layout.METADATA_FILE or name not in opened.manifest["files"]:
            raise CheckpointError(
                f"{os.path.join(opened.directory, name)} is not in the manifest, "
                "but the metadata points into it.\nHINT: load an earlier checkpoint."
            )
        data = opened.read(name, info.offset, info.length)
        try:
            return layout.load_item(data, 0, info.length)
        except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
            # Verified when opened: an unsealed file changed since (it is read an item at a
            # time); a sealed one is held as authenticated, so it was saved so.
            why = (
                "its file is authenticated, so it was saved damaged"
                if opened.manifest["sealed"]
                else "the file changed while it was loaded"
            )
            raise CheckpointError(
                f"{os.path.join(opened.directory, name)}: {index.fqn} cannot be read ({e}): "
                f"{why}.\nHINT: load an earlier checkpoint."
            ) from e

    return read
