"""The models the coverage benchmark runs: the project's HF zoo (retarget.models.hf_zoo).

Each entry has `name`, `factory()` (a fresh model in train mode, seed 0, its default config with
only the sizes shrunk) and `inputs(batch)` (keyword arguments with labels, so that the output has
a loss). `ZOO_SOURCE` names the list a coverage table was made from.
"""

from __future__ import annotations

from retarget.models.hf_zoo import HF_ZOO

ZOO_SOURCE = "retarget.models.hf_zoo (every entry)"
ZOO = dict(HF_ZOO)
