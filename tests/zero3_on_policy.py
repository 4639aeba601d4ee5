"""Launched by ``test_distill.py`` on two processes under DeepSpeed ZeRO-3: on-policy sampling
where only process 1 draws student rows. Prints each process's responses and what the student,
before its parameters were sharded, generates for the same prompts (greedy)."""

from __future__ import annotations

import json
import sys

import torch

from draftsmith.heads.draft_lm import student_for
from draftsmith.target import load_target
from draftsmith.train.cli import parse_training_args
from draftsmith.train.distill import DistillRecipe, DistillTask
from draftsmith.train.loop import Trainer

recipe, _ = parse_training_args(DistillRecipe, sys.argv[1:])
target, tokenizer = load_target(recipe.target.name, device="cpu")
task = DistillTask(recipe, target, student_for(target, num_layers=1), tokenizer)
prompts = [[1, 20, 300, 4000], [5, 60]]
expected = task.generate(task.model, prompts)  # full weights, before DeepSpeed shards them
trainer = Trainer(recipe, task, [{"id": str(i), "prompt": p, "response": [7]} for i, p in enumerate(prompts)])
rank = trainer.accelerator.process_index
task.mixture = torch.tensor([1.0, 0.0, 0.0] if rank == 0 else [0.0, 0.0, 1.0])
responses, sources = task.responses({"ids": ["a", "b"], "prompts": prompts, "responses": [[7], [8]]}, training=True)
print(
    "RESULT " + json.dumps({"rank": rank, "sources": sources, "responses": responses, "expected": expected}), flush=True
)
