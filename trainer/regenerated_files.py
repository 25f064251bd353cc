"""The files of target-regenerated responses: one per TRAIN set, `<set>.jsonl.gz` (what the project keeps: gzip
level 9, possibly several gzip members, which is valid gzip) or `<set>.jsonl` (plain, e.g. a user's own output).
One JSON record per line. Readers take either; a folder holding both for one set is refused as ambiguous.

Appending is resumable in both formats: every write is whole lines (for `.gz`, one complete gzip member per write),
flushed and fsync'd, and `done_ids` cuts off a tail that a killed run left unfinished."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path

GZ, PLAIN = ".jsonl.gz", ".jsonl"


def _candidates(folder, name: str) -> tuple[Path, Path]:
    return Path(folder) / f"{name}{GZ}", Path(folder) / f"{name}{PLAIN}"


def find_regenerated(folder, name: str) -> Path | None:
    """The regenerated file of set `name` in `folder` (`<name>.jsonl.gz`, else `<name>.jsonl`), or None."""
    gz, plain = _candidates(folder, name)
    if gz.is_file() and plain.is_file():
        raise ValueError(f"both {gz} and {plain} exist: keep one (e.g. `gzip -c {plain} >> {gz}` with the ids of "
                         "one not already in the other, then delete it)")
    return gz if gz.is_file() else plain if plain.is_file() else None


def regenerated_file(folder, name: str) -> Path:
    """`find_regenerated`, raising `FileNotFoundError` that names both accepted paths when neither exists."""
    path = find_regenerated(folder, name)
    if path is None:
        gz, plain = _candidates(folder, name)
        raise FileNotFoundError(f"no regenerated responses for {name!r}: neither {gz} nor {plain} exists; run "
                                "`angelspec regenerate`")
    return path


def output_file(folder, name: str) -> Path:
    """Where new records of set `name` go: the existing file (either format, so a run resumes into it), else
    `<name>.jsonl.gz`."""
    return find_regenerated(folder, name) or _candidates(folder, name)[0]


def _is_gz(path) -> bool:
    return str(path).endswith(".gz")


def read_records(path):
    """The records of a regenerated file (plain or gzip, by its name), in order; blank lines skipped."""
    opener = gzip.open if _is_gz(path) else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _gzip_members(f):
    """`(end offset, data)` of each complete gzip member of binary file `f`, in order, stopping at the first one that
    is cut short or corrupt (the write a kill interrupted)."""
    pos, chunk = 0, b""
    while True:
        member, parts = zlib.decompressobj(wbits=31), []
        while not member.eof:
            if not chunk:
                chunk = f.read(1 << 20)
                if not chunk:
                    return
            try:
                parts.append(member.decompress(chunk))
            except zlib.error:
                return
            used = len(chunk) - len(member.unused_data)
            pos, chunk = pos + used, member.unused_data
        yield pos, b"".join(parts)


def _line_id(raw: bytes):
    """The `id` of one complete record line, or None for a line a kill cut short."""
    if not raw.endswith(b"\n"):
        return None
    try:
        return json.loads(raw)["id"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None


def done_ids(path) -> set[str]:
    """Ids already written to `path` (either format). What a run killed in the middle of a write left after the last
    complete line (plain) or gzip member (`.gz`) is cut off, so appending resumes cleanly."""
    path = Path(path)
    if not path.exists():
        return set()
    ids, good_bytes = set(), 0
    with open(path, "rb") as f:
        if _is_gz(path):
            for end, data in _gzip_members(f):
                member = [_line_id(raw) for raw in data.splitlines(keepends=True)]
                if None in member:
                    break
                ids.update(member)
                good_bytes = end
        else:
            for raw in f:
                if (rid := _line_id(raw)) is None:
                    break
                ids.add(rid)
                good_bytes += len(raw)
    if good_bytes < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return ids


def append_lines(path, lines: list[str]) -> None:
    """Append `lines` (each ending in a newline) to `path`, as one gzip member for a `.gz` file, then flush and
    fsync: a kill leaves at most this write unfinished, which `done_ids` cuts off."""
    if not lines:
        return
    data = "".join(lines).encode("utf-8")
    if _is_gz(path):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    with open(path, "ab") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
