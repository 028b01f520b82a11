"""Incremental detokenization: token ids in, text deltas out, safe for streaming.

Two kinds of text are held back until the following tokens decide them:
- an incomplete UTF-8 character (byte-level BPE splits one character over several
  tokens; decoding a prefix of them ends in U+FFFD);
- a suffix that could be the start of a stop string.
Decoding works on a short window of tokens (vLLM's prefix/read offsets), so each
token costs O(1) and not a decode of the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.model.interface import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context: some tokenizers (SentencePiece) render a
# token's leading space only after another token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.text = ""  # all output text emitted so far
        self._tokens = list(prompt_token_ids)
        self._prefix_offset = max(len(self._tokens) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._tokens)
        self._pending = ""  # decoded text held back for a possible stop string

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Feed the request's new output tokens; return the text they complete."""
        if self.stopped:
            return ""
        self._tokens.extend(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """End of generation: flush everything held back."""
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode_new(self, *, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self._tokens[self._prefix_offset : self._read_offset])
        full = decode(self._tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new, or an incomplete character: wait for more bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full[len(prefix) :]

    def _emit(self, delta: str, *, final: bool) -> str:
        buf = self._pending + delta
        self._pending = ""
        hit = self._find_stop(buf)
        if hit is not None:
            idx, stop = hit
            self.stopped = True
            out = buf[: idx + len(stop)] if self.include_stop_str_in_output else buf[:idx]
        else:
            keep = 0 if final else self._stop_prefix_len(buf)
            out, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if s.startswith(buf[-k:]):
                    longest = k
                    break
        return longest
