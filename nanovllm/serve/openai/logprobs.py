"""OpenAI's two logprobs formats, from the engine's {token_id: logprob} dict per token (the top
k, most likely first, then the sampled token when it is not among them)."""
from itertools import islice

MIN_LOGPROB = -9999.0  # JSON has no -inf (a token masked out by top_k/top_p); vLLM's stand-in


class LogprobsFormat:
    """A response's logprobs: legacy completions' parallel lists ({"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}) or chat's entries ({"content": [{"token", "logprob",
    "bytes", "top_logprobs"}]}). Token strings are each token decoded alone."""

    def __init__(self, tokenizer, chat: bool, num_top: int):
        self.tokenizer = tokenizer
        self.chat = chat
        self.num_top = num_top  # chat's top_logprobs: entries listed per token
        self._strings: dict[int, str] = {}
        self._offsets: dict[int, int] = {}  # choice index -> characters its stream has covered

    def full(self, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> dict:
        """A whole completion's logprobs."""
        if self.chat:
            return self._chat(token_ids, logprobs)
        return self._completion(token_ids, logprobs, 0)

    def delta(self, index: int, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict:
        """The logprobs of the tokens one stream chunk of choice `index` delivers; text offsets
        go on from that choice's previous chunks."""
        if self.chat:
            return self._chat(token_ids, logprobs)
        body = self._completion(token_ids, logprobs, self._offsets.get(index, 0))
        if body["tokens"]:
            self._offsets[index] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def token(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self.tokenizer.decode([token_id])
        return text

    def _completion(self, token_ids: list[int], logprobs: list[dict[int, float]],
                    offset: int) -> dict:
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        # vLLM's shape: every entry of the engine's dict, so the sampled token is always there;
        # None for an echoed prompt's first token, which nothing predicts
        top = [None if entry is None else {self.token(t): finite(lp) for t, lp in entry.items()}
               for entry in logprobs]
        return {"tokens": tokens,
                "token_logprobs": [None if entry is None else finite(entry[t])
                                   for t, entry in zip(token_ids, logprobs)],
                "top_logprobs": top, "text_offset": offsets}

    def _chat(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict:
        # OpenAI's shape: exactly the top k (the dict's first k entries), sampled or not
        return {"content": [
            {**self._entry(t, entry[t]),
             "top_logprobs": [self._entry(i, lp) for i, lp in islice(entry.items(), self.num_top)]}
            for t, entry in zip(token_ids, logprobs)]}

    def prompt(self, logprobs: list[dict[int, float] | None], num_top: int
               ) -> list[dict[int, dict] | None]:
        """vLLM's prompt_logprobs: per prompt token (the first None) {token id: {"logprob",
        "rank", "decoded_token"}}, the top num_top and the prompt's own token. rank is None
        for an own token outside the top num_top (the engine does not rank it)."""
        return [None if entry is None else {
            t: {"logprob": finite(lp), "rank": rank + 1 if rank < num_top else None,
                "decoded_token": self.token(t)}
            for rank, (t, lp) in enumerate(entry.items())} for entry in logprobs]

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": finite(logprob),
                "bytes": list(text.encode("utf-8", errors="replace"))}


def finite(logprob: float) -> float:
    """The logprob, with -inf (and NaN) as MIN_LOGPROB."""
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB
