"""The drafter-kind registry: what a drafter kind is, declared once and looked up by every layer.

A :class:`DrafterKind` holds everything draftsmith knows about one kind: its spec options (with
defaults and allowed ranges), how the engine builds its drafter, how it trains, how it exports and
how vLLM serves the export. Each kind is declared in its own module of :mod:`draftsmith.plugins`
(``KIND``) and named by one entry point of the group :data:`ENTRY_POINTS` (pyproject.toml), which
the registry loads on its first lookup: complete on import, with nothing for callers to fill. The
engine, training, export and the gate look kinds up here by name, so none of them holds a table of
kinds. This module sits at the bottom of the layers and
imports nothing of draftsmith's but its errors and :class:`~draftsmith.config.Range` (an option's
values): a kind's parts are plain callables and classes of the layers above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from draftsmith.config import Range
from draftsmith.errors import UsageError, UserError, one_line


@dataclass(frozen=True)
class Option:
    """One ``?key=value`` option of a drafter spec: its default, its meaning and, for a number, the
    values allowed (checked when the spec is parsed, before any model loads)."""

    default: object
    doc: str
    range: Range | None = None  # None: free text (a path, a file, a name)
    text: bool = False  # a numeric option that also takes text (layers=0,1,2,29), checked where it is used

    def help(self, name: str) -> str:
        """The option's ``--help`` line: ``name=default``, its meaning and its range."""
        allowed = f" ({self.range})" if self.range else ""
        return f"      {name}={'' if self.default is None else self.default}".ljust(26) + f" {self.doc}{allowed}"


@dataclass(frozen=True)
class Served:
    """What vLLM must be told to serve an export: its speculative method and drafted tokens per step."""

    method: str
    num_speculative_tokens: int
    parallel_drafting: bool = False  # the whole chain in one draft pass


@dataclass(frozen=True)
class Training:
    """How a kind trains: the recipe's ``drafter.kind`` (a draft LM's is ``distill``), the recipe
    class, the entry point of its ``train/<kind>.py`` (``main(argv)``), its ``build(recipe) ->
    (task, train_set, eval_set)`` and, for kinds whose head can go on learning from captured
    traffic (``draftsmith-adapt``), its task class ``task(recipe, target, head)``, trained on feature rows."""

    recipe_kind: str
    recipe: type
    main: Callable[[list[str] | None], Any]
    build: Callable[[Any], tuple]
    task: type | None = None


@dataclass(frozen=True)
class Features:
    """What of the target a kind's drafter reads, as SpecForge's ``FeatureContract`` declares an
    algorithm's tensors: ``hidden`` is "" (tokens only: a draft LM), "last" (the target's last
    hidden state: EAGLE-1, Medusa) or "aux" (the states of the target layers its recipe's
    ``drafter.aux_layers`` names, fused, beside the last: EAGLE-3 and the parallel drafters);
    ``rows``: its training reads those states as feature rows, computed per step, stored or served
    (the recipe's ``drafter.features`` and ``drafter.features_dir``)."""

    hidden: str = ""
    rows: bool = False

    def __post_init__(self):
        if self.hidden not in ("", "last", "aux") or (self.rows and not self.hidden):
            raise ValueError(f"Features({self.hidden!r}, rows={self.rows}): hidden '', 'last' or 'aux'; rows needs one")


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind, as every layer sees it.

    The engine's part: ``summary``, ``path`` (what ``KIND:PATH`` is: "" for none, ending in
    "(required)" when a checkpoint must be given), ``options``, ``build(spec, target)`` (the
    drafter for a parsed spec), ``has_distribution`` (drafts from a distribution, so
    ``policy=entropy`` applies), ``entropy_note`` (why ``policy=entropy`` is refused when the kind
    has entropy rules of its own), ``plan_fallback`` (kinds whose trees are planned, ``depth=auto``:
    the tree of a head that records no held-out accuracy) and ``max_depth(config)`` (the most
    tokens one step drafts, read off the checkpoint's config.json: a deeper ``depth`` is refused)
    and ``hf_assistant`` (its drafter's ``assistant()`` is a whole causal LM that Hugging Face
    ``generate`` takes as ``assistant_model``: ``eval/run.py --hf-baseline hf_assisted``).

    The layers above: ``training``; ``features`` (what of the target it reads: :class:`Features`;
    training reads it rather than guess from the recipe's fields); ``title`` (the model card's);
    ``readers`` (export format -> ``(folder, config) -> weights under draftsmith's names``: how the
    engine loads that export back, ``KIND:EXPORT``); ``formats`` (export format -> converter
    ``(source, target, out, tree) -> serve command lines``); ``copied`` (checkpoint files an export
    carries along); ``refused`` (export format -> why it cannot hold this kind's drafters, where the
    kind knows better than the format's own ``why_not``); ``target_file`` (a checkpoint whose
    config.json names no ``draftsmith_kind`` is this kind's when it holds this file, its target
    record: a plain Hugging Face model folder); ``serve(fmt, folder, depth)`` (how vLLM serves an
    export of that format, None when it cannot, or a :class:`~draftsmith.errors.UsageError` saying
    why); ``calibrate(argv)`` (its tree calibrated to the device: ``eval/calibrate_tree.py
    CHECKPOINT`` for its checkpoints, with its own options); ``chain(depth)`` (the spec options that
    make the engine draft the chain vLLM drafts, for the gate).

    Its modules: ``builds_on`` (the kinds whose own modules this kind's import: DSpark's drafter is
    DFlash's with a Markov head; followed through, so P-EAGLE's reach EAGLE-1's) and ``modules``
    (its own modules besides those named after it in :data:`KIND_PACKAGES`, e.g. the draft LM's
    trainer ``draftsmith.train.distill``). No other module imports them (:mod:`draftsmith.kind_contract`).
    """

    name: str
    summary: str
    build: Callable[[Any, Any], Any]
    path: str = ""
    options: Mapping[str, Option] = field(default_factory=dict)
    has_distribution: bool = False
    entropy_note: str = ""
    plan_fallback: Mapping[str, int] | None = None
    max_depth: Callable[[dict], int] | None = None
    hf_assistant: bool = False
    training: Training | None = None
    features: Features = Features()
    title: str = ""
    formats: Mapping[str, Callable[..., list[str]]] = field(default_factory=dict)
    readers: Mapping[str, Callable[[Any, dict], dict]] = field(default_factory=dict)
    copied: tuple[str, ...] = ()
    refused: Mapping[str, str] = field(default_factory=dict)
    target_file: str = ""
    serve: Callable[[str, Any, int], Served | None] | None = None
    chain: Callable[[int], dict] | None = None
    calibrate: Callable[[list[str]], Any] | None = None
    builds_on: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()

    def own_modules(self) -> set[str]:
        """The modules that are this kind's alone: those named after it in :data:`KIND_PACKAGES`
        (where they exist) and :attr:`modules`."""
        return {f"{package}.{self.name}" for package in KIND_PACKAGES} | set(self.modules)


# Where a kind's own modules live, each named after the kind: heads/<kind>.py (its model),
# train/<kind>.py (its recipe and trainer), eval/engine/drafters/<kind>.py (its drafter) and
# plugins/<kind>.py (its declaration).
KIND_PACKAGES = ("draftsmith.heads", "draftsmith.train", "draftsmith.eval.engine.drafters", "draftsmith.plugins")


# The entry-point group every kind is declared in: ``NAME = "module:KIND"`` (draftsmith's own in its
# pyproject.toml; another installed package adds kinds in its own metadata).
ENTRY_POINTS = "draftsmith.kinds"

_KINDS: dict[str, DrafterKind] = {}
_loaded = False


def _load() -> None:
    """Register every kind declared under :data:`ENTRY_POINTS`, once, on the first lookup (a kind's
    declaration imports its modules from the layers above, which this module never imports)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # first: a declaration that looks kinds up while it loads sees those loaded so far
    try:
        for point in entry_points(group=ENTRY_POINTS):
            register(_declared(point))
    except BaseException:
        _loaded = False  # the next lookup tries again (and fails the same way) rather than see a part
        raise


def _declared(point) -> DrafterKind:
    """The kind an entry point names; one that does not load, or names no such kind, is a one-line
    error naming the line and the package that installed it (a broken plugin is the installation's
    problem, not draftsmith's: no traceback, and not skipped, so no kind goes missing unsaid)."""
    where = f"entry point {point.name} = {point.value} (group {ENTRY_POINTS}"
    where += f", installed by {point.dist.name} {point.dist.version})" if point.dist else ")"
    try:
        kind = point.load()
    except Exception as err:
        raise UserError(f"{where} does not load: {type(err).__name__}: {one_line(err)}; fix or uninstall it") from err
    if not isinstance(kind, DrafterKind) or kind.name != point.name:
        raise UserError(f"{where} must name the DrafterKind called {point.name!r}, not {one_line(repr(kind))}")
    return kind


def register(kind: DrafterKind) -> None:
    """Add ``kind`` to the registry (again is a no-op; another kind of the same name is an error).
    Kinds are declared as entry points; this adds one at run time (a notebook's, a test's)."""
    if _KINDS.setdefault(kind.name, kind) is not kind:
        raise ValueError(f"drafter kind {kind.name!r} is registered twice")


def registered() -> dict[str, DrafterKind]:
    """Every kind by name, in alphabetical order (the entry points' and those :func:`register` added)."""
    _load()
    return dict(sorted(_KINDS.items()))


def get(name: str, what: str = "drafter kind") -> DrafterKind:
    """The kind called ``name``, or a one-line error naming the registered ones (``what``: how the
    caller's user gave the name)."""
    kinds = registered()
    if name not in kinds:
        raise UsageError(
            f"{what} {name!r} is not a drafter kind: choose from {', '.join(kinds) or '(none registered)'}"
        )
    return kinds[name]


def for_recipe(recipe_kind: str, what: str = "drafter.kind") -> DrafterKind:
    """The kind a recipe's ``drafter.kind`` trains, or a one-line error naming the trainable ones."""
    trainable = {kind.training.recipe_kind: kind for kind in registered().values() if kind.training}
    if recipe_kind not in trainable:
        raise UsageError(f"{what} {recipe_kind!r}: choose from {', '.join(trainable)}")
    return trainable[recipe_kind]
