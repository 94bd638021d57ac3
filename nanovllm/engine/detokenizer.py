"""Incremental detokenisation for streaming: each piece is what the completion's text gained."""


class IncrementalDetokenizer:
    """Turns a growing completion into text pieces that concatenate to the final text.

    Each update decodes a window: the last settled piece's tokens (context, so that a tokenizer
    that drops a leading space or joins bytes decodes as in the whole text) plus the new ones,
    and settles the new suffix unless it ends in U+FFFD (an incomplete character). With stop
    strings, the last max(len(stop)) - 1 characters are held back. `start`: where the completion
    begins in the token lists given."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), start: int = 0,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max(map(len, stop), default=1) - 1
        self.text = ""  # sent so far
        self.decoded = ""  # the text of the settled tokens
        # token offsets from `start`: the window's context begins at _prefix; settled: _read
        self._start, self._prefix, self._read = start, 0, 0
        self._prefix_text = ""  # the decode of the context alone

    def update(self, token_ids: list[int]) -> str:
        """The new text, given every completion token so far ("" while held back)."""
        self.read(token_ids)
        end = len(self.decoded) - self.holdback
        if end <= len(self.text) or not self.decoded.startswith(self.text):
            return ""
        piece = self.decoded[len(self.text):end]
        self.text += piece
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (cut before a stop string), held back or not."""
        piece = final_text[len(self.text):] if final_text.startswith(self.text) else ""
        self.text += piece
        return piece

    def read(self, token_ids: list[int]) -> None:
        """Settle the text of the tokens past the last settled ones into `decoded`."""
        num_tokens = len(token_ids) - self._start
        if num_tokens <= self._read:
            return
        window = self._decode(token_ids[self._start + self._prefix:])
        # Wait for a character's last bytes, and keep the context until the window gains text:
        # a token that decodes to "" must not become the context (a SentencePiece-style decoder
        # drops the leading space of the window's first token).
        if window.endswith("\ufffd") or len(window) <= len(self._prefix_text):
            return
        if window.startswith(self._prefix_text):
            self.decoded += window[len(self._prefix_text):]
        else:  # a tokenizer whose decoding of the context changed: the whole text, once
            self.decoded = self._decode(token_ids[self._start:])
        self._prefix, self._read = self._read, num_tokens
        self._prefix_text = self._decode(
            token_ids[self._start + self._prefix:self._start + self._read])

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
