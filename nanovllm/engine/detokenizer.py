"""Incremental detokenisation for streaming: each piece is what the completion's text gained."""


class IncrementalDetokenizer:
    """Turns a growing completion into text pieces that concatenate to the final text.

    Each update decodes the whole completion (simple and exact for byte-level BPE, where one
    character's bytes may span tokens) and emits the new suffix, unless the text ends in U+FFFD
    (a character still incomplete). With stop strings, the last max(len(stop)) - 1 characters
    are held back: they may begin a stop string, which the final text will not contain.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.holdback = max(map(len, stop), default=1) - 1
        self.text = ""  # sent so far

    def update(self, token_ids: list[int]) -> str:
        """The new text, given every completion token so far ("" while held back)."""
        text = self.tokenizer.decode(token_ids)
        end = len(text) - self.holdback
        if end <= len(self.text) or text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        piece = text[len(self.text):end]
        self.text += piece
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (cut before a stop string), held back or not."""
        piece = final_text[len(self.text):] if final_text.startswith(self.text) else ""
        self.text += piece
        return piece
