"""Stop strings: incremental detokenisation, kept only for sequences that have stop strings."""
from dataclasses import dataclass

from nanovllm.engine.sequence import Sequence


@dataclass
class _Detokenized:
    """Completion text so far; token offsets are relative to the completion's start."""

    text: str = ""
    prefix_offset: int = 0  # first token of the window re-decoded each step (a char boundary)
    read_offset: int = 0  # tokens up to here are already in `text`


class StopStringChecker:
    """Decodes only each sequence's newest tokens and looks for its stop strings there.

    Decoding the window [prefix_offset:] and dropping the text of [prefix_offset:read_offset]
    gives the new characters even when a character's bytes span tokens (byte-level BPE):
    while the window ends in U+FFFD (an unfinished character) it waits for more tokens.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[int, _Detokenized] = {}

    def check(self, seq: Sequence) -> str | None:
        """Decode seq's new tokens; if a stop string now appears (a match may span tokens),
        the completion text before it, else None."""
        state = self.states.setdefault(seq.seq_id, _Detokenized())
        start = seq.num_prompt_tokens
        window = seq.token_ids[start + state.prefix_offset:]
        num_read = state.read_offset - state.prefix_offset
        prefix_text = self.tokenizer.decode(window[:num_read])
        new_text = self.tokenizer.decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        old_len = len(state.text)
        state.text += new_text[len(prefix_text):]
        state.prefix_offset, state.read_offset = state.read_offset, len(seq) - start
        found = []
        for stop in seq.sampling_params.stop_strings:
            # only matches that end in the new text are new; earlier text was checked before
            i = state.text.find(stop, max(0, old_len - len(stop) + 1))
            if i != -1:
                found.append(i)
        return state.text[:min(found)] if found else None

    def forget(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
