"""Files chunkmem writes: whole or not at all, on disk before they count, with the user's permissions.

A file is written beside its place and renamed over it, so a reader (or a run killed half-way)
sees the old file or the new one, never a mix. A rename lives in the directory, so the directory
is fsynced after it: without that, a power cut can bring back the old name. safetensors creates
its files with mode 0600 whatever the umask; `share_like_others` gives them the mode `open()`
would have (0644 under the usual umask 022), as config.json and the other files get.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Make the renames and creations in directory `path` durable (a no-op where directories can't be opened)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:  # some file systems refuse fsync on a directory; nothing more can be done there
        pass
    finally:
        os.close(handle)


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically and durably."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def umask() -> int:
    """The process's umask, read without changing it where Linux allows (/proc), else by setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_others(path: Path) -> None:
    """Give a file the mode a plain `open(path, "w")` would have given it under the current umask."""
    os.chmod(path, 0o666 & ~umask())
