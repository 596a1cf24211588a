"""Files replaced atomically: a reader sees the old document or the new one, never half of it."""
from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_json(path: Path, doc: dict) -> None:
    """Replace ``path`` with ``doc`` so that a reader sees the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename itself is durable only once the directory is synced.
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
