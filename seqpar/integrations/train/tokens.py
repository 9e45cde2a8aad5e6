"""Training data tokenized with a model's own tokenizer, for ``seqpar train --model DIR --data PATH``.

``--data PATH`` is a file or a folder (searched recursively; hidden entries, ``__pycache__`` and
``site-packages`` skipped; names filtered by ``--data-glob``). By file name:

- ``*.jsonl``, ``*.json``: one document per non-empty line, a JSON object whose ``text`` field is
  the document (JSON Lines, as ``datasets.Dataset.to_json`` writes);
- ``*.parquet``, ``*.arrow``: one document per row's ``text`` column, read through the ``datasets``
  library (local files only; ``pip install 'seqpar[data]'``);
- any other file: the whole file is one document (UTF-8; undecodable bytes replaced).

A document is ``[BOS] + tokenizer(text, add_special_tokens=False) + [EOS]`` (no BOS when the
tokenizer has none), so EOS separates documents. Empty documents are skipped. The documents are
packed exactly like the byte-level data of :mod:`.data` (same shuffling, same cuts, same
``cu_seqlens``): :class:`PackedTokenSequences` is a :class:`~.data.PackedSequences`, so sequence
``i`` is a pure function of ``(data, tokenizer, seq_len, seed, i)`` and a resumed run sees the
uninterrupted run's data.

Cost: :meth:`Documents.scan` tokenizes every document once, only to count its tokens (kept: one
int per document; with ``cache_dir`` the counts are stored under a fingerprint of the data and the
tokenizer, so a restart skips the pass). Tokens themselves are produced lazily: a sequence
re-tokenizes only the documents it touches (a few recent documents are kept, so a long document
spanning many sequences is tokenized once per visit, not once per sequence).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data import PackedSequences

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}
_TABLES = (".parquet", ".arrow")
_BATCH = 256  # documents per tokenizer call in the counting pass
_KEEP_TOKENS = 1 << 22  # tokens of recently used documents kept in memory (16 MiB of int32)


@dataclass(frozen=True)
class _Ref:
    """Where a document lives: a whole file, a JSONL line (byte offset), or a table row."""

    kind: str  # "file" | "jsonl" | "table"
    path: str
    at: int = 0


def _list_files(root: Path, pattern: str, argument: str) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"{argument}: {str(root)!r} does not exist; pass a folder of text files, a JSONL "
                         f"file, or parquet/arrow files")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(dirpath) / n for n in filenames if not n.startswith(".") and fnmatch.fnmatch(n, pattern)]
    return sorted(p for p in found if p.is_file() and p.stat().st_size > 0)


def _jsonl_refs(path: Path) -> list[_Ref]:
    refs, at = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                refs.append(_Ref("jsonl", str(path), at))
            at += len(line)
    return refs


def _open_tables(paths: list[Path], argument: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{argument}: reading {paths[0].name} needs the datasets library: "
                         f"pip install 'seqpar[data]' (or convert the data to JSONL)") from None
    tables = {}
    for suffix, builder in ((".parquet", "parquet"), (".arrow", "arrow")):
        files = [str(p) for p in paths if p.suffix == suffix]
        if files:
            tables[suffix] = datasets.load_dataset(builder, data_files=files, split="train")
    return tables


@dataclass
class Documents:
    """The documents under ``--data``, with each one's token count under ``tokenizer``.

    ``lengths[d]`` counts document ``d``'s tokens including BOS/EOS. ``read(d, start, stop)`` gives
    tokens ``[start, stop)`` of document ``d`` (the interface :class:`~.data.PackedSequences` uses).
    Build with :meth:`scan`.
    """

    root: str
    refs: list[_Ref]
    lengths: list[int]
    tokenizer: object
    fingerprint: str
    text_field: str = "text"
    argument: str = "--data"  # the flag named in errors (--data, --eval-data)
    _tables: dict = field(default_factory=dict, repr=False)
    _recent: OrderedDict = field(default_factory=OrderedDict, repr=False)

    @classmethod
    def scan(cls, path: str | os.PathLike, tokenizer, *, pattern: str = "*", text_field: str = "text",
             cache_dir: str | os.PathLike | None = None, argument: str = "--data") -> "Documents":
        """Find the documents under ``path`` and count their tokens (see module doc).

        Raises ValueError naming ``argument`` when the path does not exist, holds no non-empty
        document, a JSONL line is not an object with a string ``text_field``, a table has no
        ``text_field`` column, or parquet/arrow files are given without the ``datasets`` library.
        The tokenizer must have an EOS token (ValueError naming ``--model`` otherwise).
        """
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("--model: the tokenizer has no EOS token, which separates packed documents; "
                             "set eos_token in its tokenizer_config.json")
        root = Path(path)
        files = _list_files(root, pattern, argument)
        refs: list[_Ref] = []
        tables = [p for p in files if p.suffix in _TABLES]
        opened = _open_tables(tables, argument) if tables else {}
        for p in files:
            if p.suffix in (".jsonl", ".json"):
                refs += _jsonl_refs(p)
            elif p.suffix not in _TABLES:
                refs.append(_Ref("file", str(p)))
        for suffix, table in opened.items():
            if text_field not in table.column_names:
                raise ValueError(f"{argument}: the {suffix} data has no {text_field!r} column (columns: "
                                 f"{table.column_names}); rename the column")
            refs += [_Ref("table", suffix, i) for i in range(len(table))]
        h = hashlib.sha256(f"{text_field}\n".encode())
        for p in files:
            h.update(f"{p.relative_to(root) if root.is_dir() else p.name}\0{p.stat().st_size}\n".encode())
        h.update(_tokenizer_fingerprint(tokenizer).encode())
        docs = cls(str(root), refs, [], tokenizer, h.hexdigest()[:16], text_field, argument, opened)
        docs.lengths = docs._count(cache_dir)
        keep = [i for i, n in enumerate(docs.lengths) if n > docs._specials]
        docs.refs, docs.lengths = [docs.refs[i] for i in keep], [docs.lengths[i] for i in keep]
        if not docs.refs:
            raise ValueError(f"{argument}: no non-empty documents under {str(path)!r} (matching {pattern!r}); "
                             f"pass text files, JSONL lines with a {text_field!r} field, or parquet/arrow rows")
        return docs

    @property
    def _specials(self) -> int:
        return 1 + (self.tokenizer.bos_token_id is not None)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def text(self, doc: int, *, argument: str | None = None) -> str:
        """Document ``doc``'s text (errors name ``argument``, default the flag the documents came from)."""
        argument = argument or self.argument
        ref = self.refs[doc]
        if ref.kind == "table":
            return self._tables[ref.path][ref.at][self.text_field] or ""
        if ref.kind == "file":
            return Path(ref.path).read_text(encoding="utf-8", errors="replace")
        with open(ref.path, "rb") as f:
            f.seek(ref.at)
            line = f.readline()
        try:
            value = json.loads(line)[self.text_field]
        except (ValueError, KeyError, TypeError):
            value = None
        if not isinstance(value, str):
            raise ValueError(f"{argument}: {ref.path} at byte {ref.at}: not a JSON object with a string "
                             f"{self.text_field!r} field; fix or remove the line")
        return value

    def _tokens(self, texts: list[str]) -> list[list[int]]:
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        bos = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        return [bos + list(t) + [self.tokenizer.eos_token_id] for t in ids]

    def _texts(self, lo: int, hi: int) -> list[str]:
        """Texts of documents ``[lo, hi)``: table rows sliced at once, everything else one by one."""
        refs = self.refs[lo:hi]
        if refs and all(r.kind == "table" and r.path == refs[0].path for r in refs):
            rows = self._tables[refs[0].path][refs[0].at:refs[-1].at + 1][self.text_field]
            if len(rows) == len(refs):  # consecutive rows (always, as scan lists them)
                return [t or "" for t in rows]
        return [self.text(d) for d in range(lo, hi)]

    def _count(self, cache_dir) -> list[int]:
        cache = Path(cache_dir) / f"token-counts-{self.fingerprint}.json" if cache_dir is not None else None
        if cache is not None and cache.is_file():
            counts = json.loads(cache.read_text())
            if len(counts) == len(self.refs):
                return counts
        counts = []
        for lo in range(0, len(self.refs), _BATCH):
            counts += [len(t) for t in self._tokens(self._texts(lo, min(lo + _BATCH, len(self.refs))))]
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, cache)  # several ranks may write the same file: each write is whole
        return counts

    def read(self, doc: int, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of document ``doc`` (BOS first when the tokenizer has one, EOS last)."""
        tokens = self._recent.get(doc)
        if tokens is None:
            tokens = self._tokens([self.text(doc)])[0]
            if len(tokens) != self.lengths[doc]:
                raise ValueError(f"{self.argument}: document {doc} ({self.refs[doc].path}) changed while training "
                                 f"({len(tokens)} tokens, counted {self.lengths[doc]})")
            self._recent[doc] = tokens
            while sum(len(t) for t in self._recent.values()) > _KEEP_TOKENS and len(self._recent) > 1:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(doc)
        return tokens[start:stop]


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, len(tokenizer))
    return hashlib.sha256(f"{ids}\n{text}".encode()).hexdigest()


class PackedTokenSequences(PackedSequences):
    """Sequence ``s`` of the packed token stream: ``(tokens [seq_len] int64, cu_seqlens)``.

    Same packing, shuffling and resume behaviour as :class:`~.data.PackedSequences` (per epoch the
    documents are shuffled with a generator seeded by ``(seed, epoch)``, concatenated and cut into
    ``seq_len`` tokens; a document crossing a cut continues as the first segment of the next
    sequence; the epoch's tail is dropped). ``per_epoch``: sequences per epoch; ``unused``: tokens
    of the dropped tail; ``fingerprint``: data + tokenizer, for resume checks.
    """

    def __init__(self, documents: Documents, seq_len: int, seed: int, *, argument: str = "--data"):
        if documents.num_tokens < seq_len:
            raise ValueError(f"{argument}: the documents hold {documents.num_tokens} tokens, fewer than one "
                             f"sequence of --seq-len {seq_len}; add data or lower --seq-len")
        self.files, self.seq_len, self.seed = documents, seq_len, seed
        self.lengths = list(documents.lengths)
        self.per_epoch = sum(self.lengths) // seq_len
        self.unused = sum(self.lengths) - self.per_epoch * seq_len
        self._epoch = None

    @property
    def fingerprint(self) -> str:
        return self.files.fingerprint


def open_token_data(path, tokenizer, seq_len: int, seed: int, *, pattern: str = "*", text_field: str = "text",
                    cache_dir=None, argument: str = "--data") -> PackedTokenSequences:
    """:meth:`Documents.scan` then :class:`PackedTokenSequences`: the trainer's one call."""
    docs = Documents.scan(path, tokenizer, pattern=pattern, text_field=text_field, cache_dir=cache_dir,
                          argument=argument)
    return PackedTokenSequences(docs, seq_len, seed, argument=argument)


def decode(tokenizer, tokens: torch.Tensor) -> str:
    """Tokens back to text with the special tokens shown, for looking at samples."""
    return tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False)
