"""Lookups in a corpus of the target's own earlier outputs (`CorpusIndex`): retrieval-based drafting in the manner of
REST (He et al., 2023) and SuffixDecoding (Oliaro et al., 2024), beside the n-gram lookup in the request's own context
(`lookup.NgramIndex`).

A target answers similar requests with similar text: the same openings, the same step-by-step phrasing of a
solution, the same code idioms. The corpus is token ids the target itself produced (for the embedded target: its
greedy replies to the TRAIN prompt sets, `data/regenerated/`), indexed by a suffix array (`pydivsufsort`). A lookup
finds the longest suffix of the context (up to `max_match` tokens) that occurs in the corpus and follows the
occurrences forward: at each depth the most frequent next token among the occurrences still on the path. Because a
suffix array sorts the occurrences of a match by what follows it, each depth is one pass over a contiguous sorted
range.

Each proposed token carries a confidence: the share of the occurrences on the path that continue with it, times
`min(1, matched / full_match)` where `matched` is the length of the context suffix that the path matches at that
depth (a short match is weak evidence however unanimous its occurrences). The policies calibrate that confidence
against verification outcomes as they calibrate a drafter's (`AcceptanceCalibrator`). The proposal is a
deterministic function of the context, so verifying it is exact at any temperature, as a context lookup is.

A corpus travels with its drafter: `save` writes `lookup_corpus.safetensors` (`LOOKUP_CORPUS_FILE`: the token ids and
each sequence's length, no code, no pickle) into a drafter's Hub folder, and `angelspec_hf.load_drafter` /
`from_pretrained` attach the one a folder or Hub repository holds as `drafter.lookup_corpus`. The suffix array is not
stored: it is built on the first lookup or by `warm()` (about a second for the embedded target's 2.3M tokens).
`GrowingCorpus` adds a window of the replies a server has served since.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

LOOKUP_CORPUS_FILE = "lookup_corpus.safetensors"  # a drafter folder's corpus (`CorpusIndex.save` / `load`)
_FORMAT = "angelspec-lookup-corpus/1"


class CorpusIndex:
    """A suffix array over token sequences (`sequences`: lists or 1-D arrays of token ids, kept apart: no match or
    continuation crosses from one into the next). `max_match`: the longest context suffix looked for; `min_match`:
    the shortest that proposes anything; `full_match`: the matched length at which a match counts as full evidence
    (see the module docstring). The suffix array is built on the first lookup: about a second over the embedded
    target's 2.3M regenerated tokens."""

    def __init__(self, sequences: Iterable[Sequence[int]], max_match: int = 32, min_match: int = 2,
                 full_match: int = 8):
        if not 1 <= min_match <= max_match or full_match < 1:
            raise ValueError(f"need 1 <= min_match <= max_match and full_match >= 1, got min_match={min_match}, "
                             f"max_match={max_match}, full_match={full_match}")
        parts, count = [], 0
        for seq in sequences:
            ids = np.asarray(seq, dtype=np.int64).reshape(-1)
            if ids.size and ids.min() < 0:
                raise ValueError("token ids must be >= 0")
            parts.append(np.concatenate([ids, [-1]]))
            count += 1
        if not count:
            raise ValueError("a corpus needs at least one sequence")
        # ids + 1, and 0 between sequences: a pattern (ids + 1) never contains 0, so no match spans two sequences
        text = np.concatenate(parts) + 1
        if text.max() >= 2**31 - 1:
            raise ValueError("token ids must be < 2**31 - 1")
        self.text = text.astype(np.int32)
        self._suffixes = None  # built on the first lookup (`suffixes`)
        self.num_sequences = count
        self.max_match, self.min_match, self.full_match = max_match, min_match, full_match

    @property
    def suffixes(self) -> np.ndarray:
        """The suffix array of `text` (`pydivsufsort`), built on first use."""
        if self._suffixes is None:
            from pydivsufsort import divsufsort

            self._suffixes = divsufsort(self.text)
        return self._suffixes

    def warm(self) -> None:
        """Build the suffix array now (a server does, before its first step looks anything up)."""
        self.suffixes  # noqa: B018

    # ---- files -------------------------------------------------------------------------------------------------------
    def sequences(self) -> list[np.ndarray]:
        """The token sequences indexed, as given."""
        ends = np.flatnonzero(self.text == 0)
        starts = np.concatenate([[0], ends[:-1] + 1])
        return [self.text[a:b].astype(np.int64) - 1 for a, b in zip(starts, ends)]

    def save(self, path, source: str | None = None) -> Path:
        """Write the corpus to `path` (a file, or a folder to hold `LOOKUP_CORPUS_FILE`) as safetensors: `tokens`
        (uint16 where every id fits, else int32) and `lengths` (int64, one per sequence), with the lookup settings
        and `source` (where the sequences came from) in its metadata."""
        from safetensors.numpy import save_file

        path = Path(path)
        if path.is_dir():
            path = path / LOOKUP_CORPUS_FILE
        shifted = self.text[self.text > 0]
        tokens = (shifted - 1).astype(np.uint16 if shifted.max(initial=1) <= 2**16 else np.int32)
        ends = np.flatnonzero(self.text == 0)
        lengths = np.diff(np.concatenate([[-1], ends])) - 1
        metadata = {"format": _FORMAT, "max_match": str(self.max_match), "min_match": str(self.min_match),
                    "full_match": str(self.full_match), "sequences": str(self.num_sequences), "tokens": str(len(self))}
        if source:
            metadata["source"] = source
        save_file({"tokens": tokens, "lengths": lengths.astype(np.int64)}, str(path), metadata=metadata)
        return path

    @classmethod
    def load(cls, path, **kwargs) -> CorpusIndex:
        """A corpus `save` wrote (`path`: the file, or a folder holding `LOOKUP_CORPUS_FILE`), with its saved lookup
        settings unless `kwargs` override them. Raises `ValueError` for a file that is not one."""
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            path = path / LOOKUP_CORPUS_FILE
        try:
            with safe_open(str(path), framework="numpy") as f:
                metadata = f.metadata() or {}
                keys = set(f.keys())
                if metadata.get("format") == _FORMAT and keys == {"tokens", "lengths"}:
                    tokens, lengths = f.get_tensor("tokens").astype(np.int64), f.get_tensor("lengths")
        except FileNotFoundError:
            raise
        except Exception as error:  # noqa: BLE001 - safetensors' own error for a file that is not one
            raise ValueError(f"{path} is not a lookup corpus: not a safetensors file ({error})") from None
        if metadata.get("format") != _FORMAT or keys != {"tokens", "lengths"}:
            raise ValueError(f"{path} is not a lookup corpus (format {metadata.get('format')!r}, expected "
                             f"{_FORMAT!r} with tensors tokens and lengths)")
        if lengths.min(initial=0) < 0 or int(lengths.sum()) != len(tokens):
            raise ValueError(f"{path}: its sequence lengths do not add up to its {len(tokens)} tokens")
        settings = {k: int(metadata[k]) for k in ("max_match", "min_match", "full_match") if k in metadata}
        return cls(np.split(tokens, np.cumsum(lengths)[:-1]), **{**settings, **kwargs})

    @classmethod
    def from_path(cls, path, **kwargs) -> CorpusIndex:
        """A corpus from `path`: a saved corpus file, a folder holding one (a drafter's), or a folder of
        regenerated replies (`from_regenerated`). Raises `FileNotFoundError` when it is none of these."""
        path = Path(path)
        if path.is_file() or (path / LOOKUP_CORPUS_FILE).is_file():
            return cls.load(path, **kwargs)
        if not path.is_dir():
            raise FileNotFoundError(f"no lookup corpus ({LOOKUP_CORPUS_FILE}) and no regenerated responses at {path}: "
                                    "it does not exist")
        return cls.from_regenerated(path, **kwargs)

    @staticmethod
    def is_source(path) -> bool:
        """Does `path` hold a corpus `from_path` reads (checked without reading it)?"""
        path = Path(path)
        if path.is_file():
            return path.suffix == ".safetensors"
        return (path / LOOKUP_CORPUS_FILE).is_file() or any(path.glob("*.jsonl*"))

    @classmethod
    def from_regenerated(cls, folder, sets: Sequence[str] | None = None, **kwargs) -> CorpusIndex:
        """The responses (`response_ids`) of the regenerated files in `folder` (`<set>.jsonl.gz` or `<set>.jsonl`,
        as `angelspec regenerate` writes them): every set there, or `sets`. Raises `FileNotFoundError` when none
        is there."""
        from angelspec_hf.trainer.regenerated_files import read_records, regenerated_file

        folder = Path(folder)
        if sets is None:
            sets = sorted({p.name.split(".")[0] for p in folder.glob("*.jsonl*")})
        paths = [regenerated_file(folder, name) for name in sets]
        if not paths:
            raise FileNotFoundError(f"no regenerated responses (<set>.jsonl.gz or <set>.jsonl) in {folder}")
        return cls((rec["response_ids"] for path in paths for rec in read_records(path)), **kwargs)

    def __len__(self) -> int:
        """Tokens indexed."""
        return len(self.text) - self.num_sequences

    def __repr__(self) -> str:
        return f"CorpusIndex({self.num_sequences} sequences, {len(self)} tokens)"

    # ---- search ---------------------------------------------------------------------------------------------------
    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """`[lo, hi)` of the suffixes that start with `pattern` (shifted ids)."""
        text, sa, m = self.text, self.suffixes, len(pattern)
        lo, hi = 0, len(sa)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(sa[mid])
            if text[start:start + m].tolist() < pattern:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, len(sa)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(sa[mid])
            if text[start:start + m].tolist() <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def longest_match(self, ids) -> tuple[int, int, int]:
        """`(n, lo, hi)`: the longest suffix of `ids` (a list or 1-D tensor / array of token ids), at most
        `max_match` tokens, that occurs in the corpus, and the suffix-array range of its occurrences; `n = 0` when
        not even its last token occurs. A suffix that occurs has every shorter suffix occurring too, so the length is
        found by bisection."""
        tail = ids[-self.max_match:]
        tail = [int(t) + 1 for t in (tail.tolist() if hasattr(tail, "tolist") else tail)]
        best = (0, 0, 0)
        lo_n, hi_n = 1, len(tail)
        while lo_n <= hi_n:
            n = (lo_n + hi_n) // 2
            lo, hi = self._range(tail[len(tail) - n:])
            if hi > lo:
                best, lo_n = (n, lo, hi), n + 1
            else:
                hi_n = n - 1
        return best

    def continuation(self, ids, num_tokens: int) -> tuple[list[int], list[float]]:
        """At most `num_tokens` tokens proposed to follow `ids`, and each one's confidence (module docstring);
        `([], [])` when the longest match is shorter than `min_match`."""
        return self.lookup(ids, num_tokens)[1:]

    def lookup(self, ids, num_tokens: int) -> tuple[int, list[int], list[float]]:
        """`continuation`'s `(tokens, confidences)` after the length of the context suffix they follow (0 when
        nothing is proposed)."""
        n, lo, hi = self.longest_match(ids)
        if n < self.min_match or num_tokens < 1:
            return 0, [], []
        text, starts = self.text, self.suffixes[lo:hi].astype(np.int64) + n
        tokens, confidences = [], []
        for depth in range(num_tokens):
            # the occurrences still on the path share their first n + depth tokens: their next tokens come sorted
            following = text[starts + depth]  # a sequence ends in 0 before the text does: never out of range
            edges = np.flatnonzero(np.diff(following)) + 1
            bounds = np.concatenate([[0], edges, [len(following)]])
            runs = np.diff(bounds)
            if following[0] == 0:  # occurrences at a sequence's end propose nothing
                runs[0] = 0
            best = int(np.argmax(runs))
            if runs[best] == 0:
                break
            tokens.append(int(following[bounds[best]]) - 1)
            confidences.append(float(runs[best]) / len(following) * min(1.0, (n + depth) / self.full_match))
            starts = starts[bounds[best]:bounds[best + 1]]
        return (n if tokens else 0), tokens, confidences


class GrowingCorpus:
    """A lookup corpus that grows with the replies served: `base` (a `CorpusIndex`, or None) beside a window of the
    sequences added since (`add`: a finished request's prompt tail and reply), at most `window_tokens` tokens (up to
    `MAX_WINDOW_TOKENS`), the oldest dropped first, indexed apart: a `CorpusIndex` rebuilt at a lookup after an
    addition (about 5 ms for 32k tokens), at most so often that rebuilding takes `rebuild_share` of the time (None:
    at every lookup after an addition); in between, lookups read the index as last built. A lookup takes the proposal
    of the longer context match, the window's on a tie (the more recent). What SuffixDecoding does with previous
    outputs, with a bounded memory.

    The batched engine adds its finished requests (`EngineConfig.corpus_window_tokens`), the `generate()` hook each
    greedy call's reply as the call returns (a drafter whose `lookup_corpus` is one). The window is copied before it
    is indexed (one C call under the GIL), so an addition from another thread cannot break a rebuild.

    The proposals stay deterministic functions of the context and of replies already finished, so verifying them
    keeps greedy output identical and sampling exact. They also make one request's speed depend on what earlier
    requests generated: in a server shared by clients who must not learn about each other's traffic, leave it off."""

    MAX_WINDOW_TOKENS = 1 << 20

    def __init__(self, base: CorpusIndex | None, window_tokens: int, max_match: int | None = None,
                 min_match: int | None = None, full_match: int | None = None, rebuild_share: float | None = 0.1):
        if not 1 <= window_tokens <= self.MAX_WINDOW_TOKENS:
            raise ValueError(f"window_tokens must be in [1, {self.MAX_WINDOW_TOKENS}], got {window_tokens}")
        if rebuild_share is not None and not 0 < rebuild_share <= 1:
            raise ValueError(f"rebuild_share must be in (0, 1] or None, got {rebuild_share}")
        self.rebuild_share = rebuild_share
        self._dirty, self._built_at, self._build_seconds = False, 0.0, 0.0
        self.base, self.window_tokens = base, window_tokens
        defaults = (32, 2, 8) if base is None else (base.max_match, base.min_match, base.full_match)
        given = (max_match, min_match, full_match)
        self.max_match, self.min_match, self.full_match = (d if g is None else g for g, d in zip(given, defaults))
        self._recent: deque[np.ndarray] = deque()
        self._recent_tokens = 0
        self._index: CorpusIndex | None = None  # of `_recent` as last built (`recent`), None before the first
        self.added = 0  # sequences added in all

    def add(self, ids) -> None:
        """A sequence to look up in from now on (its last `window_tokens` tokens at most); the oldest go while the
        window is over its size."""
        ids = np.asarray(ids.tolist() if hasattr(ids, "tolist") else ids, dtype=np.int64).reshape(-1)
        ids = ids[-self.window_tokens:]
        if ids.size < self.min_match + 1:  # nothing to propose after a match
            return
        if ids.min() < 0:
            raise ValueError("token ids must be >= 0")
        self._recent.append(ids)
        self._recent_tokens += ids.size
        while self._recent_tokens > self.window_tokens:
            self._recent_tokens -= self._recent.popleft().size
        self._dirty = True
        self.added += 1

    @property
    def num_sequences(self) -> int:
        """Sequences indexed: the base's and the window's."""
        return (self.base.num_sequences if self.base is not None else 0) + len(self._recent)

    def __len__(self) -> int:
        """Tokens indexed: the base's and the window's."""
        return (len(self.base) if self.base is not None else 0) + self._recent_tokens

    def __repr__(self) -> str:
        return f"GrowingCorpus(base={self.base!r}, window {self._recent_tokens}/{self.window_tokens} tokens)"

    @property
    def recent(self) -> CorpusIndex | None:
        """The window's index (None while nothing was added), rebuilt after additions (see the class docstring)."""
        now = time.perf_counter()
        due = self._index is None or self.rebuild_share is None or \
            now - self._built_at >= self._build_seconds / self.rebuild_share
        if self._dirty and due and self._recent:
            self._dirty = False  # before the copy: an addition made during the build marks the window dirty again
            self._index = CorpusIndex(list(self._recent), max_match=self.max_match, min_match=self.min_match,
                                      full_match=self.full_match)
            self._index.warm()
            self._built_at = time.perf_counter()
            self._build_seconds = self._built_at - now
        return self._index

    def warm(self) -> None:
        """Build the base's suffix array and the window's index now."""
        if self.base is not None:
            self.base.warm()
        self.recent  # noqa: B018

    def lookup(self, ids, num_tokens: int) -> tuple[int, list[int], list[float]]:
        """`CorpusIndex.lookup` of the window and of the base, whichever matched the longer context suffix."""
        found = [index.lookup(ids, num_tokens) for index in (self.recent, self.base) if index is not None]
        return max(found, key=lambda f: f[0], default=(0, [], []))  # the first (the window's) on a tie

    def continuation(self, ids, num_tokens: int) -> tuple[list[int], list[float]]:
        """`CorpusIndex.continuation` over the base and the window (see the class docstring)."""
        return self.lookup(ids, num_tokens)[1:]
