"""Files and directories that appear whole or not at all: the one helper checkpoints, exports and
retention use.

- ``write_file``/``write_json``: write a sibling, fsync, rename over the target.
- ``publish_dir``: move a complete directory into place; an existing one is swapped out atomically
  (Linux ``renameat2(RENAME_EXCHANGE)``) and deleted only afterwards.
- ``remove_dir``: rename into a trash directory first, then delete, so no reader sees half a tree.
- ``atomic_directory``: a context manager yielding a hidden sibling that is published on success.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from strategy.errors import ConfigError


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str | Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data``: readers see the old content or the new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: str | Path, data: Any) -> None:
    write_file(path, json.dumps(data, indent=1))


def _exchange(first: Path, second: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second),
                     rename_exchange) == 0


def publish_dir(tmp: str | Path, final: str | Path) -> None:
    """Put the complete ``tmp`` at ``final``. An earlier ``final`` stays whole until the new one is
    in place: swapped atomically where the kernel can, else renamed aside first (then ``final`` is
    briefly missing, but the earlier copy survives as a hidden sibling)."""
    tmp, final = Path(tmp), Path(final)
    if not os.path.lexists(final):
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp)  # tmp now holds the earlier copy
    else:
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    fsync_dir(final.parent)


def remove_dir(path: str | Path, trash_dir: str | Path) -> None:
    """Delete ``path`` by first renaming it into ``trash_dir`` (same filesystem), so a crash never
    leaves half a directory where a whole one was expected."""
    os.makedirs(trash_dir, exist_ok=True)
    trash = Path(trash_dir) / f"deleting-{Path(path).name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale(final: str | Path) -> None:
    """Delete the hidden siblings that earlier crashed saves to ``final`` left."""
    final = Path(final)
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.old-*"):
        for path in final.parent.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success it becomes ``final``, on error it is
    removed. A killed process leaves only a hidden ``.NAME.tmp-*`` sibling, cleaned by the next
    save."""
    final = Path(final).absolute()
    if final.exists() and not final.is_dir():
        raise ConfigError(f"output_dir={str(final)!r} is invalid: it is a file; "
                          "pass a directory path")
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)
