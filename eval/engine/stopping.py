"""When a generation must stop: EOS tokens and stop strings, checked on each step's new tokens only.

Decoding the whole generation at every candidate end costs O(N^2) over a generation. A stop
string that first appears once token ``end`` is added must end inside that token's text, so it
lies within the last few tokens: decoding a window of ``4 * len(stop) + 4`` tokens (a character
is at most 4 bytes, every token at least one) finds it, and the window's possibly cut first
character (a partial UTF-8 sequence, a dropped leading space) lies before any new occurrence.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class StopChecker:
    """Finds the earliest stop in the tokens a step added."""

    def __init__(
        self, eos_ids: set[int], stop_strings: tuple[str, ...] = (), tokenizer: PreTrainedTokenizerBase | None = None
    ):
        self.eos_ids = eos_ids
        self.stop_strings = stop_strings if tokenizer is not None else ()
        self.tokenizer = tokenizer
        self.window = 4 * max((len(s) for s in self.stop_strings), default=0) + 4

    def check(self, tokens: list[int], base: int, scanned: int) -> tuple[int | None, str]:
        """Number of new tokens (``tokens[base:]``) to keep if generation must stop, and why (the
        earliest stop wins); the first ``scanned`` new tokens were checked before."""
        eos = next((i + 1 - base for i in range(base + scanned, len(tokens)) if tokens[i] in self.eos_ids), None)
        if self.stop_strings:
            # Only before the EOS: a stop string completed earlier in the step ends it there.
            for end in range(max(scanned, 1), eos if eos is not None else len(tokens) - base + 1):
                text = self.tokenizer.decode(tokens[base + max(0, end - self.window) : base + end])
                if any(s in text for s in self.stop_strings):
                    return end, "stop_string"
        if eos is not None:
            return eos, "eos"
        return None, "length"
