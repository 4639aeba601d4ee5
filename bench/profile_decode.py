"""Profile one speculative decode with torch.profiler and print where the time goes.

python bench/profile_decode.py --drafter prompt_lookup --dtype bfloat16 --max-new-tokens 128

:func:`step_phases` splits a generation's time per decode step by the engine's own profiler ranges
(``draft``, ``target_forward``, ``verify``, ``read_back``, ``commit``, ``draft_accept``).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.prompts import load_prompts
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.target_runner import CUDA_GRAPHS
from draftsmith.precision import DTYPE_CHOICES
from draftsmith.target import load_target

PHASES = ("draft", "target_forward", "verify", "read_back", "commit", "draft_accept")


def step_phases(decoder: SpeculativeDecoder, ids: list[int], max_new_tokens: int) -> dict:
    """Milliseconds per decode step of one generation, by engine phase: ``host`` is the time the
    host spends in each range (on a GPU it launches work there, and ``read_back`` waits for the
    device), ``device`` the kernels' own time launched from it (0 on a CPU), and ``device_idle`` the
    share of the step's wall-clock in which the device ran nothing (host-bound time)."""
    activities = [ProfilerActivity.CPU]
    cuda = next(decoder.runner.model.parameters()).is_cuda
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        gen = decoder.generate(ids, max_new_tokens)
    steps = max(gen.steps, 1)
    events = {e.key: e for e in prof.key_averages() if e.key in PHASES}
    host = {name: events[name].cpu_time_total / 1e3 / steps for name in PHASES if name in events}
    device = {name: events[name].device_time_total / 1e3 / steps for name in PHASES if name in events}
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps if cuda else 0.0
    wall = gen.decode_seconds * 1e3 / steps
    return {
        "steps": gen.steps,
        "tokens_per_step": round(gen.acceptance_length, 3),
        "wall_ms_per_step": round(wall, 3),
        "host_ms_per_step": {k: round(v, 3) for k, v in host.items()},
        "device_ms_per_step": {k: round(v, 3) for k, v in device.items()},
        "device_busy_ms_per_step": round(kernels, 3),
        "device_idle": round(max(0.0, 1 - kernels / wall), 3) if cuda and wall else None,
        "profiled_on": "cuda" if cuda else "cpu",
        "torch": torch.__version__,
    }


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="prompt_lookup")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=0, help="MT-bench question index")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--cuda-graphs", default="auto", choices=CUDA_GRAPHS, help="as eval/run.py's")
    args = parser.parse_args(argv)
    model, tokenizer = load_target("default", args.dtype)
    drafter = build_drafter(args.drafter, model) if args.drafter != "none" else None
    decoder = SpeculativeDecoder(model, drafter, tokenizer, cuda_graphs=args.cuda_graphs)
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
