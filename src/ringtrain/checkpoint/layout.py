"""Bytes on disk in torch.distributed.checkpoint's (DCP's) storage layout, without its collectives.

A rank's part is one ``__<rank>_0.distcp`` file: its items one after another, each a
``torch.save`` of a tensor or of a Python object, exactly as DCP's ``FileSystemWriter`` writes
them, so ``FileSystemReader``/``dcp.load``/``dcp_to_torch_save`` read an unsealed checkpoint.
The ``.metadata`` file is DCP's pickled :class:`Metadata`: for every key, its global size and
the chunks (offsets and sizes) every rank wrote, and where each chunk's bytes lie.

What differs from ``dcp.save``: the plan is computed locally on every rank (the cut is a pure
function of the job: :mod:`ringtrain.checkpoint.parts`), so the writing needs no collective and
can run in a background process; each rank records what it wrote in a small part record, and
the committing writer merges them into ``.metadata``. Sealed files (secure mode) wrap each whole
file in AES-GCM and are not readable by torch's tools (:mod:`ringtrain.checkpoint.sealed`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

DCP_VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION for the FileSystemWriter format we write
METADATA_FILE = ".metadata"


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def part_file(rank: int) -> str:
    return f"part-{rank}.pkl"


def left_file(rank: int) -> str:
    """A note that ``rank`` left the job, for the committing writer (see checkpoint.peers)."""
    return f"left-{rank}.txt"


# Rank 0's word on a save it did not commit, for the other ranks (see store.verdict).
VERDICT_FILE = "not-committed.txt"


@dataclass
class Item:
    """One entry of a rank's part: a tensor chunk or a Python object (``value`` is bytes-able)."""

    fqn: str
    value: Any  # a CPU tensor (a chunk) or any picklable object
    size: tuple[int, ...] | None = None  # a tensor's global size; None for an object
    offset: tuple[int, ...] | None = None  # the chunk's offset in the global tensor


# fqn, offset (None: an object), global size, dtype name, chunk size, file offset, length
Shape = tuple[int, ...]
Entry = tuple[str, Shape | None, Shape | None, str, Shape | None, int, int]


@dataclass
class Record:
    """What one rank wrote: per item, where its bytes lie; and its file's SHA-256."""

    rank: int
    file: str
    sha256: str
    nbytes: int
    entries: list[Entry] = field(default_factory=list)


class Transform(Protocol):
    """What a file's bytes pass through on their way to disk (sealing: header, body, tag)."""

    def begin(self) -> bytes: ...

    def update(self, data: memoryview) -> bytes: ...

    def end(self) -> bytes: ...


class _Sink:
    """A part file being written: what passes is transformed (sealed) if asked, hashed
    (SHA-256) and written, a chunk at a time, so each chunk is hashed while still in cache and
    no copy of the whole file is ever held in memory. ``tell()`` counts the plaintext."""

    CHUNK = 1 << 20

    def __init__(self, f: BinaryIO, transform: Transform | None) -> None:
        self._f = f
        self._transform = transform
        self._hash = hashlib.sha256()
        self._pos = 0
        self.nbytes = 0
        self.error: OSError | None = None  # the write that failed, if one did
        if transform is not None:
            self._out(memoryview(transform.begin()))

    def _out(self, data: memoryview | bytes) -> None:
        self._hash.update(data)
        try:
            self._f.write(data)
        except OSError as e:
            # torch.save reports a failed write as its own "unexpected pos N vs M", which says
            # nothing of the cause: keep the OSError (a full disk: ENOSPC) to raise instead.
            self.error = e
            raise
        self.nbytes += len(data)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self.CHUNK):
            chunk = view[i : i + self.CHUNK]
            self._out(chunk if self._transform is None else self._transform.update(chunk))
        self._pos += len(view)
        return len(view)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:  # torch.save flushes after each item; durability comes at close
        pass

    def finish(self) -> str:
        if self._transform is not None:
            self._out(self._transform.end())
        return self._hash.hexdigest()


def serialize_into(out: Any, items: list[Item]) -> list[Entry]:
    """Write the part's contents (DCP's per-item ``torch.save``) to ``out`` (``write`` and
    ``tell``); returns each item's entry."""
    entries: list[Entry] = []
    for it in items:
        start = out.tell()
        if it.size is not None:  # a chunk of a tensor (a tensor given as an object has no size)
            t = it.value
            torch.save(t if t.is_contiguous() else t.contiguous(), out)
            dtype = str(t.dtype).replace("torch.", "")
            entries.append(
                (
                    it.fqn,
                    tuple(it.offset or (0,) * t.dim()),
                    tuple(it.size),
                    dtype,
                    tuple(t.shape),
                    start,
                    out.tell() - start,
                )
            )
        else:
            torch.save(it.value, out)
            entries.append((it.fqn, None, None, "", None, start, out.tell() - start))
    return entries


def serialize(items: list[Item]) -> tuple[bytes, list[Entry]]:
    """The part's file contents in memory, and each item's entry."""
    buf = io.BytesIO()
    entries = serialize_into(buf, items)
    return buf.getvalue(), entries


@contextlib.contextmanager
def open_for_writing(path: str) -> Iterator[BinaryIO]:
    """``open(path, "wb")``, whose failures (opening, writing, flushing, closing) are an
    :class:`OSError` that names ``path``: a full disk reads ``[Errno 28] No space left on
    device: '<path>'``, not a bare errno from deep inside a write."""
    try:
        with open(path, "wb") as f:
            yield f
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, path) from e


def write_part_file(
    path: str, items: list[Item], transform: Transform | None = None
) -> tuple[str, int, list[Entry]]:
    """Write a part file durably (fsync), streaming: returns its SHA-256 (hex), its size on
    disk and each item's entry (offsets in the plaintext). A failed write (a full disk) is an
    :class:`OSError` naming ``path``, whatever torch.save made of it."""
    with open_for_writing(path) as f:
        sink = _Sink(f, transform)
        try:
            entries = serialize_into(sink, items)
        except RuntimeError as e:
            if sink.error is None:
                raise
            raise sink.error from e
        digest = sink.finish()
        f.flush()
        os.fsync(f.fileno())
    return digest, sink.nbytes, entries


def write_file(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` durably (fsync); returns its SHA-256 (hex). A failed write is
    an :class:`OSError` naming ``path``."""
    with open_for_writing(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def build_metadata(records: list[Record]) -> Metadata:
    """DCP's metadata for the parts of every rank."""
    # DCP is imported where it is used: only rank 0's writer commits (it imports DCP when it
    # starts, process_writer.preload); the other ranks' writers never spend that second of CPU.
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    planner: dict[str, tuple[str, ...]] = {}
    for rec in sorted(records, key=lambda r: r.rank):
        for fqn, offset, size, dtype, chunk, start, length in rec.entries:
            planner[fqn] = tuple(fqn.split(".", 1))
            if offset is None:
                sd_md[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _StorageInfo(rec.file, start, length)
                continue
            assert size is not None and chunk is not None  # a tensor's entry has both
            md = sd_md.get(fqn)
            if md is None:
                props = TensorProperties(dtype=getattr(torch, dtype))
                md = sd_md[fqn] = TensorStorageMetadata(props, torch.Size(size), [])
            md.chunks.append(ChunkStorageMetadata(torch.Size(offset), torch.Size(chunk)))
            storage[MetadataIndex(fqn, torch.Size(offset))] = _StorageInfo(rec.file, start, length)
    return Metadata(
        state_dict_metadata=sd_md, planner_data=planner, storage_data=storage, version=DCP_VERSION
    )


def metadata_bytes(metadata: Metadata) -> bytes:
    return pickle.dumps(metadata)


def load_item(data: bytes | memoryview, start: int, length: int) -> object:
    """One item of a part file (a tensor or an object)."""
    return torch.load(
        io.BytesIO(data[start : start + length]), map_location="cpu", weights_only=False
    )
