"""Measuring what a run does: bytes each collective moved (`comm`), activation bytes saved for
backward (`activations`), and what the strategies predict for both. Strategies expose facts
(their groups, layouts, shards); this package counts, computes and writes."""
