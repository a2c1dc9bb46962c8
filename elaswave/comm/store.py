"""The rendezvous store. It is hosted by the Core, outside every worker, so that the
death of any worker never takes the store down with it."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def serve_store(
    host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 60.0
) -> dist.TCPStore:
    """Start a TCPStore server in this process; ``port=0`` picks a free port (``store.port``)."""
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )


def connect_store(host: str, port: int, *, timeout_s: float = 60.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def fresh_client(store: dist.Store) -> dist.Store:
    """A new client of ``store``'s server (its own connection; a prefix store keeps its
    prefix): a wait another thread left blocked on ``store``'s connection does not
    hold it up."""
    clone: dist.Store = store.clone()  # type: ignore[attr-defined]  # not in torch's stubs
    return clone
