"""Writing a file whole or not at all: into a temporary file beside it, renamed over it
once complete. A failed write (above all a full disk) removes the temporary file and says
which file could not be written and why; torch's own file writer reports a full disk only
as "unexpected pos ..." without a file name or a reason."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import BinaryIO, Callable


class WriteError(OSError):
    """A file that could not be written; the message names the file and the reason (its
    errno's name too, e.g. ENOSPC for a full disk). The file's earlier content is kept."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write` with a binary file that becomes `path` once `write` returns (written as
    `path` + ".tmp", then renamed): a reader never sees half a file, and an earlier file at
    `path` stays until the new one is complete."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        # through a Python file object the operating system's error (ENOSPC) reaches us
        # as an OSError; torch.save given a file name would turn it into a stream position
        with open(tmp, "wb") as stream:
            write(stream)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError) and not isinstance(err, WriteError):
            raise _write_error(path, err) from err
        raise
    return path


class AppendedFile:
    """A text file written line by line (a run's metrics), whose failed writes raise
    `WriteError` naming the file and the reason: a buffered file's own error on a full
    disk names neither, and comes at a flush or at the close."""

    def __init__(self, path: str | os.PathLike, mode: str) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, mode)
        except OSError as err:
            raise _write_error(self.path, err) from err

    def _named(self, call: Callable[[], object]) -> None:
        try:
            call()
        except OSError as err:
            raise _write_error(self.path, err) from err

    def write(self, text: str) -> None:
        self._named(lambda: self._file.write(text))

    def flush(self) -> None:
        self._named(self._file.flush)

    def close(self) -> None:
        self._named(self._file.close)


def _write_error(path: Path, err: OSError) -> WriteError:
    code = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    reason = f"{err.strerror or err} ({code})" if code else f"{err.strerror or err}"
    hint = ("; free some space (or choose another folder) and try again"
            if err.errno in (errno.ENOSPC, errno.EDQUOT) else "")
    return WriteError(err.errno, f"{path} could not be written: {reason}{hint}", str(path))


__all__ = ["AppendedFile", "WriteError", "write_atomically"]
