"""draftsmith: train and measure speculative-decoding drafters.

Subpackages: ``draftsmith.heads`` (drafter models), ``draftsmith.data_prep`` (datasets and
prompt sets), ``draftsmith.train`` (training entry points), ``draftsmith.eval`` (the shared
speculative decoding engine and benchmark CLI).
"""

__version__ = "0.1.0"
