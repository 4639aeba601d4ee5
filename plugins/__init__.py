"""The built-in drafter kinds' declarations: one module per kind, ``KIND`` (a
:class:`~draftsmith.kinds.DrafterKind`) built from the pieces the layers below provide (the
engine's drafter, the trainer, the export converters).

Each is named by one line of pyproject.toml's ``[project.entry-points."draftsmith.kinds"]``, from
which :mod:`draftsmith.kinds` loads them on its first lookup; nothing imports this package.
"""
