"""Incremental detokenization: token ids in, text deltas out, safe for streaming.

Two kinds of text are held back until the following tokens decide them:
- an incomplete UTF-8 character (byte-level BPE splits one character over several
  tokens; decoding a prefix of them ends in U+FFFD);
- a suffix that could be the start of a stop string.
Decoding costs O(1) per token, not a decode of the whole output: with a
``tokenizers`` tokenizer underneath, its ``DecodeStream`` (this class: 1.95 us per
token on SmolLM2's vocabulary against 2.54 us with window decoding; docs/model.md);
otherwise decoding of a short window of tokens (vLLM's prefix/read offsets), which
also flushes what a stream still holds when generation ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HfTokenizer
from tokenizers.decoders import DecodeStream

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
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        # vLLM's min_tokens: stop strings are looked for once more tokens than this are
        # out (text held back before then can still complete one).
        self.min_tokens = min_tokens
        self._num_out = 0
        self.stopped = False
        self.text = ""  # all output text emitted so far
        self._tokens = list(prompt_token_ids)
        self._prefix_offset = max(len(self._tokens) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._tokens)
        self._pending = ""  # decoded text held back for a possible stop string
        raw = getattr(tokenizer, "tok", None)
        self._raw: HfTokenizer | None = raw if isinstance(raw, HfTokenizer) else None
        self._stream: DecodeStream | None = None
        if self._raw is not None:
            context = self._tokens[self._prefix_offset :]
            self._stream = DecodeStream(ids=context, skip_special_tokens=True)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Feed the request's new output tokens; return the text they complete."""
        if self.stopped:
            return ""
        self._tokens.extend(new_token_ids)
        self._num_out += len(new_token_ids)
        raw = self._raw
        if self._stream is None or raw is None:
            return self._emit(self._decode_new(final=False), final=False)
        parts, flushed = [], None
        for k, t in enumerate(new_token_ids):
            chunk = self._stream.step(raw, t)
            if chunk is not None:
                parts.append(chunk)
                flushed = k
        if flushed is not None:
            # The stream's text covers every token up to here; finish() decodes the
            # rest (an incomplete character at the end) with the window method.
            self._read_offset = len(self._tokens) - len(new_token_ids) + flushed + 1
            self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        return self._emit("".join(parts), final=False)

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
        hit = self._find_stop(buf) if self._num_out > self.min_tokens else None
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
