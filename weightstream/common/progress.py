"""Progress of a long step of the ``weightstream`` command (dump, convert, bench, engine start), on stderr.

On a terminal it is a bar. Anywhere else (a pipe, a file, SLURM, CI, ``| tee``) it is plain lines such as
``dump: bucket 3/12, 4.1 s`` (the seconds since the step began): one at each change of phase, one per count at
most every ``every`` seconds, and, after ``every`` seconds without a line, the current state again, so that a
log is never quiet for long while the command works. Nothing is printed in the first ``quiet`` seconds (then
the current state is): a step that ends at once, on an error found early for instance, leaves only its own
output.

The ranks of a local job report through a file: rank 0 writes its phases and counts with
:class:`ProgressFile`, and the command, which alone prints, follows that file (:meth:`Progress.follow`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import TracebackType
from typing import IO, Any

__all__ = ["Progress", "ProgressFile"]


class Progress:
    """The progress of one step named ``name`` (the command), printed to ``stream`` (default stderr); a bar when
    ``stream`` is a terminal (or ``terminal``), plain lines otherwise. A context manager: leaving it stops the
    lines and closes the bar."""

    def __init__(self, name: str, *, stream: IO[str] | None = None, every: float = 3.0, quiet: float = 1.0,
                 terminal: bool | None = None):
        self.name, self.every, self.quiet = name, every, quiet
        self._stream = stream if stream is not None else sys.stderr
        self._terminal = self._stream.isatty() if terminal is None else terminal
        self._start = time.monotonic()
        self._last_line = self._start
        self._printed = False
        self._state = "starting"
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._follow: tuple[str, int] | None = None  # (path, bytes read so far)
        self._bar: Any = None
        self._thread = threading.Thread(target=self._watch, name=f"progress-{name}", daemon=True)
        self._thread.start()

    def phase(self, text: str) -> None:
        """A new phase (``building the model``): printed at once."""
        with self._lock:
            self._state = text
            if self._terminal:
                self._bar_for(text)
            else:
                self._line(text)

    def count(self, done: int, total: int, unit: str = "bucket") -> None:
        """``done`` of ``total`` ``unit``s: printed when ``every`` seconds have passed since the last line, and at
        the last one."""
        with self._lock:
            self._state = f"{unit} {done}/{total}"
            if self._terminal:
                bar = self._bar_for(None)
                bar.total, bar.n = total, done
                bar.refresh()
            elif done == total or time.monotonic() - self._last_line >= self.every:
                self._line(self._state)

    def follow(self, path: str | os.PathLike[str]) -> None:
        """Also report what a :class:`ProgressFile` writes at ``path`` (created here, empty)."""
        open(path, "w").close()
        with self._lock:
            self._follow = (os.fspath(path), 0)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5.0)
        self._read_followed()
        with self._lock:
            if self._bar is not None:
                self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _line(self, text: str) -> None:
        """One plain line (under the lock), unless within the first ``quiet`` seconds."""
        now = time.monotonic()
        if now - self._start < self.quiet:
            return
        self._printed = True
        self._stream.write(f"{self.name}: {text}, {now - self._start:.1f} s\n")
        self._stream.flush()
        self._last_line = now

    def _bar_for(self, desc: str | None) -> Any:
        """The terminal's bar (under the lock), made on first use; ``desc``: its new description."""
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(desc=f"{self.name}: {self._state}", unit="bucket", leave=False, file=self._stream)
        if desc is not None:
            self._bar.set_description(f"{self.name}: {desc}", refresh=True)
        return self._bar

    def _watch(self) -> None:
        """Read the followed file, and on plain output repeat the state after ``every`` seconds of silence."""
        while not self._closed.wait(0.25):
            self._read_followed()
            with self._lock:
                now = time.monotonic()
                due = now - self._last_line >= self.every or (not self._printed and now - self._start >= self.quiet)
                if not self._terminal and due:
                    self._line(self._state)

    def _read_followed(self) -> None:
        with self._lock:
            if self._follow is None:
                return
            path, offset = self._follow
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        with self._lock:
            self._follow = (path, offset + len(complete))
        for raw in complete.splitlines():
            event = json.loads(raw)
            if "phase" in event:
                self.phase(event["phase"])
            else:
                self.count(event["done"], event["total"])


class ProgressFile:
    """The writing end of :meth:`Progress.follow`, in a rank of a local job: phases and counts appended to
    ``path`` as JSON lines. ``path`` None (a rank that does not report): every call does nothing."""

    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1) if path is not None else None

    def phase(self, text: str) -> None:
        self._write({"phase": text})

    def count(self, done: int, total: int) -> None:
        self._write({"done": done, "total": total})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, event: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")
