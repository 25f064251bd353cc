"""N-gram (prompt) lookup proposals, incremental: `NgramIndex`. The batched engine keeps one per request, the
`generate()` hook one per call; both calibrate a lookup's acceptance with an `AcceptanceCalibrator` whose confidence
is the matched n-gram length over the longest."""

from __future__ import annotations


class NgramIndex:
    """Prompt lookup over one request's context (prompt + generated tokens), kept up to date as tokens arrive: for
    each n <= `max_ngram`, the latest start of every n-gram followed by at least one token. A lookup then costs
    `max_ngram` dictionary probes instead of a scan of the whole context per row and step."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.ids: list[int] = []
        self.latest: list[dict] = [{} for _ in range(max_ngram + 1)]  # n -> {n-gram: latest start}

    @classmethod
    def of(cls, request, max_ngram: int) -> NgramIndex:
        """`request`'s index (kept on it), brought up to its current context."""
        index = request.ngram_index
        if index is None or index.max_ngram != max_ngram:
            index = request.ngram_index = cls(max_ngram)
        index.extend(request.prompt, request.generated)
        return index

    def extend(self, prompt: list[int], generated: list[int]) -> None:
        """Add the tokens of `prompt + generated` past those indexed already."""
        split = len(prompt)
        for t in range(len(self.ids), split + len(generated)):
            self._append(prompt[t] if t < split else generated[t - split])

    def extend_to(self, ids) -> None:
        """Bring the index up to `ids` (the whole context so far, a list or a 1-D tensor, whose first tokens are those
        indexed already)."""
        if len(ids) > len(self.ids):
            new = ids[len(self.ids):]
            for token in new.tolist() if hasattr(new, "tolist") else new:
                self._append(token)

    def _append(self, token: int) -> None:
        ids, t = self.ids, len(self.ids)
        ids.append(int(token))
        for n in range(1, min(self.max_ngram, t) + 1):  # the n-grams ending before token t: now followed
            self.latest[n][tuple(ids[t - n : t])] = t - n

    def continuation(self, num_tokens: int) -> tuple[list[int], int]:
        """`(tokens, n)`: at most `num_tokens` tokens that followed the latest earlier occurrence of the context's
        last `n` tokens, for the largest `n <= max_ngram` that occurs; `([], 0)` when none does."""
        ids, total = self.ids, len(self.ids)
        for n in range(min(self.max_ngram, total - 1), 0, -1):
            start = self.latest[n].get(tuple(ids[total - n :]))
            if start is not None:
                return ids[start + n : start + n + num_tokens], n
        return [], 0
