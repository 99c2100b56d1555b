"""A tiny TCP server and client for checking the lab's links, run inside its namespaces.

``python probe.py serve PORT``: answers each connection with the address it came from, then reads whatever
the client sends until it closes, and answers with how many bytes arrived. Serves until killed.

``python probe.py connect HOST PORT [--send BYTES] [--timeout S]``: prints one JSON line: ``{"ok": true,
"seen_as": "ADDR", "received": N, "seconds": S}``, or ``{"ok": false, "error": "..."}``. Every wait is bounded
by the timeout.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

CHUNK = 64 * 1024


def serve(port: int) -> None:
    listener = socket.create_server(("0.0.0.0", port), reuse_port=True)
    print("listening", flush=True)
    while True:
        connection, (address, _) = listener.accept()
        threading.Thread(target=_answer, args=(connection, address), daemon=True).start()


def _answer(connection: socket.socket, address: str) -> None:
    with connection:
        connection.settimeout(120)
        connection.sendall(f"{address}\n".encode())
        received = 0
        while chunk := connection.recv(CHUNK):
            received += len(chunk)
        connection.sendall(f"{received}\n".encode())


def connect(host: str, port: int, send: int, timeout: float) -> dict[str, object]:
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            connection.settimeout(timeout)
            reader = connection.makefile("rb")
            seen_as = reader.readline().decode().strip()
            sent_at = time.monotonic()
            block = b"x" * CHUNK
            left = send
            while left > 0:
                connection.sendall(block[: min(left, CHUNK)])
                left -= min(left, CHUNK)
            connection.shutdown(socket.SHUT_WR)
            received = int(reader.readline().decode().strip() or -1)
            return {
                "ok": True,
                "seen_as": seen_as,
                "received": received,
                "seconds": time.monotonic() - sent_at,
            }
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serving = commands.add_parser("serve")
    serving.add_argument("port", type=int)
    connecting = commands.add_parser("connect")
    connecting.add_argument("host")
    connecting.add_argument("port", type=int)
    connecting.add_argument("--send", type=int, default=0)
    connecting.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.port)
    else:
        print(json.dumps(connect(args.host, args.port, args.send, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
