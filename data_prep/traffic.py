"""Served traffic as training data: requests the engine decoded, with the target's features.

While it decodes, the engine has already computed, for every token the target kept, the target's
hidden states at the layers a head reads: the training signal is free. A :class:`TrafficStore`
appends finished requests (the tokens the target produced after its prompt, and those states)
to a feature store in the layout training reads (:class:`~draftsmith.data_prep.features.FeatureDataset`
over ``ROOT/train``), with the same ``identity.json`` checks (another target, tokenizer, layers or
storage is refused), shards written atomically in the order the requests finished, and bounds on
disk and on age: past ``max_bytes``, and once older than ``max_age`` seconds (users' prompts and
replies are kept no longer than asked), the oldest shards go, counted in ``manifest.json``; the age
bound applies when the store is opened and each time it writes, and :func:`read_traffic` (what a
round reads, while a server may hold the store) skips what is past it. A killed server loses
at most the requests not yet flushed (``shard_size`` of them).

The engine records into it (``SpeculativeDecoder(..., capture=store)``, ``eval/run.py --capture``);
a user's own loop calls :meth:`TrafficStore.add` with the tokens and the states it computed.

What the served drafter did at each reply token goes beside them (shard key :data:`SERVED_DRAFT`, one
int8 per token, :func:`draft_outcomes`): :data:`ACCEPTED` (it drafted this token and the target kept
it), :data:`REJECTED` (it drafted this position and the target rejected every draft there: the token
is the target's correction) or :data:`NOT_DRAFTED` (prompt tokens, the reply's first token, which
prefill makes, the target's bonus token after a wholly accepted draft, steps that drafted nothing).
``adapt.rejected_weight`` trains harder where drafts failed from it. Stores written before it was
recorded (and requests added without it) read as :data:`NOT_DRAFTED` throughout: uniform weights.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from draftsmith.atomic import staged
from draftsmith.checkpoint_files import read_json
from draftsmith.data_prep.features import SERVED_DRAFT, FeatureDataset, check_identity, store_identity, write_shard
from draftsmith.errors import UserError
from draftsmith.timing import age_seconds

SPLIT = "train"
LOCK = ".lock"
NOT_DRAFTED, ACCEPTED, REJECTED = 0, 1, 2  # its values
_SHARD = re.compile(r"shard-(\d+)\.safetensors$")


class TrafficStore:
    """An append-only, bounded feature store of served requests (see the module docstring)."""

    def __init__(
        self,
        root: str | Path,
        identity: dict,
        max_bytes: int | None = None,
        shard_size: int = 8,
        max_age: float | None = None,
    ) -> None:
        self.root, self.identity = Path(root), identity
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"traffic store {self.root} is a file: give a folder (it holds the captured requests)")
        for name, bound in (("max_bytes", max_bytes), ("max_age", max_age)):
            if bound is not None and bound <= 0:  # a bound of 0 or less would delete every request at once
                raise UserError(f"traffic store {self.root}: {name} must be > 0 (None: unbounded), got {bound}")
        self.max_bytes, self.shard_size, self.max_age = max_bytes, shard_size, max_age
        self.layers = list(identity["layers"]) or None
        private_folder(self.root / SPLIT)  # users' prompts and replies: readable by their owner only
        check_identity(self.root, identity)  # before the lock: another target's store is refused as such
        self._lock = hold_lock(self.root, "traffic store")
        manifest = self.root / "manifest.json"
        previous = read_json(manifest, f"delete {manifest}: it is rebuilt") if manifest.is_file() else {}
        self.dropped = previous.get("dropped_conversations", 0)  # shards removed by the bound so far
        self.empty = previous.get("empty_replies", 0)  # requests with no reply token: nothing kept
        self._ids: list[list[int]] = []
        self._masks: list[list[int]] = []
        self._drafts: list[list[int]] = []
        self._states: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._bound()  # an idle store's requests past max_age go now, not at its next write

    @classmethod
    def for_target(
        cls,
        root: str | Path,
        target,
        tokenizer,
        target_name: str,
        layers: list[int] | None,
        storage: str = "auto",
        max_bytes: int | None = None,
        shard_size: int = 8,
        max_age: float | None = None,
    ) -> TrafficStore:
        """The store at ``root`` for ``target`` (named ``target_name`` as recipes name it) and the
        head's ``layers`` (None: the last hidden state only)."""
        identity = store_identity(target_name, target, tokenizer, layers, storage)
        return cls(root, identity, max_bytes, shard_size, max_age)

    def add(
        self,
        tokens: list[int],
        reply_start: int,
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
        drafts: list[int] | None = None,
    ) -> None:
        """One finished request: ``tokens`` (prompt then reply, the reply from ``reply_start``) and
        the target's states for the tokens it read (``hidden`` ``[n, H]`` the last hidden states,
        ``aux`` ``[n, layers * H]`` the head's layers); ``n`` is ``len(tokens)``, or one less when
        the last token (the reply's end of turn, or its last token at the length limit) was never fed
        back. The whole reply is supervised, its last token included. ``drafts``: the served drafter's
        outcome at each reply token (:data:`ACCEPTED`, :data:`REJECTED` or :data:`NOT_DRAFTED`; see the
        module docstring), ``len(tokens) - reply_start`` of them; None: not known (all :data:`NOT_DRAFTED`)."""
        n = hidden.shape[0]
        if n not in (len(tokens) - 1, len(tokens)) or reply_start > len(tokens):
            raise ValueError(
                f"{n} feature rows for {len(tokens)} tokens whose reply starts at {reply_start}: give a row for "
                "every token, or for every token but the last"
            )
        if reply_start == len(tokens):  # no reply token: nothing to learn
            self.empty += 1
            return
        reply = len(tokens) - reply_start
        if drafts is not None and (len(drafts) != reply or not set(drafts) <= {NOT_DRAFTED, ACCEPTED, REJECTED}):
            raise ValueError(
                f"drafts: give one outcome (0, 1 or 2) per reply token ({reply}), got {len(drafts)}: "
                f"{sorted(set(drafts))}"
            )
        if (aux is None) != (self.layers is None):
            given = "without" if aux is None else "with"
            raise ValueError(f"the store keeps layers {self.layers}; the request came {given} layer states")
        # Training scores token t with the target's states at t - 1 (EAGLE's regressed feature is row
        # t - 1 too): a conversation's last row is never read, so a last token that was never fed back
        # gets a row of zeros, as padding does, and is supervised like every other reply token.
        missing = len(tokens) - n
        self._ids.append(list(tokens))
        self._masks.append([0] * reply_start + [1] * reply)
        self._drafts.append(
            [NOT_DRAFTED] * reply_start + (list(drafts) if drafts is not None else [NOT_DRAFTED] * reply)
        )
        self._states.append(
            (_on_host(hidden, missing), _on_host(aux.to(hidden.dtype), missing) if aux is not None else None)
        )
        if len(self._ids) >= self.shard_size:
            self.flush()

    def shards(self) -> list[Path]:
        """The store's shards, oldest first."""
        return shard_files(self.root)

    def flush(self) -> None:
        """Write the requests held in memory as the next shard, then keep the store within its bounds."""
        if not self._ids:
            return
        shards = self.shards()
        number = _number(shards[-1]) + 1 if shards else 0
        path = self.root / SPLIT / f"shard-{number:06d}.safetensors"
        write_shard(path, self._ids, self._masks, self._states, self.identity, {SERVED_DRAFT: self._drafts})
        self._ids, self._masks, self._drafts, self._states = [], [], [], []
        self._bound()

    def _bound(self) -> None:
        """Delete the oldest shards while they are past ``max_age`` (every one: none outlives it) or
        the store is past ``max_bytes`` (the newest shard stays), then record the store in ``manifest.json``."""
        shards = self.shards()
        while shards and (_past_age(shards[0], self.max_age) or (len(shards) > 1 and self._too_big(shards))):
            self.dropped += len(FeatureDataset.from_files([shards[0]]))
            shards.pop(0).unlink()
        self._write_manifest(shards)

    def _too_big(self, shards: list[Path]) -> bool:
        return self.max_bytes is not None and sum(f.stat().st_size for f in shards) > self.max_bytes

    def _write_manifest(self, shards: list[Path]) -> None:
        rows = FeatureDataset.from_files(shards) if shards else None
        manifest = {
            "splits": {
                SPLIT: {
                    "conversations": len(rows) if rows else 0,
                    "tokens": sum(rows.lengths()) if rows else 0,
                    "shards": len(shards),
                    "bytes": sum(f.stat().st_size for f in shards),
                }
            },
            "dropped_conversations": self.dropped,
            "empty_replies": self.empty,
            "max_age": self.max_age,  # for readers: read_traffic skips what is past it
        }
        with staged(self.root / "manifest.json") as tmp:
            tmp.write_text(json.dumps(manifest, indent=1))

    def close(self) -> None:
        """Write what is held in memory and let go of the store's lock: another writer (a round's
        reader, the next serving process) may open it now. Closing twice does nothing more."""
        if self._lock is None:
            return
        self.flush()
        self._lock.close()
        self._lock = None

    def __enter__(self) -> TrafficStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class TrafficRows:
    """A traffic store as a round may use it (:func:`read_traffic`)."""

    rows: FeatureDataset | None  # the requests within the age bound, oldest first (None: no request)
    first: int  # the number of the oldest of them: the ones before it went to the bounds or are past the age
    expired: int  # requests still on disk but past the age bound: never read


def read_traffic(root: str | Path) -> TrafficRows:
    """The requests of the traffic store at ``root`` within the age bound its writer recorded
    (``manifest.json``'s ``max_age``), read without the writer's lock (a server may be capturing):
    shards past it are skipped, not deleted (its writer deletes them when it next opens or writes)."""
    root = Path(root)
    manifest = root / "manifest.json"
    recorded = read_json(manifest, f"delete {manifest}: it is rebuilt") if manifest.is_file() else {}
    shards = shard_files(root)
    expired = 0
    while shards and _past_age(shards[0], recorded.get("max_age")):
        expired += len(FeatureDataset.from_files([shards.pop(0)]))
    rows = FeatureDataset.from_files(shards) if shards else None
    return TrafficRows(rows, recorded.get("dropped_conversations", 0) + expired, expired)


def draft_outcomes(tree_parents: list[int] | None, path: list[int]) -> list[int]:
    """The outcomes of one decoding step's tokens (its accepted ``path`` of tree nodes, then the target's
    own token): :data:`ACCEPTED` for each node of the path; for the last token, :data:`REJECTED` when the
    tree drafted below the last accepted node (or below the root, with nothing accepted) and the target
    took none of those drafts, else :data:`NOT_DRAFTED` (a bonus token past the tree's end, or no tree)."""
    if not tree_parents:
        return [NOT_DRAFTED]
    below = path[-1] if path else -1  # the tree's root is parent -1
    return [ACCEPTED] * len(path) + [REJECTED if below in tree_parents else NOT_DRAFTED]


def _past_age(shard: Path, max_age: float | None) -> bool:
    # A shard's age is its write time: its requests finished at most shard_size requests before.
    return max_age is not None and age_seconds(shard) > max_age


def private_folder(folder: Path) -> None:
    """Create ``folder`` (and missing parents) readable by its owner only; an existing one keeps its mode."""
    for part in reversed([folder, *folder.parents]):
        if not part.exists():
            part.mkdir(mode=0o700)


def hold_lock(folder: Path, what: str) -> IO:
    """An exclusive lock on ``folder`` for as long as the returned file stays open, or a one-line
    error when another process (a second writer) holds it."""
    handle = open(folder / LOCK, "a")  # noqa: SIM115 -- held open for the writer's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UserError(
            f"{what} {folder} is in use by another process (its {LOCK} is locked): stop that one, "
            "or give another folder"
        ) from None
    os.chmod(folder / LOCK, 0o600)
    return handle


def _on_host(states: torch.Tensor, missing: int) -> torch.Tensor:
    """``states`` on the host with ``missing`` rows of zeros after them."""
    states = states.detach().cpu()
    return torch.cat([states, states.new_zeros(missing, states.shape[1])])


def shard_files(root: str | Path) -> list[Path]:
    """The shards of the traffic store at ``root``, oldest first."""
    return sorted(Path(root).joinpath(SPLIT).glob("shard-*.safetensors"), key=_number)


def _number(path: Path) -> int:
    return int(_SHARD.search(path.name).group(1))
