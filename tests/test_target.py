import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.assets import asset_path
from draftsmith.errors import UserError
from draftsmith.precision import resolve_dtype
from draftsmith.target import load_target, load_tokenizer, resolve_target

pytestmark = pytest.mark.slow


def test_gguf_and_safetensors_cache_give_same_logits(smollm2):
    cached_model, tokenizer = smollm2
    gguf = asset_path("smollm2")
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a = direct(ids).logits
        b = cached_model(ids).logits
    assert a.shape == (1, ids.shape[1], 49152)
    assert (a - b).abs().max().item() < 1e-5
    # The model is a real language model, not noise: it knows the answer.
    assert tokenizer.decode(b[0, -1].argmax()).strip() == "Paris"


def test_cached_load_is_a_plain_hf_folder_and_fast(smollm2):
    folder = resolve_target("default")
    start = time.perf_counter()
    model, tokenizer = load_target(folder, dtype="bfloat16", device="cpu")
    assert time.perf_counter() - start < 20  # the GGUF path dequantises for ~15-25 s
    assert model.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_bad_dtype_and_missing_gguf_are_clear():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")
    with pytest.raises(UserError, match="nope.gguf"):
        resolve_target("/nonexistent/nope.gguf")


def test_a_tokenizer_is_loaded_once_per_folder_state_and_each_caller_gets_its_own(tmp_path):
    folder = tmp_path / "tok"
    load_tokenizer("default").save_pretrained(folder)
    first = load_tokenizer(str(folder))
    first.chat_template, first.pad_token = "changed", "<|im_start|>"  # a caller's own edits
    second = load_tokenizer(str(folder))
    assert second is not first and second.pad_token == "<|im_end|>" and "changed" not in second.chat_template
    # The folder rewritten in place (a token added): the next load reads it.
    second.add_tokens(["<draftsmith-new-token>"])
    second.save_pretrained(folder)
    assert len(load_tokenizer(str(folder))) == len(first) + 1
