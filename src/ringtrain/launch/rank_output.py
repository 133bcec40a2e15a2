"""The ranks' output as the launcher relays it: to its own stdout/stderr and, optionally, files.

Agents stream each rank's lines; :class:`RankOutput` writes them to the launcher's stdout or
stderr (prefixed ``[rank]``, unless ``--no-prefix``) and, with ``--output-filename DIR``, to
``DIR/rank.<rank>/stdout|stderr`` as horovodrun lays them out. With
``--prefix-output-with-timestamp`` every line, in the files too, starts with the time the
launcher received it (:func:`stamp`). A reader that went away (a closed pipe) does not end the
job.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import IO

from ringtrain.errors import LaunchError
from ringtrain.launch.options import LaunchOptions

# Starts the stdout line that carries a rank's return value for ringtrain.run (base64 of its
# cloudpickle): a record separator, which no one prints by chance, then a name.
RESULT_PREFIX = "\x1eringtrain-result:"


def stamp(now: float | None = None) -> str:
    """``now`` (default: the current time) as the launcher's local time, to the millisecond,
    and a space: ``2026-12-03 12:05:16.123 ``. Sorts as text within a day and a time zone."""
    now = time.time() if now is None else now
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d} "


class RankOutput:
    """Relays the ranks' lines; :meth:`close` closes the files it opened."""

    def __init__(
        self,
        options: LaunchOptions,
        out: IO[str],
        err: IO[str],
        on_result: Callable[[int, str], None] | None = None,
    ) -> None:
        self.options = options
        self.out = out
        self.err = err
        self.files: dict[tuple[int, int], IO[str]] = {}
        # ringtrain.run: a rank's return value arrives as one marked stdout line (run_func.py).
        self.on_result = on_result
        # The (rank, fd) whose last text ended with "\r" (a progress bar redrawn in place) and
        # the stream it went to: the next line from anyone else must not start over it.
        self._bar: tuple[tuple[int, int], IO[str]] | None = None

    def print_line(
        self, rank: int, fd: int, line: str, end: str, received_at: float | None = None
    ) -> None:
        """``received_at``: when the line reached the launcher (its timestamp), else now."""
        if self.on_result is not None and fd == 1 and line.startswith(RESULT_PREFIX):
            self.on_result(rank, line[len(RESULT_PREFIX) :])
            return
        when = stamp(received_at) if self.options.timestamp_output else ""
        if self.options.output_dir:
            self.file(rank, fd).write(when + line + end)
        stream = self.out if fd == 1 else self.err
        text = f"{when}[{rank}] {line}" if self.options.prefix_output else when + line
        self.end_bar((rank, fd))
        with contextlib.suppress(BrokenPipeError, ValueError):
            stream.write(text + end)
            stream.flush()
        self._bar = ((rank, fd), stream) if end == "\r" else None

    def end_bar(self, source: tuple[int, int] | None = None) -> None:
        """End the line of a progress bar left open by another ``source`` (rank, fd) than the
        one writing next, or before the launcher's own message: written after the bar's "\r",
        a line would overwrite the bar and show its tail after it. The bar's last state stays
        on its line; its next redraw starts below."""
        if self._bar is None or self._bar[0] == source:
            return
        stream, self._bar = self._bar[1], None
        with contextlib.suppress(BrokenPipeError, ValueError):
            stream.write("\n")
            stream.flush()

    def started(self, rank: int) -> None:
        """With --output-filename, ``rank``'s two files exist from its start, empty, as
        horovodrun opens them: one that prints nothing has none missing, nor an earlier job's."""
        if self.options.output_dir:
            self.file(rank, 1)
            self.file(rank, 2)

    def file(self, rank: int, fd: int) -> IO[str]:
        """--output-filename DIR: DIR/rank.<rank>/stdout|stderr, as horovodrun lays them out
        (ranks zero-padded to the width of the largest, so they sort in order)."""
        f = self.files.get((rank, fd))
        if f is None:
            assert self.options.output_dir is not None
            width = len(str(self.options.np - 1))
            folder = os.path.join(self.options.output_dir, f"rank.{rank:0{width}d}")
            try:
                os.makedirs(folder, exist_ok=True)
                f = open(  # noqa: SIM115 (closed when the job ends)
                    os.path.join(folder, "stdout" if fd == 1 else "stderr"),
                    "w",
                    buffering=1,
                )
            except OSError as e:
                raise LaunchError(f"--output-filename: cannot write {folder}: {e}") from None
            self.files[(rank, fd)] = f
        return f

    def close(self) -> None:
        for f in self.files.values():
            f.close()
