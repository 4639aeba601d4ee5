"""How strong the suite's statistical tests are at their sample sizes: each chi-square test's
statistic over its threshold, with the verifier as it is and with a subtle bug planted.

The bug is test_sampling_lossless's own negative control: after a rejection, resample from p
instead of the residual max(p - q, 0). Each end-to-end test (its drafter, prompt, length and
sampling, as in ``tests/``: every kind's, test_sampling_lossless's and test_policies') draws
``--samples`` seeded generations; the one-step tests of ``verify_sampling`` draw ``--one-step``
verifications per candidate layout. A ratio above 1 fails the test. ``--planted-only`` skips the
correct run (the tests themselves make it), ``--only`` runs the cases whose name contains it.

    python bench/sampling_power.py --samples 2000 --one-step 5000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_dflash  # noqa: E402
import test_dspark  # noqa: E402
import test_eagle3  # noqa: E402
import test_eagle_drafter  # noqa: E402
import test_medusa  # noqa: E402
import test_peagle  # noqa: E402
import test_policies  # noqa: E402
import test_sampling_lossless  # noqa: E402
from conftest import pair_draft, pair_target, tiny_llama  # noqa: E402
from stats_helpers import target_chi_square  # noqa: E402
from test_sampling_lossless import PROMPT, V, one_step_chi_square  # noqa: E402

import draftsmith.eval.engine.verify as verify_module  # noqa: E402
from draftsmith.eval.engine.drafters.dflash import DFlashDrafter  # noqa: E402
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter  # noqa: E402
from draftsmith.eval.engine.drafters.dspark import DSparkDrafter  # noqa: E402
from draftsmith.eval.engine.drafters.eagle import EagleDrafter  # noqa: E402
from draftsmith.eval.engine.drafters.medusa import MedusaDrafter  # noqa: E402
from draftsmith.eval.engine.drafters.peagle import PEagleDrafter  # noqa: E402
from draftsmith.eval.engine.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from draftsmith.eval.engine.sampling import SamplingConfig  # noqa: E402
from draftsmith.timing import clock  # noqa: E402

REJECT = verify_module._reject


def keep_p(r, z, q, c, *args):
    """The planted bug: q loses the rejected token, p stays as it was."""
    return r, z, REJECT(r.clone(), z, q, c, *args)[2]


def medusa_case() -> tuple:
    """Medusa's target and heads, the heads drawn right after the target's seeded init (as in the test)."""
    target = pair_target()
    heads = test_medusa.perturbed_heads(target)
    return target, lambda: MedusaDrafter(heads, test_medusa.SAMPLING_CHOICES)


def end_to_end_cases() -> dict:
    """Each end-to-end sampling test: (target, drafter factory, prompt, sampling), as the test files build them."""
    one, draft, middle = pair_target(), pair_draft(), test_policies.middle_draft(tiny_llama)
    three = tiny_llama(vocab_size=V, hidden_size=32, layers=3, seed=0, scale=15.0)
    reduced, masked = [0, 2, 3, 5, 6], [0, 2, 3, 5, 6, 7]
    t1 = SamplingConfig(1.0)
    cases = {
        "EAGLE-1, full vocabulary": (
            one,
            lambda: EagleDrafter(test_eagle_drafter._tiny_head(one, "random"), depth=2, top_k=2, budget=4),
        ),
        "EAGLE-1, reduced vocabulary": (
            one,
            lambda: EagleDrafter(test_eagle_drafter._tiny_head(one, "random", reduced), depth=2, top_k=2, budget=4),
        ),
        "EAGLE-3, reduced vocabulary": (
            three,
            lambda: EagleDrafter(test_eagle3._head3(three, "identity", reduced), depth=2, top_k=2, budget=4),
        ),
        "P-EAGLE": (
            three,
            lambda: PEagleDrafter(test_peagle._head(three, mask=7, draft_vocab=masked, init="identity"), depth=3),
        ),
        "DFlash": (three, lambda: DFlashDrafter(test_dflash._head(three, mask=7, block=3, draft_vocab=masked))),
        "DSpark (confidence cut)": (
            three,
            lambda: DSparkDrafter(
                test_dspark._head(three, mask=7, block=3, draft_vocab=masked, seed=2), cut="threshold", threshold=0.3
            ),
        ),
        "Medusa": medusa_case(),
        "draft LM, chain": (one, lambda: DraftLMDrafter(draft, depth=2, top_k=1)),
        "draft LM, chain, reduced draft vocabulary": (
            one,
            lambda: DraftLMDrafter(draft, depth=2, top_k=1, draft_vocab=torch.tensor([1, 2, 4, 6])),
        ),
        "draft LM, pruned tree": (one, lambda: DraftLMDrafter(draft, depth=2, top_k=3, budget=4)),
        "deterministic siblings": (one, test_sampling_lossless.FixedTreeDrafter),
        "prompt lookup branches": (
            one,
            lambda: PromptLookupDrafter(num_tokens=2, max_ngram=2, min_ngram=1, branches=3),
            test_sampling_lossless.BRANCHING_PROMPT,
        ),
        "draft LM, warped": (
            one,
            lambda: DraftLMDrafter(draft, depth=2, top_k=2, budget=4),
            PROMPT,
            test_sampling_lossless.WARPED,
        ),
    }
    for mode in ("merge", "switch"):
        cases[f"hybrid ({mode})"] = (one, lambda m=mode: test_sampling_lossless.hybrid_of_lookups(draft, m))
    for name in ("entropy", "entropy_tree", "confidence", "hierarchical"):
        cases[f"policy {name}"] = (one, lambda k=name: test_policies.policy_drafters(one, draft, middle)[k])
    cases["hierarchical, always drafting"] = (one, lambda: test_policies.always_drafting(draft, middle))
    return {name: (case + (PROMPT, t1)[len(case) - 2 :]) for name, case in cases.items()}


def end_to_end_ratio(target, drafter, n: int, prompt: list[int], sampling: SamplingConfig) -> float:
    statistic, threshold, _ = target_chi_square(target, drafter, prompt, 4, n, sampling)
    return statistic / threshold


def one_step_ratio(layout: str, n: int) -> float:
    """test_verify_sampling_emits_p's case ``layout``: the emitted token against p."""
    statistic, threshold = one_step_chi_square(layout, n)
    return statistic / threshold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000, help="generations per end-to-end test")
    parser.add_argument("--one-step", type=int, default=5000, help="verifications per one-step test")
    parser.add_argument("--planted-only", action="store_true", help="only the run with the bug planted")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, (target, make, prompt, sampling) in end_to_end_cases().items():
        rows.append(
            (
                f"{name} ({args.samples} generations)",
                lambda t=target, m=make, p=prompt, s=sampling: end_to_end_ratio(t, m(), args.samples, p, s),
            )
        )
    for layout in ("single", "three_without_replacement", "pruned", "deterministic"):
        rows.append(
            (f"verify_sampling, {layout} ({args.one_step} draws)", lambda k=layout: one_step_ratio(k, args.one_step))
        )
    print("| test | statistic / threshold, correct | with the bug | seconds |\n|---|---:|---:|---:|")
    for name, run in rows:
        if args.only not in name:
            continue
        start = clock("cpu")
        ratios = [float("nan")] if args.planted_only else []
        for bug in (True,) if args.planted_only else (False, True):
            verify_module._reject = keep_p if bug else REJECT
            try:
                ratios.append(run())
            finally:
                verify_module._reject = REJECT
        print(f"| {name} | {ratios[0]:.2f} | {ratios[1]:.2f} | {clock('cpu') - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
