"""The decoding engine and the drafter interface: the target runner and its KV cache, token trees,
verification, the decode loops, draft-length policies and every drafter (:mod:`.drafters`).

It imports nothing from the benchmark harness beside it (``draftsmith.eval.run``, ``.measure``,
``.report``, ...), from training or from export (``lint-imports`` holds this).
"""
