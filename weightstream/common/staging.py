"""An output directory written beside its place and moved into it whole.

``save_hf_checkpoint`` (and so ``dump`` and ``convert``) writes every file into a sibling directory,
``<name>.partial-<pid>-<hex>`` next to the target, on the same filesystem, and moves it into place with one
rename once every shard, the index and ``config.json`` are complete. Replacing a directory that is there
(asked for with ``overwrite``) swaps the two in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``) and then
removes the old one; where the filesystem cannot swap, the old one is first renamed aside
(``<name>.old-<pid>-<hex>``). A kill at any point leaves at the target either the old complete directory or
the new complete one, never a mix. What a killed run leaves beside the target is removed (or, where its
writer still runs, reported) by the next run that writes to the same target; an old directory set aside by a
run killed between its two renames is put back.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from weightstream.common.processes import is_running
from weightstream.errors import WeightstreamError

__all__ = ["log", "OutputDirectoryError", "writing", "check_target", "clean_leftovers", "StagedDirectory"]


log = logging.getLogger("weightstream")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_CANNOT_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class OutputDirectoryError(WeightstreamError):
    """The output directory cannot be written: refused (not empty, not a directory) or an I/O error; the
    message names the path and the cause."""


@contextmanager
def writing(target: Path, path: Path) -> Iterator[None]:
    """An ``OSError`` while writing ``path`` (a file of the checkpoint going to ``target``) as one
    :class:`OutputDirectoryError` naming the target, the file and the cause."""
    try:
        yield
    except OSError as exc:
        raise OutputDirectoryError(f"cannot write the checkpoint to {target}: {_cause(exc)} "
                                   f"(writing {path.name})") from exc


def _cause(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _describe(entries: list[Path]) -> str:
    dirs = sum(1 for e in entries if e.is_dir())
    files = len(entries) - dirs
    parts = [f"{files} file{'s' * (files != 1)}"] + ([f"{dirs} director{'ies' if dirs != 1 else 'y'}"] if dirs else [])
    return " and ".join(parts)


def check_target(target: Path, *, overwrite: bool) -> None:
    """Raise :class:`OutputDirectoryError` if a checkpoint may not be written at ``target``: it is something
    other than a directory, it holds anything and ``overwrite`` is false, or it cannot be created there (a
    file on the way, a read-only or unwritable parent). An empty directory is fine. Changes nothing."""
    if target.exists() and not target.is_dir():
        raise OutputDirectoryError(f"{target} exists and is not a directory")
    if target.is_dir() and not overwrite:
        try:
            entries = sorted(target.iterdir())
        except OSError as exc:
            raise OutputDirectoryError(f"cannot read {target}: {_cause(exc)}") from exc
        if entries:
            raise OutputDirectoryError(
                f"{target} is not empty (it holds {_describe(entries)}); refusing to write the checkpoint into "
                f"it: pass overwrite=True (--overwrite) to replace it, or choose an empty or new directory")
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputDirectoryError(f"cannot create {target}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(ancestor) else "is not writable (permission denied)"
        raise OutputDirectoryError(f"cannot create {target}: {ancestor} {why}")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f"{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _leftovers(target: Path) -> Iterator[tuple[Path, str, int]]:
    """What earlier runs left beside ``target``: (path, "partial" or "old", the writer's pid)."""
    pattern = re.compile(re.escape(target.name) + r"\.(partial|old)-(\d+)-[0-9a-f]+")
    if not target.parent.is_dir():
        return
    for entry in sorted(target.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is not None and entry.is_dir() and not entry.is_symlink():
            yield entry, match.group(1), int(match.group(2))


def clean_leftovers(target: Path) -> list[Path]:
    """Remove what killed runs left beside ``target`` (their writers no longer running); put back an old
    directory set aside by a run killed between its two renames, if the target is missing. Returns what was
    removed; a leftover whose writer still runs is reported and kept."""
    removed: list[Path] = []
    for path, kind, pid in _leftovers(target):
        if is_running(pid) and pid != os.getpid():
            log.warning("leaving %s in place: process %d, which writes it, is still running", path, pid)
        elif kind == "old" and not target.exists():
            os.rename(path, target)
            log.warning("put back %s as %s (a run replacing it was killed between two renames)", path, target)
        else:
            _remove(path)
            removed.append(path)
            log.warning("removed %s, left by a run that did not finish", path)
    return removed


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class StagedDirectory:
    """Where a checkpoint is written (``path``) until :meth:`commit` moves it to ``target``."""

    target: Path
    path: Path

    @classmethod
    def create(cls, target: str | os.PathLike, *, overwrite: bool = False) -> StagedDirectory:
        """Check ``target`` (:func:`check_target`), clear what killed runs left beside it and make the
        staging directory next to it (its parents made as needed)."""
        target = Path(os.path.realpath(target))
        check_target(target, overwrite=overwrite)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(target)
            check_target(target, overwrite=overwrite)  # an old directory put back is not to be written into
            path = _sibling(target, "partial")
            path.mkdir()  # with the umask's permissions, as the target would have had
        except OSError as exc:
            raise OutputDirectoryError(f"cannot create {target}: {_cause(exc)}") from exc
        return cls(target, path)

    def commit(self) -> None:
        """Move the complete directory to the target, replacing what is there in one atomic step."""
        try:
            os.replace(self.path, self.target)  # the target is missing or an empty directory
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise OutputDirectoryError(f"cannot move the checkpoint into {self.target}: {_cause(exc)}") from exc
        try:
            old = self.path if _exchange(self.path, self.target) else self._set_aside()
        except OSError as exc:
            raise OutputDirectoryError(f"cannot move the checkpoint into {self.target}: {_cause(exc)}") from exc
        _remove(old)  # after a swap, the old directory is under the staging name

    def _set_aside(self) -> Path:
        """Where the filesystem cannot swap: the old directory renamed aside, then the new one into place
        (the old one put back if that fails). Returns where the old one is."""
        old = _sibling(self.target, "old")
        os.rename(self.target, old)
        try:
            os.rename(self.path, self.target)
        except OSError:
            os.rename(old, self.target)
            raise
        return old

    def discard(self) -> None:
        """Remove the staging directory and everything written into it."""
        _remove(self.path)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with ``RENAME_EXCHANGE``).
    False where the system or the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))
