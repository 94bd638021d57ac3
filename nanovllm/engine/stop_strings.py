"""Stop strings: incremental detokenisation, kept only for sequences that have stop strings."""
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.sequence import Sequence


class StopStringChecker:
    """Decodes each sequence's newest tokens and looks for its stop strings in the new text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[int, IncrementalDetokenizer] = {}

    def check(self, seq: Sequence) -> str | None:
        """The completion text before the first stop string that now appears (through it with
        include_stop_str_in_output), else None. A token that stopped the sequence (EOS,
        stop_token_ids, a grammar's end) is left out, as from its text (vLLM)."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, start=seq.num_prompt_tokens,
                skip_special_tokens=seq.sampling_params.skip_special_tokens)
        old_len = len(state.decoded)
        stopped_by_token = seq.is_finished and seq.finish_reason == "stop"
        state.read(seq.token_ids[:-1] if stopped_by_token else seq.token_ids)
        # vLLM: text of the first min_tokens tokens is never searched (a match may end after);
        # token_ids: the committed tokens, which the text covers
        if (len(state.decoded) == old_len
                or len(seq.token_ids) - seq.num_prompt_tokens <= seq.sampling_params.min_tokens):
            return None
        found = []
        for stop in seq.sampling_params.stop_strings:
            # only matches that end in the new text are new; earlier text was checked before
            i = state.decoded.find(stop, max(0, old_len - len(stop) + 1))
            if i != -1:
                found.append((i, i + len(stop)))
        if not found:
            return None
        start, end = min(found)
        return state.decoded[:end if seq.sampling_params.include_stop_str_in_output else start]

    def forget(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def finish_stopped(self, seqs: list[Sequence], finish) -> list[Sequence]:
        """Finish (finish(seq, "stop")) the sequences whose text now holds a stop string;
        returns those newly finished. "stop" wins over EOS or length on the same step."""
        newly_finished = []
        for seq in seqs:
            if not seq.sampling_params.stop:  # the common path decodes nothing
                continue
            text = self.check(seq)
            if text is not None:
                seq.text = text
                if not seq.is_finished:
                    newly_finished.append(seq)
                finish(seq, "stop")
            if seq.is_finished:
                self.forget(seq)
        return newly_finished
