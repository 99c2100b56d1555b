"""volunteer-app: the shared core of the volunteer agent and the coordinator (settings, wire protocol,
tokens, hardware profiling, the coordinator and control-API clients, the agent service in ``agent/`` and
the ``volunteer-app`` CLI).

Never imports textual, fastapi, torch or hivemind at import time (tests/test_import_hygiene.py).
"""

__version__ = "0.1.0"
