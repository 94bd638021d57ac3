"""Incremental detokenisation for streaming: each piece is what the completion's text gained."""


class IncrementalDetokenizer:
    """Turns a growing completion into text pieces that concatenate to the final text.

    Each update decodes a window: the tokens of the last settled piece (context, so that a
    tokenizer that drops a leading space or joins bytes decodes them as it would in the whole
    text) plus the new ones, and settles the new suffix unless it ends in U+FFFD (a character
    still incomplete). The work per update is the window's, not the completion's. With stop
    strings, the last max(len(stop)) - 1 characters are held back: they may begin a stop
    string, which the final text will not contain.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.holdback = max(map(len, stop), default=1) - 1
        self.text = ""  # sent so far
        self._decoded = ""  # the text of the settled tokens
        self._prefix = self._read = 0  # the window's context starts at _prefix; settled: _read
        self._prefix_text = ""  # decode(token_ids[_prefix:_read])

    def update(self, token_ids: list[int]) -> str:
        """The new text, given every completion token so far ("" while held back)."""
        if len(token_ids) > self._read:
            self._settle(token_ids)
        end = len(self._decoded) - self.holdback
        if end <= len(self.text) or not self._decoded.startswith(self.text):
            return ""
        piece = self._decoded[len(self.text):end]
        self.text += piece
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (cut before a stop string), held back or not."""
        piece = final_text[len(self.text):] if final_text.startswith(self.text) else ""
        self.text += piece
        return piece

    def _settle(self, token_ids: list[int]) -> None:
        window = self.tokenizer.decode(token_ids[self._prefix:])
        if window.endswith("\ufffd"):  # wait for the character's last bytes
            return
        if window.startswith(self._prefix_text):
            self._decoded += window[len(self._prefix_text):]
        else:  # a tokenizer whose decoding of the context changed: the whole text, once
            self._decoded = self.tokenizer.decode(token_ids)
        self._prefix, self._read = self._read, len(token_ids)
        self._prefix_text = self.tokenizer.decode(token_ids[self._prefix:self._read])
