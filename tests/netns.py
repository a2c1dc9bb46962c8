"""Hosts on one machine for multi-host tests: network namespaces behind veth pairs on a
bridge (needs root and iproute2; a test without them is skipped, not failed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _teardown(tag: str, count: int) -> None:
    for i in range(count):
        subprocess.run(["ip", "netns", "del", f"{tag}h{i}"], capture_output=True, check=False)
        # A namespace outlives its deletion while a process holds it: drop the link too.
        subprocess.run(["ip", "link", "del", f"{tag}v{i}"], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", f"{tag}br0"], capture_output=True, check=False)


@contextlib.contextmanager
def hosts(tag: str, net: str, count: int) -> Iterator[list[str]]:
    """Namespaces ``{tag}h0..`` at ``net.10..`` (their ``eth0``, behind host-side links
    ``{tag}v0..``) on bridge ``{tag}br0`` at ``net.1``; yields their addresses."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    _teardown(tag, count)
    try:
        ip("link", "add", f"{tag}br0", "type", "bridge")
        ip("addr", "add", f"{net}.1/24", "dev", f"{tag}br0")
        ip("link", "set", f"{tag}br0", "up")
        for i in range(count):
            ns = f"{tag}h{i}"
            ip("netns", "add", ns)
            ip("link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", f"{tag}v{i}", "master", f"{tag}br0", "up")
            ip("-n", ns, "addr", "add", f"{net}.{10 + i}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield [f"{net}.{10 + i}" for i in range(count)]
    finally:
        _teardown(tag, count)
