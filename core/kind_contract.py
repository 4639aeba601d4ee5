"""The import contract "shared code imports no kind" (``type = "kinds"`` in pyproject.toml's
import-linter contracts), checked against the kinds the registry declares rather than a hand-kept list.

A kind's own modules are :meth:`~draftsmith.kinds.DrafterKind.own_modules`: those named after it in
the kind packages (``heads/<kind>.py``, ``train/<kind>.py``, ``eval/engine/drafters/<kind>.py``,
``plugins/<kind>.py``) and those its declaration adds. A module imports a kind's own module only
if it is one of that kind's own modules or of a kind that builds on it (``builds_on``, followed
through); every other module (shared code: the engine, the harness, training's and the heads'
shared modules, export, adapt, data_prep, the core) reaches kinds through the registry. And every
module of ``draftsmith.plugins`` is a registered kind's declaration, so a kind whose entry point
was forgotten is caught here. Only ``lint-imports`` imports this module (import-linter is a dev
dependency); :func:`broken` is the rule, on any import graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from importlinter.application import output
from importlinter.domain.contract import Contract, ContractCheck

from draftsmith.kinds import DrafterKind, registered

DECLARATIONS = "draftsmith.plugins"


def owners(kinds: Mapping[str, DrafterKind], modules: Iterable[str]) -> dict[str, str]:
    """Each of ``modules`` that is a kind's own, with that kind's name: an own module and, where one
    is a package (``heads/<kind>/``), every module inside it, so splitting a kind's file into a
    package keeps it the kind's; a module two kinds claim is an error."""
    found = {}
    for module in modules:
        for name, kind in kinds.items():
            if any(module == own or module.startswith(own + ".") for own in kind.own_modules()):
                if found.setdefault(module, name) != name:
                    raise ValueError(f"{module} is declared the own module of two kinds: {found[module]} and {name}")
    return found


def reach(kinds: Mapping[str, DrafterKind]) -> dict[str, set[str]]:
    """For each kind, the kinds whose own modules its own modules may import: itself and every kind
    it builds on, followed through."""
    found = {}
    for name in kinds:
        seen, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo += kinds[current].builds_on if current in kinds else []
        found[name] = seen
    return found


def broken(
    modules: Iterable[str], imports: Iterable[tuple[str, str]], kinds: Mapping[str, DrafterKind]
) -> list[tuple[str, str, str]]:
    """The imports (``importer``, ``imported``) of a graph of ``modules`` that break the contract,
    each with why, and the declaration modules that declare no kind (importer and why, imported "")."""
    modules = set(modules)
    owner, allowed = owners(kinds, modules), reach(kinds)
    found = []
    for importer, imported in sorted(imports):
        kind = owner.get(imported)
        if kind is None or kind in allowed.get(owner.get(importer), ()):
            continue
        if importer not in owner:
            why = f"shared code imports no kind; reach {kind} through the registry (draftsmith.kinds.get({kind!r}))"
        else:
            why = (
                f"a module of kind {owner[importer]} imports one of kind {kind}: declare builds_on=({kind!r},) on "
                f"{owner[importer]}'s DrafterKind if it is {kind}'s with more, else reach {kind} through the registry"
            )
        found.append((importer, imported, why))
    for module in sorted(modules):
        if module.startswith(DECLARATIONS + ".") and module not in owner:
            found.append((module, "", "declares no registered kind: name its KIND in pyproject.toml's entry points"))
    return found


class KindsContract(Contract):
    """Shared code imports no kind's own modules; a kind's import only its own and those of the
    kinds it builds on (see the module docstring). No options: the kinds are the registry's."""

    type_name = "kinds"

    def check(self, graph, verbose: bool) -> ContractCheck:
        imports = [
            (importer, imported)
            for importer in graph.modules
            for imported in graph.find_modules_directly_imported_by(importer)
        ]
        problems = []
        for importer, imported, why in broken(graph.modules, imports, registered()):
            lines = [d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)]
            where = f" (l. {', '.join(map(str, lines))})" if lines else ""
            problems.append(f"{importer} -> {imported}{where}: {why}" if imported else f"{importer}: {why}")
        return ContractCheck(kept=not problems, metadata={"problems": problems})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for problem in check.metadata["problems"]:
            output.print_error(problem, bold=False)
            output.new_line()
