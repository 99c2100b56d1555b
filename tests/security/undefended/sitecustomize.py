"""Honest volunteers without robust averaging, for the poisoning benchmark's "before" figures.

Put this folder first on ``PYTHONPATH``: every Python process of that volunteer loads it at start-up and
turns :func:`workers.compat.install_robust_averaging` into a no-op, so the worker averages as plain
hivemind does (its NaN guards stay). Only ``tests/perf/bench_poisoning.py --swarms undefended`` uses it.
"""

from __future__ import annotations

from workers import compat

compat.install_robust_averaging = lambda: None
