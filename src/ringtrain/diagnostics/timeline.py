"""The timeline: a Chrome/Perfetto trace of what each rank's gradients and collectives did.

Open the file in https://ui.perfetto.dev or chrome://tracing. Every rank writes its own file
(``trace.json`` becomes ``trace.rank0.json``, ``trace.rank1.json``, ...), so writing never needs a
collective and a crashed rank still leaves its trace behind; :func:`merge` joins them into one
file afterwards (``python -m ringtrain.diagnostics.timeline out.json trace.rank*.json``). Each
rank is one process (``pid`` = rank) and each activity a named track (a row of the trace):

* ``compute``: ``BACKWARD`` (first gradient hook to the end of the backward pass);
* ``step``: ``PLAN`` (learning the bucket order), ``SYNCHRONIZE`` (waiting for buckets) and
  ``OPTIMIZER_STEP`` (the wrapped optimizer);
* ``bucket NN``: per fusion bucket, ``FILL`` (first to last gradient ready), ``PACK`` (zeros for
  gradients this rank lacks, compression; a gradient is copied into its bucket by its own hook,
  inside ``FILL``), ``ALLREDUCE`` (in flight: launched to done) and ``UNPACK`` (decompression and
  scaling, in the bucket that ``.grad`` views);
* ``collectives set N``: negotiated collectives, ``NEGOTIATE`` (controller rounds with work) and
  ``ALLREDUCE``/``ALLGATHER``/... as they run (``... (inline)`` when the data of a small op
  came with the negotiation, see :mod:`ringtrain.collectives.inline`).

Timestamps are wall-clock microseconds (taken from a monotonic clock anchored once), so the files
of ranks on one machine line up when merged. Events are buffered and appended to the file in
batches; :func:`stop` closes the JSON. When no timeline runs, :func:`current` returns a recorder
whose methods do nothing and whose ``enabled`` is False, so instrumented code pays one attribute
read. This module is plain Python: no torch, no runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from ringtrain.config import check_path
from ringtrain.errors import ConfigError

# Events held in memory before they are appended to the file; they are also appended a second
# after the last write at the latest (at the next event, or by a timer where none comes: a rank
# stuck or waiting for a peer), so that a rank killed (SIGKILL, the OOM killer, the launcher's
# SIGTERM after a peer failed) loses about its last second of events, not all it held.
FLUSH_EVERY = 4096
FLUSH_AFTER_S = 1.0


class NullRecorder:
    """The recorder while no timeline runs: every method does nothing."""

    enabled = False

    def track(self, name: str) -> int:
        return 0

    def span(
        self, track: str, name: str, start: float, end: float, args: dict[str, Any] | None = None
    ) -> None:
        return None

    def instant(self, track: str, name: str, t: float, args: dict[str, Any] | None = None) -> None:
        return None

    def close(self) -> None:
        return None


class Recorder(NullRecorder):
    """Writes one rank's events to ``path`` as a Chrome trace (``traceEvents``).

    Times given to :meth:`span` and :meth:`instant` are ``time.perf_counter()`` seconds. Safe to
    call from any thread (completion callbacks of collectives run on communication threads).
    """

    enabled = True

    def __init__(
        self, path: str, pid: int, label: str | None = None, job: str | None = None
    ) -> None:
        self.path = path
        self.pid = pid
        # One anchor maps the monotonic clock onto wall-clock microseconds.
        self._perf0 = time.perf_counter()
        self._wall0_us = time.time_ns() / 1000.0
        self._lock = threading.Lock()
        self._tracks: dict[str, int] = {}
        self._events: list[dict[str, Any]] = []
        self._wrote_any = False
        self._flushed_at = time.monotonic()
        self._timer: threading.Timer | None = None
        self._file: IO[str] | None = _create(path)
        # The job the file is of (the trace format's otherData): the merge refuses to join jobs.
        other = f'"otherData": {json.dumps({"job": job})}, ' if job else ""
        self._file.write(f'{{"displayTimeUnit": "ms", {other}"traceEvents": [\n')
        self._events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"name": label or f"rank {pid}"},
            }
        )
        self._events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )

    def _us(self, t: float) -> float:
        return round(self._wall0_us + (t - self._perf0) * 1e6, 3)

    def track(self, name: str) -> int:
        """The thread id of track ``name``, declared in the trace on first use."""
        tid = self._tracks.get(name)
        if tid is not None:
            return tid
        with self._lock:
            tid = self._tracks.get(name)
            if tid is None:
                tid = self._tracks[name] = len(self._tracks) + 1
                meta = {"ph": "M", "pid": self.pid, "tid": tid}
                self._events.append({"name": "thread_name", **meta, "args": {"name": name}})
                self._events.append(
                    {"name": "thread_sort_index", **meta, "args": {"sort_index": tid}}
                )
        return tid

    def span(
        self, track: str, name: str, start: float, end: float, args: dict[str, Any] | None = None
    ) -> None:
        """A complete event ("X") from ``start`` to ``end`` on ``track``."""
        event: dict[str, Any] = {
            "name": name,
            "ph": "X",
            "pid": self.pid,
            "tid": self.track(track),
            "ts": self._us(start),
            "dur": round(max(0.0, end - start) * 1e6, 3),
        }
        if args:
            event["args"] = args
        self._add(event)

    def instant(self, track: str, name: str, t: float, args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {
            "name": name,
            "ph": "i",
            "s": "t",
            "pid": self.pid,
            "tid": self.track(track),
            "ts": self._us(t),
        }
        if args:
            event["args"] = args
        self._add(event)

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)
            if (
                len(self._events) >= FLUSH_EVERY
                or time.monotonic() - self._flushed_at >= FLUSH_AFTER_S
            ):
                self._flush_locked()
            elif self._timer is None and self._file is not None:
                # No next event may come (a rank that hangs): write what is held without one.
                wait = FLUSH_AFTER_S - (time.monotonic() - self._flushed_at)
                self._timer = threading.Timer(max(0.0, wait), self._flush_held)
                self._timer.name = "ringtrain-timeline-flush"
                self._timer.daemon = True
                self._timer.start()

    def _flush_held(self) -> None:
        with self._lock:
            self._timer = None
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._file is None or not self._events:
            return
        text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self._events)
        self._file.write((",\n" if self._wrote_any else "") + text)
        self._file.flush()
        self._wrote_any = True
        self._events = []
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        """Write what is buffered and close the JSON document."""
        with self._lock:
            if self._file is None:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._flush_locked()
            self._file.write("\n]}\n")
            self._file.close()
            self._file = None


def _create(path: str) -> IO[str]:
    """``path`` opened for writing, its directories made; a path that cannot be (a parent that
    is a file, no permission) is a :class:`ConfigError` naming it, not an ``OSError``."""
    label = f"timeline {path!r} (timeline_filename, --timeline-filename, start_timeline)"
    check_path(label, path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return open(path, "w", encoding="utf-8")  # closed by Recorder.close
    except OSError as e:
        raise ConfigError(
            f"{label}: cannot be written: {e.strerror}.\n"
            "HINT: give a timeline path in a directory this process can write to."
        ) from None


NULL = NullRecorder()
_current: NullRecorder = NULL
_current_lock = threading.Lock()


def current() -> NullRecorder:
    """The running recorder, or the no-op recorder (``enabled`` False) when none runs."""
    return _current


def rank_path(filename: str, rank: int) -> str:
    """Where ``rank`` writes the timeline asked for as ``filename``: ``t.json`` -> ``t.rank3.json``.
    A blank name or a directory is a :class:`ConfigError` (they would make hidden
    ``.rank0.json`` files, or files beside the directory)."""
    if not str(filename).strip() or os.path.isdir(filename) or str(filename).endswith(os.sep):
        raise ConfigError(
            f"timeline {filename!r}: give a file name, not "
            f"{'a directory' if str(filename).strip() else 'a blank one'}; each rank writes "
            "its own file beside it (t.json -> t.rank0.json).\nHINT: e.g. "
            "start_timeline('/tmp/trace.json')."
        )
    root, ext = os.path.splitext(filename)
    return f"{root}.rank{rank}{ext or '.json'}"


def start(path: str, pid: int, label: str | None = None, job: str | None = None) -> Recorder:
    """Start recording to ``path`` (replacing a running timeline, which is closed first);
    ``job`` names the job the file is of, where the launcher tells (see :func:`merge`)."""
    global _current
    recorder = Recorder(path, pid, label, job)
    with _current_lock:
        previous, _current = _current, recorder
    previous.close()
    return recorder


def stop() -> None:
    """Stop recording and close the file; does nothing when no timeline runs."""
    global _current
    with _current_lock:
        previous, _current = _current, NULL
    previous.close()


def load(path: str) -> list[dict[str, Any]]:
    """The events of a timeline file, including one whose writer died before closing it."""
    return _read(path)[0]


def _read(path: str) -> tuple[list[dict[str, Any]], str | None]:
    """A timeline file's events and the job it records (None: a file that names none)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():  # its writer was killed (SIGKILL) before its first write
        return [], None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = json.loads(text.rstrip().rstrip(",") + "\n]}")  # unterminated: a crashed writer
    if not isinstance(doc, dict):
        return list(doc), None
    job = (doc.get("otherData") or {}).get("job")
    return list(doc["traceEvents"]), str(job) if job else None


def merge(paths: Sequence[str], out: str) -> tuple[int, list[str]]:
    """Join per-rank timelines into one file (one process per rank); returns the event count
    and the files that held no event (a rank killed before its first write). Files of
    different jobs (``t.rank0.json`` of today's run beside yesterday's ``t.rank1.json``) are
    refused with a ``ValueError`` naming each job's files: their lanes would be joined as one
    job's, times days apart."""
    events: list[dict[str, Any]] = []
    empty = []
    jobs: dict[str, list[str]] = {}
    for p in paths:
        try:
            found, job = _read(p)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{p} is not a timeline file ({e!r})") from e
        events.extend(found)
        if not found:
            empty.append(p)
        if job is not None:
            jobs.setdefault(job, []).append(p)
    if len(jobs) > 1:
        found_jobs = "; ".join(f"job {j}: {', '.join(ps)}" for j, ps in jobs.items())
        raise ValueError(
            f"the files come from {len(jobs)} different jobs ({found_jobs}). Merge the files "
            "of one job at a time (each run's start_timeline or --timeline-filename files; "
            "move an older run's files away or give each run its own name)"
        )
    other = {"otherData": {"job": next(iter(jobs))}} if jobs else {}
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"displayTimeUnit": "ms", **other, "traceEvents": events}, f)
    return len(events), empty


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ringtrain.diagnostics.timeline OUT RANK_FILE...``: merge per-rank timelines."""
    parser = argparse.ArgumentParser(
        prog="python -m ringtrain.diagnostics.timeline",
        description="Merge the per-rank timeline files of a job (trace.rank0.json, ...) into "
        "one trace for https://ui.perfetto.dev or chrome://tracing.",
    )
    parser.add_argument("out", metavar="OUT", help="the merged file to write (a new name)")
    parser.add_argument("inputs", metavar="RANK_FILE", nargs="+", help="the ranks' files")
    args = parser.parse_args(argv)
    refused = _refused_output(args.out, args.inputs)
    if refused:
        parser.error(refused)  # exits 2, with the usage
    try:
        n, empty = merge(args.inputs, args.out)
    except (OSError, ValueError) as e:  # unreadable, or not a timeline
        print(
            f"{parser.prog}: error: could not merge: {e}; {args.out} was not written",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {n} events from {len(args.inputs)} file(s) to {args.out}")
    for p in empty:
        print(
            f"note: {p} held no events: its rank ended before its first write (killed, or "
            "it stopped the timeline at once); the merge has no lane for it",
            file=sys.stderr,
        )
    return 0


def _refused_output(out: str, inputs: Sequence[str]) -> str:
    """Why writing the merge to ``out`` would destroy a rank's file ("" when it would not): the
    merged file comes first, and a forgotten OUT makes the first rank's file the output."""
    if os.path.realpath(out) in {os.path.realpath(p) for p in inputs}:
        return f"OUT {out} is also one of the files to merge: give the merged file a new name"
    if os.path.exists(out) and re.search(r"\.rank\d+\.json$", out):
        return (
            f"OUT {out} is a rank's own timeline (it exists, and is named *.rankN.json), which "
            "the merge would overwrite: give the merged file first, e.g. merged.json"
        )
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
