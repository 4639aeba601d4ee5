"""Profile one speculative decode with torch.profiler and print where the time goes.

python bench/profile_decode.py --drafter prompt_lookup --dtype bfloat16 --max-new-tokens 128
"""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile, record_function

from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.prompts import load_prompts
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.plugins import register_builtin
from draftsmith.precision import DTYPE_CHOICES
from draftsmith.target import load_target


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    register_builtin()
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="prompt_lookup")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=0, help="MT-bench question index")
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args(argv)
    model, tokenizer = load_target("default", args.dtype)
    drafter = build_drafter(args.drafter, model) if args.drafter != "none" else None
    decoder = SpeculativeDecoder(model, drafter, tokenizer)
    question = load_prompts("mt_bench")[args.prompt]
    ids = render_prompt(tokenizer, [{"role": "user", "content": question.turns[0]}])
    decoder.generate(ids, 16)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("generate"):
            gen = decoder.generate(ids, args.max_new_tokens)
    print(
        f"{len(gen.tokens)} tokens, {gen.steps} target passes, tau {gen.acceptance_length:.2f}, "
        f"{gen.decode_seconds:.2f} s decoding"
    )
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
