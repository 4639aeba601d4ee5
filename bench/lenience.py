"""What lenient (lossy) verification buys and what it costs, computed exactly.

At a position where the drafter proposes one token from q and the target's distribution is p,
lenience l accepts with probability sum_x min(q(x), p(x) / l) and emits a token distributed as
``eval.verify.lenient_distribution(p, q, l)`` (tests/test_policies.py checks the sampler against
it). This script enumerates that, with no sampling noise, over:

- a small enumerable case: tiny random target and draft (vocabulary 8) over every 3-token context;
- the bundled target with a draft LM (``--draft``, e.g. a train/distill.py student) at every
  position of its own greedy answers to MT-bench questions,

and prints, per lenience, the mean acceptance probability of a drafted token and the mean total
variation distance between the emitted token's distribution and the target's (0 when lossless).

    python bench/lenience.py --draft runs/distill6/checkpoint-final --per-category 1 --max-new-tokens 128
"""

from __future__ import annotations

import itertools

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.prompts import MT_BENCH, load_prompts
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.sampling import SamplingConfig, probabilities
from draftsmith.eval.engine.verify import lenient_distribution
from draftsmith.heads.draft_lm import load_draft_lm
from draftsmith.target import load_target


def shift(p: torch.Tensor, q: torch.Tensor, lenience: float) -> tuple[float, float]:
    """Mean (acceptance probability, total variation to p) over the rows of ``p`` and ``q``."""
    accepted = torch.minimum(q, p / lenience).sum(-1)
    tv = 0.5 * (lenient_distribution(p, q, lenience) - p).abs().sum(-1)
    return accepted.mean().item(), tv.mean().item()


def tiny_case(vocab: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token distributions after every 3-token context of a tiny vocabulary:
    the pair the statistical tests use (random Llamas whose weights, norms aside, are scaled by 15
    and 8 so that their distributions are peaked and context-dependent)."""

    def model(seed: int, scale: float) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.mul_(scale)
        return model

    contexts = torch.tensor(list(itertools.product(range(vocab), repeat=3)))
    with torch.no_grad():
        return tuple(
            model(seed, scale)(contexts).logits[:, -1].double().softmax(-1) for seed, scale in ((0, 15.0), (1, 8.0))
        )


@torch.no_grad()
def real_case(target, tokenizer, draft, prompts, max_new_tokens: int, sampling: SamplingConfig):
    """Target and draft distributions (warped by ``sampling``) at every position of the target's
    greedy answers to ``prompts``."""
    decoder = SpeculativeDecoder(target, None, tokenizer)
    ps, qs = [], []
    for prompt in prompts:
        ids = render_prompt(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        answer = decoder.generate(ids, max_new_tokens).tokens
        sequence = torch.tensor([ids + answer])
        rows = slice(len(ids) - 1, sequence.shape[1] - 1)
        ps.append(probabilities(target(sequence).logits[0, rows].float(), sampling).double())
        qs.append(probabilities(draft(sequence.to(draft.device)).logits[0, rows].float(), sampling).double())
    return torch.cat(ps), torch.cat(qs)


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--draft",
        default=None,
        help="draft LM folder (e.g. a train/distill.py checkpoint); without it only the tiny case runs",
    )
    parser.add_argument("--target", default="default")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lenience", default="1,0.9,0.8,0.7,0.5,0.3")
    args = parser.parse_args(argv)
    values = [float(v) for v in args.lenience.split(",")]
    cases = {"tiny (V=8, every 3-token context)": tiny_case()}
    if args.draft:
        target, tokenizer = load_target(args.target, "float32", None)
        draft = load_draft_lm(args.draft, torch.float32, "cpu")
        prompts = load_prompts(MT_BENCH, per_category=args.per_category)
        cases[f"bundled target + {args.draft}, T={args.temperature:g}"] = real_case(
            target, tokenizer, draft, prompts, args.max_new_tokens, SamplingConfig(args.temperature)
        )
    print("| case | lenience | P(accept a drafted token) | gain over lossless | TV(emitted, target) |")
    print("|---|---|---|---|---|")
    for name, (p, q) in cases.items():
        lossless, _ = shift(p, q, 1.0)
        for lenience in values:
            accepted, tv = shift(p, q, lenience)
            print(
                f"| {name} ({len(p)} positions) | {lenience:g} | {accepted:.3f} | "
                f"{accepted / lossless:.2f}x | {tv:.4f} |"
            )


if __name__ == "__main__":
    main()
