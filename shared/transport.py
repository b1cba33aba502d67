"""Small ZeroMQ helpers shared by the services: endpoint preparation and framing.

Endpoints are configuration. For ``ipc://`` endpoints the parent folder is
created before binding.
"""

from __future__ import annotations

import os

import zmq


def prepare_endpoint(endpoint: str) -> str:
    """Create the folder of an ``ipc://`` endpoint so binding cannot fail on it."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
    return endpoint


def bind(ctx: zmq.Context, kind: int, endpoint: str, **opts: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.bind(prepare_endpoint(endpoint))
    return sock


def connect(ctx: zmq.Context, kind: int, endpoint: str, **opts: int | bytes) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock
