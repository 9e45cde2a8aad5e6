"""Training data for ``seqpar train``: real text files, byte-level tokens, documents packed into
fixed-length sequences with ``cu_seqlens``.

Every file is one document: ``[BOS] + its bytes + [EOS]``. Per epoch the documents are shuffled
with a generator seeded by ``(seed, epoch)``, concatenated, and cut into sequences of ``seq_len``
tokens (a document crossing a cut continues as a new segment of the next sequence; the epoch's
tail that does not fill a sequence is dropped). Sequence ``s`` is therefore a pure function of
``(files, seq_len, seed, s)``: any rank can build any sequence, and a resumed run sees exactly the
data of the uninterrupted run. Only the byte ranges a sequence needs are read.
"""

from __future__ import annotations

import bisect
import fnmatch
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

BOS, EOS, PAD = 256, 257, 258  # byte values are tokens 0..255
VOCAB_SIZE = 259
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}


def default_data_dir() -> str:
    """The Python standard library's source folder (present on every machine with Python)."""
    return sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class TextFiles:
    """The documents of a data folder: relative paths (sorted) and byte sizes, read once at start."""

    root: str
    paths: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def scan(cls, root: str, pattern: str = "*", *, argument: str = "--data") -> "TextFiles":
        """Index the non-empty files under ``root`` whose name matches ``pattern`` (hidden folders,
        ``site-packages`` and ``__pycache__`` are skipped). ValueError when there are none."""
        base = Path(root)
        if not base.is_dir():
            raise ValueError(f"{argument}: {root!r} is not a folder; pass a folder of text files")
        found: list[tuple[str, int]] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for name in filenames:
                if name.startswith(".") or not fnmatch.fnmatch(name, pattern):
                    continue
                path = Path(dirpath) / name
                try:
                    size = path.stat().st_size
                except OSError as exc:  # e.g. a broken link: say so rather than train on less data
                    raise ValueError(f"{argument}: cannot read {path} ({exc}); remove it or narrow "
                                     f"--data-glob") from None
                if size > 0 and path.is_file():
                    found.append((path.relative_to(base).as_posix(), size))
        if not found:
            raise ValueError(f"{argument}: no non-empty files matching {pattern!r} under {root!r}; put text "
                             f"files there (every file is one document) or change --data-glob")
        found.sort()
        return cls(str(base), tuple(p for p, _ in found), tuple(s for _, s in found))

    @property
    def fingerprint(self) -> str:
        """Short hash of the file list and sizes: tells a resumed run whether its data changed."""
        h = hashlib.sha256()
        for p, s in zip(self.paths, self.sizes):
            h.update(f"{p}\0{s}\n".encode())
        return h.hexdigest()[:16]

    @property
    def num_tokens(self) -> int:
        return sum(self.sizes) + 2 * len(self.sizes)

    def read(self, doc: int, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of document ``doc`` (position 0 is BOS, the last is EOS)."""
        size = self.sizes[doc]
        out: list[int] = []
        if start == 0:
            out.append(BOS)
        lo, hi = max(start - 1, 0), min(stop - 1, size)
        if hi > lo:
            with open(Path(self.root) / self.paths[doc], "rb") as f:
                f.seek(lo)
                data = f.read(hi - lo)
            if len(data) != hi - lo:
                raise ValueError(f"--data: {self.paths[doc]} changed while training (expected {size} bytes)")
            out.extend(data)
        if stop == size + 2:
            out.append(EOS)
        return out


class PackedSequences:
    """Sequence ``s`` of the packed stream: ``(tokens [seq_len], cu_seqlens)`` (see module doc)."""

    def __init__(self, files: TextFiles, seq_len: int, seed: int):
        if files.num_tokens < seq_len:
            raise ValueError(f"--data: the files hold {files.num_tokens} tokens, fewer than one sequence of "
                             f"--seq-len {seq_len}; add text or lower --seq-len")
        self.files, self.seq_len, self.seed = files, seq_len, seed
        self.lengths = [s + 2 for s in files.sizes]
        self.per_epoch = sum(self.lengths) // seq_len
        self.unused = sum(self.lengths) - self.per_epoch * seq_len  # the epoch's tail (logged at start)
        self._epoch: tuple[int, list[int], list[int]] | None = None  # (epoch, order, starts)

    def _order(self, epoch: int) -> tuple[list[int], list[int]]:
        if self._epoch is None or self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.lengths), generator=gen).tolist()
            starts, pos = [], 0
            for d in order:
                starts.append(pos)
                pos += self.lengths[d]
            self._epoch = (epoch, order, starts)
        return self._epoch[1], self._epoch[2]

    def sequence(self, index: int) -> tuple[torch.Tensor, list[int]]:
        """Tokens ``[seq_len]`` (int64) and the document boundaries inside them (cu_seqlens)."""
        epoch, i = divmod(index, self.per_epoch)
        order, starts = self._order(epoch)
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len
        j = bisect.bisect_right(starts, lo) - 1
        tokens: list[int] = []
        cu = [0]
        while len(tokens) < self.seq_len:
            doc = order[j]
            a = max(lo - starts[j], 0)
            b = min(hi - starts[j], self.lengths[doc])
            tokens.extend(self.files.read(doc, a, b))
            cu.append(len(tokens))
            j += 1
        return torch.tensor(tokens, dtype=torch.long), cu


def decode(tokens) -> str:
    """Bytes back to text (specials shown as <bos>, <eos>, <pad>), for looking at samples."""
    names = {BOS: "<bos>", EOS: "<eos>", PAD: "<pad>"}
    out, run = [], bytearray()
    for t in (int(x) for x in tokens):
        if t < 256:
            run.append(t)
            continue
        out.append(run.decode("utf-8", "replace"))
        run = bytearray()
        out.append(names.get(t, f"<{t}>"))
    out.append(run.decode("utf-8", "replace"))
    return "".join(out)
