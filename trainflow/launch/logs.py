"""Rank output for the caller: every rank's log file followed line by line."""

import math
import os
import time
from pathlib import Path

from trainflow.launch.run_dir import RunDir
from trainflow.launch.spec import LineSink

# A progress bar redrawn in place is passed on at most this often per rank.
PROGRESS_EVERY_S = 2.0
# The run folder is listed for new rank logs (ranks starting, a restart) at most this often.
LIST_EVERY_S = 1.0


def print_line(rank: int, line: str) -> None:
    print(f"[rank {rank}] {line}", flush=True)


class LogTail:
    """Follows the per-rank log files and hands out complete lines.

    A poll costs the caller a `stat` per rank log when nothing was written (the folder is
    listed again every `LIST_EVERY_S`, and on the final poll): the caller polls several times
    a second on the cores the ranks train on.
    """

    def __init__(self, rd: RunDir, sink: LineSink):
        self.rd = rd
        self.sink = sink
        self.offsets: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}
        self.progress_at: dict[int, float] = {}
        self._files: dict[int, Path] = {}
        self._listed_at = -math.inf

    def _log_files(self, final: bool) -> dict[int, Path]:
        now = time.monotonic()
        if final or now - self._listed_at >= LIST_EVERY_S:
            self._files, self._listed_at = self.rd.log_files(), now
        return self._files

    def poll(self, final: bool = False) -> bool:
        """Hand out the lines written since the last poll; whether anything was written."""
        written = False
        for rank, path in self._log_files(final).items():
            offset = self.offsets.get(rank, 0)
            try:
                if os.stat(path).st_size == offset and not final:
                    continue
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            written = written or bool(chunk)
            if not chunk and not (final and self.partial.get(rank)):
                continue
            self.offsets[rank] = offset + len(chunk)
            data = self.partial.pop(rank, b"") + chunk
            *lines, rest = data.split(b"\n")
            if final and rest:
                lines.append(rest)
                rest = b""
            for line in lines:
                # A progress bar redrawn in place (tqdm) ends as one line: its final state.
                last = next((p for p in reversed(line.split(b"\r")) if p.strip()), b"")
                self.sink(rank, last.decode("utf-8", errors="replace"))
            if rest:
                rest = self._progress(rank, rest)
                if rest:
                    self.partial[rank] = rest
        return written

    def _progress(self, rank: int, rest: bytes) -> bytes:
        """Pass on a progress bar's newest complete redraw, at most every `PROGRESS_EVERY_S`.

        Bars redraw with a carriage return and no newline until they finish, so unhandled
        they would arrive as one very long line at the end. Returns what is left to follow.
        """
        if b"\r" not in rest:
            return rest
        done, _, current = rest.rpartition(b"\r")
        newest = next((p for p in reversed(done.split(b"\r")) if p.strip()), b"")
        now = time.monotonic()
        if newest and now - self.progress_at.get(rank, -math.inf) >= PROGRESS_EVERY_S:
            self.progress_at[rank] = now
            self.sink(rank, newest.decode("utf-8", errors="replace"))
        return b"\r" + current if current else b""


def tail(path: Path, num_lines: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-num_lines:])
