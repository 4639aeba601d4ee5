"""Adaptation rounds: continue training the serving head on captured traffic, judge, publish atomically.

``OUT/`` holds ``rounds/round-NNNN/`` (``checkpoint/``: the head with its optimiser state; ``export/``:
what a serving engine loads; ``verdict.json``), ``current`` (a link to the serving round, switched
with one atomic rename) and ``state.json`` (every round's verdict). Round 0 is the deployed head as
given. Each round:

1. splits the traffic store: the ``held_out`` most recent requests are judged on, the rest trained on,
   with a ``replay_fraction`` share of rows from the head's own training data (its checkpoint's
   ``recipe.yaml``; their features are extracted once into ``OUT/replay``) so it does not forget;
2. trains a challenger from the serving head's weights and optimiser state for ``round_steps``
   (the head's own training task and loop, at ``learning_rate``);
3. judges it against the serving head in our engine (:mod:`draftsmith.adapt.judge`);
4. if it wins: exports it, publishes the round folder (staged, renamed whole), then switches
   ``current``; else records why, and the serving head stays.

A kill at any point leaves ``current`` on a complete head; the next run finishes a round whose
folder was published but not yet recorded, and starts a round cut short again from its beginning.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import datasets
import torch

from draftsmith.adapt.config import PLANNED, AdaptConfig
from draftsmith.adapt.judge import Verdict, judge
from draftsmith.adapt.split import TrafficSplit, judge_prompt, split_traffic
from draftsmith.adapt.weights import RejectedWeighted, weighted
from draftsmith.atomic import staged
from draftsmith.checkpoint_files import load_torch, read_json
from draftsmith.config import load_recipe
from draftsmith.data_prep.dataset import build_dataset
from draftsmith.data_prep.features import (
    FeatureDataset,
    RowSelection,
    check_identity,
    extract_features,
    is_complete,
    store_identity,
)
from draftsmith.data_prep.regenerate import prepare_data_config
from draftsmith.data_prep.traffic import hold_lock, private_folder, read_traffic
from draftsmith.errors import UserError
from draftsmith.export import export_checkpoint
from draftsmith.kinds import get
from draftsmith.recipe import RegenerateConfig
from draftsmith.target import load_target
from draftsmith.timing import clock
from draftsmith.train.checkpoints import state_dir
from draftsmith.train.loop import Trainer

CURRENT = "current"
ROUNDS = "rounds"
STATE = "state.json"
VERDICT = "verdict.json"
UNCHECKED = "not checked"  # how a verdict's forgetting note starts when the check did not run


@dataclass
class Round:
    """One finished round: its number, verdict, and what it cost."""

    number: int
    verdict: dict
    trained_rows: int
    replay_rows: int
    steps: int
    train_seconds: float
    judge_seconds: float
    nan: bool = False
    # top-1 per draft depth on the head's own held-out conversations (the forgetting check)
    general_serving: list[float] | None = None
    general_challenger: list[float] | None = None
    traffic_seen: int = 0  # requests the traffic had had (kept or dropped by its bound): the next round waits for more
    conversations: int = 0  # in the traffic this round split

    def record(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RoundData:
    """What one round trains and is judged on."""

    train: RowSelection | RejectedWeighted  # traffic rows of conversations not held out, then the replay share
    prompts: list[list[int]]  # one judge prompt per held-out conversation
    served: int  # traffic rows among ``train``
    seen: int  # requests the traffic has had
    split: TrafficSplit


def round_folder(out_dir: str | Path, number: int) -> Path:
    """Round ``number``'s folder under ``out_dir`` (round 0: the deployed head as given)."""
    return Path(out_dir) / ROUNDS / f"round-{number:04d}"


def serving_head(out_dir: str | Path) -> Path:
    """The checkpoint folder the ``current`` link points at (what to serve now)."""
    return Path(os.path.realpath(Path(out_dir) / CURRENT)) / "checkpoint"


def sync_tree(folder: Path) -> None:
    """Flush every file and folder under ``folder`` to disk: a power cut after a switch to it must not
    leave ``current`` naming files whose data never reached the disk."""
    for path in sorted(folder.rglob("*"), reverse=True) + [folder]:
        if not path.is_symlink():
            _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def switch_current(out_dir: Path, round_folder: Path) -> None:
    """Point ``OUT/current`` at ``round_folder`` with one atomic rename (readers see the old or the new
    head), its data on disk first."""
    sync_tree(round_folder)
    link = out_dir / CURRENT
    tmp = out_dir / f".{CURRENT}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(round_folder, out_dir), tmp)
    os.replace(tmp, link)
    _fsync(out_dir)  # the rename itself, durable


def adaptable_kind(checkpoint: str | Path, what: str):
    """``(kind, config)`` of the head checkpoint, or a one-line error when it is none or its kind
    cannot go on learning (``what``: where the user named it)."""
    file = Path(checkpoint) / "config.json"
    if not file.is_file():
        raise UserError(f"{what} {checkpoint} is not a drafter checkpoint (no config.json): give checkpoint-N")
    config = read_json(file)
    kind = get(config.get("draftsmith_kind", ""), f"{what} {checkpoint}: its config's draftsmith_kind")
    if kind.training is None or kind.training.task is None:
        raise UserError(f"{what} {checkpoint}: {kind.name} heads cannot adapt yet (EAGLE-3 and P-EAGLE can)")
    return kind, config


class Adapter:
    """Runs adaptation rounds for one :class:`AdaptConfig` (see the module docstring)."""

    def __init__(self, cfg: AdaptConfig):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self._lock = None  # adapt.out_dir's lock, taken by run() and held until release()
        self.kind, config = adaptable_kind(cfg.head, "adapt.head")
        recipe_file = Path(cfg.head) / "recipe.yaml"
        if not recipe_file.is_file():
            raise UserError(f"adapt.head {cfg.head} has no recipe.yaml: give a training checkpoint (checkpoint-N)")
        self.recipe = load_recipe(self.kind.training.recipe, recipe_file)
        self.target, self.tokenizer = load_target(
            self.recipe.target.name, self.recipe.target.dtype, chat_template=self.recipe.target.chat_template
        )
        self.layers = config.get("aux_layers")
        self.storage = self.recipe.data.features.storage_dtype
        self.traffic_override: Path | None = None  # a feature store of the traffic, kept by draftsmith-adapt --watch
        self._check_traffic()

    # -- data ------------------------------------------------------------------------------------
    def _identity(self, data=None) -> dict:
        return store_identity(self.recipe.target.name, self.target, self.tokenizer, self.layers, self.storage, data)

    def _check_traffic(self) -> None:
        root = Path(self.cfg.traffic)
        if root.is_file():  # a request log or conversations file: read (and checked) by the data loader
            return
        if not (root / "identity.json").is_file():
            raise UserError(
                f"adapt.traffic {root} is neither a traffic store (no identity.json) nor a request log: capture "
                "one with eval/run.py --capture DIR or TrafficStore in your own loop, or give the gateway's or "
                "vLLM's request log file"
            )
        check_identity(root, self._identity())  # traffic of another target, tokenizer or layers is refused

    def traffic(self) -> FeatureDataset:
        """Every served request, oldest first: a capture store's within its age bound, or a request
        log's (or any conversations file's) conversations in file order, their features extracted by
        this target into ``OUT/traffic`` (again when the file has grown)."""
        return self._traffic()[0]

    def _traffic(self) -> tuple[FeatureDataset, int]:
        """:meth:`traffic` and the number of its oldest request (those before it went to a store's
        bounds), read together: a store's writer may drop shards in between."""
        source = Path(self.cfg.traffic)
        if self.traffic_override is not None:  # a watcher appends a log's features there (adapt/watch.py)
            return FeatureDataset(self.traffic_override / "train"), 0
        if source.is_file():
            data_cfg = replace(
                self.recipe.data,
                path=str(source),
                held_out_fraction=0.0,
                held_out_path=None,
                limit=None,
                max_length=self.cfg.max_length,
                regenerate=RegenerateConfig(enabled=False),
            )
            data, _ = build_dataset(data_cfg, self.tokenizer, expected_model=self.cfg.served_model or None)
            data = datasets.DatasetDict({"train": data["train"]})
            root = self.out / "traffic"
            if not is_complete(root, data):
                shutil.rmtree(root, ignore_errors=True)  # a grown log: its shards no longer line up
                extract_features(self.target, data, root, layers=self.layers, identity=self._identity(data))
            return FeatureDataset(root / "train"), 0
        store = read_traffic(source)
        if store.expired:  # never trained or judged on: the store keeps users' requests no longer than asked
            print(f"adapt.traffic {source}: {store.expired} request(s) past the store's age bound not used")
        if store.rows is None:
            past = f" ({store.expired} past its age bound)" if store.expired else ""
            raise UserError(f"adapt.traffic {self.cfg.traffic} holds no request to use{past}: serve some first")
        return store.rows, store.first

    @functools.cached_property
    def _general(self) -> dict[str, FeatureDataset]:
        return self.general()

    def general(self) -> dict[str, FeatureDataset]:
        """The head's own data with its features (extracted once into ``OUT/general``): ``train``, a
        replay sample of its training conversations, and ``held_out``, its held-out conversations
        (the forgetting check); a split the config or the data leaves empty is absent."""
        # The head learnt the data its recipe prepared: with data.regenerate, the target's own replies
        # (the file the recipe wrote, written again here only where it is missing), not the source's.
        prepared = prepare_data_config(self.recipe.data, self.target, self.recipe.target.name, self.tokenizer)
        data, _ = build_dataset(prepared, self.tokenizer)
        rng = random.Random(self.cfg.seed)
        splits = {}
        if self.cfg.replay_fraction > 0 and self.cfg.replay_limit > 0:
            picks = rng.sample(range(len(data["train"])), min(self.cfg.replay_limit, len(data["train"])))
            splits["train"] = data["train"].select(sorted(picks))
        if self.cfg.general_held_out > 0 and len(data["held_out"]):
            splits["held_out"] = data["held_out"].select(range(min(self.cfg.general_held_out, len(data["held_out"]))))
        subset = datasets.DatasetDict(splits)
        root = self.out / "general"
        if splits and not is_complete(root, subset):
            extract_features(self.target, subset, root, layers=self.layers, identity=self._identity(subset))
        return {split: FeatureDataset(root / split) for split in splits}

    def accuracy(self, head, rows) -> list[float]:
        """``head``'s top-1 at each draft depth over feature ``rows`` (teacher-forced, as training evaluates)."""
        task = self.kind.training.task(self.recipe, self.target, head)
        sums: dict[str, float] = {}
        with torch.no_grad():
            for start in range(0, len(rows), self.cfg.batch_size):
                batch = task.collate([rows[i] for i in range(start, min(start + self.cfg.batch_size, len(rows)))])
                for key, value in task.loss(head, batch, training=False)[1].items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        depths = sorted(int(k[5:]) for k in sums if k.startswith("top1@"))
        return [round(sums[f"top1@{d}"] / max(sums[f"rows@{d}"], 1.0), 4) for d in depths]

    def split(self, number: int, since: int) -> RoundData:
        """Round ``number``'s data: the held-out conversations (:func:`~draftsmith.adapt.split.split_traffic`:
        whole conversations that began after request ``since``, judged on their newest request) and
        the train rows, the other conversations plus the replay share."""
        traffic, first = self._traffic()
        rows = traffic.token_rows()
        parts = split_traffic(rows, first, since, self.cfg.held_out)
        picks = [(traffic, i) for i in parts.train]
        served = len(picks)
        replay = self._general.get("train")
        if replay is not None:
            share = self.cfg.replay_fraction
            count = min(len(replay), round(len(picks) * share / (1 - share)))
            rng = random.Random(self.cfg.seed + number)
            picks += [(replay, i) for i in rng.sample(range(len(replay)), count)]
        prompts = [judge_prompt(*rows[i]) for i in parts.judged]
        train = weighted(RowSelection(picks, self.cfg.max_length), self.cfg.rejected_weight)
        return RoundData(train, prompts, served, first + len(rows), parts)

    def _not_judged(self, since: int, data: RoundData) -> str | None:
        """Why a round is not judged on ``data`` (None: it is); ``since``: the requests the last round saw."""
        arrived = data.seen - since
        if arrived < self.cfg.held_out:
            return (
                f"{arrived} request(s) arrived since the last round (request {since}); adapt.held_out asks "
                f"{self.cfg.held_out} new ones to judge on: serve more traffic, then run again"
            )
        if len(data.prompts) < self.cfg.judged_at_least:
            field = "adapt.held_out" if self.cfg.min_held_out is None else "adapt.min_held_out"
            return (
                f"{len(data.prompts)} held-out conversation(s) ({data.split.fresh} new of {data.split.conversations} "
                f"in the traffic, one kept to train on) are fewer than {field} {self.cfg.judged_at_least}: "
                "serve more traffic, then run again"
            )
        return None

    # -- rounds ----------------------------------------------------------------------------------
    def history(self) -> list[dict]:
        file = self.out / STATE
        if not file.is_file():
            return []
        return read_json(file, f"restore {file} or delete {self.out} to start again")["rounds"]

    def _record(self, rounds: list[dict]) -> None:
        with staged(self.out / STATE) as tmp:
            tmp.write_text(json.dumps({"rounds": rounds}, indent=1))

    def _start(self) -> None:
        """Round 0: the deployed head as given, exported, and ``current`` pointing at it."""
        if (self.out / CURRENT).exists():
            return
        first = round_folder(self.out, 0)
        if not first.is_dir():
            with staged(first, folder=True) as tmp:
                shutil.copytree(self.cfg.head, tmp / "checkpoint")
                self._export(tmp)
                (tmp / VERDICT).write_text(json.dumps({"promoted": True, "reason": "the deployed head"}))
        switch_current(self.out, first)

    def _export(self, folder: Path) -> None:
        if self.cfg.export_format != "none":
            export_checkpoint(folder / "checkpoint", self.cfg.export_format, folder / "export")

    def run(self, rounds: int = 1) -> list[Round]:
        """Run up to ``rounds`` more rounds (after any a kill cut short); returns them. Stops early,
        saying why in one line, when the traffic holds too few new requests to judge another."""
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"adapt.out_dir {self.out} is a file: give a folder (it holds the rounds and `current`)")
        private_folder(self.out)  # round folders hold heads trained on users' requests
        if self._lock is None:  # held once for this adapter's life: a watcher runs it again
            self._lock = hold_lock(self.out, "adapt.out_dir")  # a second adapter on it is refused
        self._start()
        done = []
        for _ in range(rounds):
            result = self.run_round(len(self.history()) + 1)
            if result is None:
                break
            done.append(result)
        return done

    def release(self) -> None:
        """Let go of ``adapt.out_dir`` (taken by :meth:`run`), so that another adapter (a watcher's) may run it."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def run_round(self, number: int) -> Round | None:
        """Round ``number``: train, judge, and publish when the challenger wins (see the module
        docstring); None, with a line saying why, when the traffic cannot judge it."""
        folder = round_folder(self.out, number)
        history = self.history()
        if folder.is_dir():  # published before a kill, not yet recorded: record it (and switch to it) now
            result = json.loads((folder / VERDICT).read_text())
            if result["verdict"]["promoted"]:
                switch_current(self.out, folder)
            self._record(history + [result])
            return Round(**result)
        since = history[-1].get("traffic_seen", 0) if history else 0
        data = self.split(number, since)
        if why := self._not_judged(since, data):
            print(f"adapt round {number} not run: {why}")
            return None
        serving = serving_head(self.out)
        general = self._general.get("held_out")
        with staged(folder, folder=True) as tmp:
            began = clock(self.target.device)
            # The trainer evaluates (and records the depth accuracy a planned tree reads) on the head's own
            # held-out data: the judged requests never reach training, its evaluation or a plan.
            head, trainer = self._train(serving, data.train, general, tmp / "train")
            train_seconds = clock(self.target.device) - began
            nan = not all(torch.isfinite(p).all() for p in head.parameters())
            began = clock(self.target.device)
            if nan:
                verdict = Verdict(
                    0, 0, 0, 0, len(data.prompts), False, "training produced NaN or inf weights: not judged"
                )
            else:
                verdict = judge(
                    self.target,
                    self.kind.name,
                    str(serving),
                    str(trainer.last_checkpoint),
                    data.prompts,
                    self.cfg.judge_max_new_tokens,
                    "" if self.cfg.judge_drafter == PLANNED else self.cfg.judge_drafter,
                    self.cfg.margin,
                    self.cfg.confidence,
                    self.cfg.seed + number,
                )
            judge_seconds = clock(self.target.device) - began
            before = after = None
            if general is not None and not nan:
                before = self.accuracy(
                    self.kind.training.task.head_class.from_pretrained(serving, self.target), general
                )
                after = self.accuracy(head, general)
            if len(data.prompts) < self.cfg.held_out:  # judged on fewer than asked: the record says so
                verdict.reason += (
                    f"; judged on {len(data.prompts)} held-out conversations, fewer than adapt.held_out "
                    f"{self.cfg.held_out} ({data.split.fresh} new of {data.split.conversations} in the traffic, "
                    "one kept to train on)"
                )
            verdict.forgetting = f"{UNCHECKED}: NaN weights" if nan else self._forgetting(before, after)
            if verdict.promoted and "more than" in verdict.forgetting:
                verdict.promoted = False
                verdict.reason += f"; but it forgets: {verdict.forgetting}"
            elif verdict.promoted and verdict.forgetting.startswith(UNCHECKED):
                verdict.reason += f"; forgetting {verdict.forgetting}"
            result = Round(
                number,
                verdict.record(),
                data.served,
                len(data.train) - data.served,
                trainer.state.step,
                round(train_seconds, 2),
                round(judge_seconds, 2),
                nan,
                before,
                after,
                data.seen,
                data.split.conversations,
            )
            if verdict.promoted:
                os.replace(trainer.last_checkpoint, tmp / "checkpoint")
                self._export(tmp)
            shutil.rmtree(tmp / "train")
            (tmp / VERDICT).write_text(json.dumps(result.record(), indent=1))
        if verdict.promoted:
            switch_current(self.out, folder)
        self._record(history + [result.record()])
        print(f"adapt round {number}: {'promoted' if verdict.promoted else 'kept the serving head'}: {verdict.reason}")
        return result

    def _forgetting(self, before: list[float] | None, after: list[float] | None) -> str:
        """What the forgetting check found from both heads' top-1 on the head's own held-out data, or
        why it did not run."""
        if before is None:
            return (
                f"{UNCHECKED}: the head's data has no held-out split (data.held_out_fraction), or general_held_out is 0"
            )
        found = f"general held-out top-1 {before[0]:.3f} -> {after[0]:.3f}"
        if self.cfg.max_forgetting is None:
            return f"{UNCHECKED} (adapt.max_forgetting is null): {found}"
        if before[0] - after[0] > self.cfg.max_forgetting:
            return f"{found}, more than adapt.max_forgetting {self.cfg.max_forgetting} lost"
        return found

    def _train(self, serving: Path, train_rows, eval_rows, output_dir: Path):
        """A challenger trained from the serving head (weights and, where saved, optimiser state)."""
        head = self.kind.training.task.head_class.from_pretrained(serving, self.target)
        trainer = round_trainer(
            self.kind, Path(self.cfg.head), self.cfg, self.target, head, train_rows, eval_rows, output_dir
        )
        optimizer = saved_optimizer(serving)
        carry_optimizer(trainer, optimizer)
        trainer.last_checkpoint = trainer.train()
        return trainer.task.model, trainer


def saved_optimizer(checkpoint: str | Path) -> dict | None:
    """The optimiser state saved with a training ``checkpoint`` (None: an export, or none saved)."""
    file = state_dir(Path(checkpoint)) / "optimizer.bin"
    return load_torch(file) if file.is_file() else None


def carry_optimizer(trainer, state: dict | None) -> None:
    """Continue ``trainer`` from an earlier round's optimiser ``state`` (None: there is none yet):
    Adam's moments carry over (a fresh AdamW would restart them at zero every round); the round's own
    learning rate replaces the saved one."""
    if state is None:
        return
    trainer.optimizer.load_state_dict(state)
    for group, lr in zip(trainer.optimizer.param_groups, trainer.scheduler.get_last_lr()):
        group["lr"] = lr


def round_trainer(kind, head_checkpoint: Path, cfg: AdaptConfig, target, head, rows, eval_rows, output_dir: Path):
    """A :class:`~draftsmith.train.loop.Trainer` of ``head`` on feature ``rows`` (``eval_rows`` evaluated at the end)
    for one round of ``cfg``: the head's own recipe (``head_checkpoint/recipe.yaml``) and task, with the
    round's steps, learning rate (linear decay, no warm-up) and batch size, no tracker."""
    overrides = {
        "training": {
            "output_dir": str(output_dir),
            "max_steps": cfg.round_steps,
            "max_minutes": cfg.round_minutes,
            "learning_rate": cfg.learning_rate,
            "warmup_steps": 0,
            "lr_schedule": "linear",
            "batch_size": cfg.batch_size,
            "gradient_accumulation_steps": 1,
            "packing": False,
            "eval_every": 0,
            "save_every": 0,
            "keep_checkpoints": 1,
            "stop_after_steps": None,
            "seed": cfg.seed,
        },
        "tracking": {"report_to": "none"},
        # The rows are served traffic, not the target's greedy rewrite: its argmax and the labels
        # come from the target's features (train/unroll.py: greedy_replies).
        "data": {"regenerate": {"enabled": False}},
    }
    recipe = load_recipe(kind.training.recipe, head_checkpoint / "recipe.yaml", overrides)
    return Trainer(recipe, kind.training.task(recipe, target, head), rows, eval_rows)
