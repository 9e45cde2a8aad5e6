"""Checkpoint folders made to appear whole: what ``seqpar train``'s checkpoints (:mod:`.train.ckpt`)
and the HF Trainer's (:mod:`.hf_trainer.checkpoints`) share. A checkpoint is written into a staging
folder, synced, and renamed into place, so a crash leaves either the previous checkpoint or the new
one, never a half-written folder under the final name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["fsync_path", "replace_dir"]


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a folder's entry (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(staging: Path, final: Path) -> None:
    """Rename the finished ``staging`` folder to ``final`` and sync their parent. An existing ``final``
    (the same step saved again) is first moved aside to ``.old-<name>`` and removed after, so the name
    never points at a half-replaced folder."""
    if final.exists():
        old = final.parent / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)
    fsync_path(final.parent)
