"""vLLM jobs of ``bench/peer_trainers.py``, run in vLLM's child process (``draftsmith.vllm_engine``).

The parent puts this folder on ``PYTHONPATH`` and names the jobs ``peer_vllm:extract`` and
``peer_vllm:score``.

- ``extract``: the target's hidden states of every conversation, captured by vLLM's
  ``extract_hidden_states`` method and written by draftsmith's connector
  (:mod:`draftsmith.hidden_states_connector`), kept in speculators' offline layout:
  ``HS_DIR/hs_{i}.safetensors`` holding ``hidden_states`` ``[tokens, captured layers, hidden]`` (the
  aux layers ascending, then layer N, the last, before the final norm) and ``token_ids``. This is the
  file speculators' ``FileTransfer`` reads; draftsmith's feature store is written from the same files
  (``bench/peer_trainers.py``). Resumable: a file already there is skipped.
- ``score``: greedy decoding of token-id prompts with one speculative config, one prompt at a time, and
  vLLM's speculative-decoding counters read around each prompt: drafts, accepted drafts and accepted
  drafts per position, per prompt (what a paired bootstrap over prompts needs).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.data_prep.vllm_features import written_states


def extract(job: dict) -> dict:
    """Write ``hs_{i}.safetensors`` under ``job["hs_dir"]`` for ``job["conversations"]`` (token-id
    lists, file index = list index); returns what it wrote and the layer ids captured."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import cleanup_hidden_states
    from vllm.inputs import TokensPrompt

    out = Path(job["hs_dir"])
    out.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(len(job["conversations"])) if not (out / f"hs_{i}.safetensors").is_file()]
    if not todo:
        return {"written": 0, "layer_ids": job["layer_ids"]}
    llm = LLM(**job["engine"])
    params = SamplingParams(max_tokens=1, detokenize=False)
    layer_ids = None
    chunk = job.get("chunk", 16)
    for start in range(0, len(todo), chunk):
        picked = todo[start : start + chunk]
        prompts = [TokensPrompt(prompt_token_ids=job["conversations"][i]) for i in picked]
        for i, output in zip(picked, llm.generate(prompts, params, use_tqdm=False)):
            path = output.kv_transfer_params["hidden_states_path"]
            saved = written_states(llm, path)
            cleanup_hidden_states(path)
            if saved["token_ids"].tolist() != job["conversations"][i]:
                raise RuntimeError(f"vLLM wrote the states of other tokens than conversation {i}'s ({path})")
            if "layer_ids" in saved:
                layer_ids = [int(x) for x in saved["layer_ids"].tolist()]
            tmp = out / f"hs_{i}.safetensors.tmp"
            save_file(
                {"hidden_states": saved["hidden_states"].contiguous(), "token_ids": saved["token_ids"].contiguous()},
                str(tmp),
            )
            os.replace(tmp, out / f"hs_{i}.safetensors")
        print(f"extracted {min(start + chunk, len(todo))}/{len(todo)} conversations", flush=True)
    return {"written": len(todo), "layer_ids": layer_ids or job["layer_ids"]}


def score(job: dict) -> dict:
    """Per prompt: vLLM's output tokens, drafts, accepted drafts and accepted drafts per position."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from draftsmith.vllm_engine import spec_counters

    llm = LLM(**job["engine"])
    params = SamplingParams(
        temperature=0.0,
        max_tokens=job["max_new_tokens"],
        stop_token_ids=job.get("stop_token_ids"),
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)  # warm-up
    first = spec_counters(llm)
    rows = []
    for prompt in prompts:
        before = spec_counters(llm)
        done = llm.generate([prompt], params, use_tqdm=False)
        after = spec_counters(llm)
        width = len(after["per_position"])
        per_position = [a - b for a, b in zip(after["per_position"], (before["per_position"] or [0] * width))]
        rows.append(
            {
                "tokens": list(done[0].outputs[0].token_ids),
                "drafts": after["num_drafts"] - before["num_drafts"],
                "draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
                "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"],
                "per_position": per_position,
            }
        )
    last = spec_counters(llm)
    import vllm

    return {
        "rows": rows,
        "total_drafts": last["num_drafts"] - first["num_drafts"],
        "total_accepted": last["num_accepted_tokens"] - first["num_accepted_tokens"],
        "version": vllm.__version__,
        "threads": torch.get_num_threads(),
    }
