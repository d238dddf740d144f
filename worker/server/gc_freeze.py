"""Take what start-up built out of Python's cycle collector, so a full collection stays short.

A started worker holds ~185k objects the collector tracks (modules, the model's parameters and
buffers, captured graphs, the tokenizer), and they live as long as the process. A full (generation
2) collection walks all of them: on the H200 machine that was an 80 ms pause, landing wherever an
allocation happened to trigger it; in adapter loads it was the whole tail (one load in 9-15 took
114-189 ms against medians of 52-59; docs/benchmarks.md, "Cold adapter loads"), and in the engine
loop it would stall every running request for as long. `gc.freeze()` moves every
object alive now to a permanent generation that collections skip; what is created later is
collected as before. Objects frozen here are never freed by the collector if they later become
cyclic garbage, so this runs once, after a `gc.collect()` of start-up's own garbage.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
