"""The sparse codecs' names and defaults, without torch: what the configuration checks need.

:mod:`editrain.sync.sparse` encodes and decodes with these; :mod:`editrain.sync.config`
checks ``sync.comm_dtype``, ``sync.topk_chunk``, ``sync.topk_k`` and ``sync.error_decay``
against them while a configuration is loaded (``editrain data`` loads one and never
imports torch).
"""

from __future__ import annotations

CHUNK = 4096
"""Default values per chunk (the 64 x 64 tiles of SparseLoCo, flattened)."""
K = 64
"""Default values kept per full chunk (1.56%, the density of the Covenant-72B run)."""
BITS = {"topk2": 2, "topk1": 1}
"""Code bits per kept value, per codec."""
DECAY = 0.95
"""Default error-feedback decay of the sparse codecs (SparseLoCo's beta)."""
OUTER_SGD = {"lr": 2.0, "momentum": 0.0, "nesterov": False}
"""The outer SGD's keyword arguments with a sparse codec when none are given: no momentum
(as in SparseLoCo, the decayed error feedback carries what momentum would) and lr 2
(docs/streaming.md section 4b says how it was chosen)."""
