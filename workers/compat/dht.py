"""The DHT node: its authorizer, inside the DHT's process.

Mirrors ``hivemind/dht/node.py`` and ``hivemind/dht/protocol.py``: :func:`node_authorizer` reads
``DHTNode.protocol.authorizer`` (set by ``DHTProtocol.create``), for which hivemind has no accessor. Nothing is
replaced.
"""

from __future__ import annotations

from typing import Any


def node_authorizer(node: Any) -> Any:
    """The authorizer of a DHT node, inside the DHT's process (for ``DHT.run_coroutine`` callbacks)."""
    return node.protocol.authorizer
