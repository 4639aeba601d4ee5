"""SuffixDecoding: suffix trees over the prompt, the output and earlier outputs (training-free,
through arctic-inference as vLLM's ``suffix`` method); nothing to export."""

from __future__ import annotations

from draftsmith.config import COUNT, Range
from draftsmith.eval.engine.drafters import suffix
from draftsmith.kinds import DrafterKind, Option

KIND = DrafterKind(
    name="suffix",
    summary="SuffixDecoding (Arctic Inference): frequency-scored suffix-tree drafts over the prompt, "
    "the output so far and earlier outputs (training-free; vLLM's suffix method)",
    build=suffix.build,
    options={
        "num_tokens": Option(24, "most tokens drafted per step (vLLM: num_speculative_tokens)", COUNT),
        "max_depth": Option(
            24, "longest suffix matched and pattern cached (vLLM: suffix_decoding_max_tree_depth)", COUNT
        ),
        "max_cached_requests": Option(
            10000,
            "earlier outputs kept in the global suffix tree, FIFO; 0: prompt and output only "
            "(vLLM: suffix_decoding_max_cached_requests)",
            Range(0, integer=True),
        ),
        "max_spec_factor": Option(
            1.0, "draft at most this many tokens per matched token (vLLM: suffix_decoding_max_spec_factor)", Range(0)
        ),
        "max_spec_offset": Option(0.0, "tokens added to that cap (may be negative)", Range()),
        "min_token_prob": Option(
            0.1,
            "stop at nodes whose estimated probability is below this (vLLM: suffix_decoding_min_token_prob)",
            Range(0, 1),
        ),
        "shape": Option("path", "path (as vLLM verifies) or tree: the library's best-first tree"),
    },
)
