"""Everything textual the engine does not know of: TGI's incremental detokenisation (`TextStream`: a token's text,
stop strings matched on the decoded text in time linear in it, OpenAI's stop-safe deltas) and the checks on text that
comes over the wire (`check_text`, `message_text`)."""

from __future__ import annotations

from .errors import ValidationError


def check_text(text: str, name: str) -> str:
    """`text` if it is valid Unicode (JSON can carry lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"`{name}` is not valid Unicode text ({exc.reason} at position {exc.start})") from None
    return text


def message_text(content) -> str | None:
    """A chat message's text: a string, or the concatenated `text` of its `{"type": "text"}` parts."""
    if content is None or isinstance(content, str):
        return None if content is None else check_text(content, "content")
    parts = []
    for part in content:
        if part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise ValidationError("a `text` content part needs a string `text`")
            parts.append(check_text(part["text"], "content"))
    return "".join(parts)


class TextStream:
    """TGI's incremental detokenisation: a token's text is what decoding it adds to the text of the tokens before
    it (five tokens of context), and stays empty while the text ends in an incomplete UTF-8 character. Special
    tokens keep their text on the wire but are left out of the visible text, which is where stop strings are looked
    for. Each token costs time in its own text plus the longest stop string, never in the text so far: stops are
    searched in a window (the visible text's last `longest - 1` characters, where a stop may still start, plus the new
    text) and the visible text is kept in pieces, joined once."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], special_ids: frozenset[int]):
        self.tokenizer, self.stops, self.special_ids = tokenizer, stops, special_ids
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.generated: list[int] = []
        self.stop_span: tuple[int, int] | None = None  # where the first stop string sits in `visible`
        self._keep = max(map(len, stops), default=1) - 1  # characters a stop may span before a new piece
        self._pieces: list[str] = []  # the visible text
        self._size = 0  # its length
        self._window = ""  # its last `_keep` characters
        self._unsent: list[str] = []  # visible text not yet sent as OpenAI deltas (some of the last pieces)

    @property
    def visible(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int, logprob: float) -> dict:
        """The next token as TGI's `{id, text, logprob, special}`; sets `stop_span` when a stop string completes."""
        self.ids.append(token_id)
        self.generated.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            text = text[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        else:
            text = ""
        special = token_id in self.special_ids
        if text and not special:
            window, base = self._window + text, self._size - len(self._window)  # base: the window's offset
            hits = [(base + i, base + i + len(s)) for s in self.stops if (i := window.find(s)) >= 0]
            self.stop_span = min(hits) if hits else None
            self._pieces.append(text)
            self._unsent.append(text)
            self._size += len(text)
            self._window = window[max(0, len(window) - self._keep):] if self._keep else ""
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def final_text(self, openai: bool = False) -> str:
        """The generated text: TGI keeps a stop string (and cuts what follows it), OpenAI drops it."""
        if self.stop_span is not None:
            return self.visible[:self.stop_span[0] if openai else self.stop_span[1]]
        return self.tokenizer.decode(self.generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _held(self) -> int:
        """The length of the longest end of the visible text that begins a stop string (it may still grow into one)."""
        held = 0
        for stop in self.stops:
            held = next((k for k in range(min(len(stop) - 1, len(self._window)), held, -1)
                         if self._window.endswith(stop[:k])), held)
        return held

    def openai_delta(self, final: bool = False) -> str:
        """New visible text safe to stream under OpenAI semantics: nothing from a stop string on, and while not
        `final`, nothing that might still grow into one."""
        unsent = "".join(self._unsent)
        if self.stop_span is not None:
            end = self.stop_span[0] - (self._size - len(unsent))  # the stop's start, in `unsent`
        elif final:
            end = len(unsent)
        else:
            end = len(unsent) - self._held()
        delta, rest = unsent[:max(end, 0)], unsent[max(end, 0):]
        self._unsent = [rest] if rest else []
        return delta
