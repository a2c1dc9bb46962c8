"""CURVE keys for the bus: what lets it bind beyond 127.0.0.1.

A loopback bus needs no keys: only processes of this host reach it. Any other bind must
be authenticated and encrypted (ZeroMQ CURVE): the broker holds the *server* key pair,
every process of the job holds the *client* pair and the server's public key, and the
broker's ZAP handler admits only clients whose public key is in the key directory.
``elaswave keys DIR`` writes both pairs; the job reads them with ``--bus-keys DIR``.

Files (ZeroMQ's certificate format, :func:`zmq.auth.create_certificates`)::

    DIR/server.key  DIR/server.key_secret  DIR/client.key  DIR/client.key_secret

Secret files are written mode 0600.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

_NAMES = ("server", "client")


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes


@dataclass(frozen=True)
class BusKeys:
    """The broker's key pair and the pair every client of the job uses."""

    directory: Path
    server: KeyPair
    client: KeyPair


def check_bind(host: str, *, keyed: bool) -> None:
    """Refuse a bus address that is not an IP address, or one beyond loopback without
    keys (``keyed``): the one bind rule, for the job's config and the broker alike."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ValueError(
            f"bus host {host!r}: must be an IP address of this host (127.0.0.1, the default, "
            "or an interface's address)"
        ) from None
    if not loopback and not keyed:
        raise ValueError(
            f"bus host {host}: binding beyond loopback needs CURVE keys; make them with "
            "`elaswave keys DIR` and pass --bus-keys DIR"
        )


def generate_keys(directory: Path) -> BusKeys:
    """Write a fresh server and client key pair into ``directory`` (created if needed);
    ValueError if it already holds keys (they are never overwritten)."""
    if not zmq.has("curve"):
        raise ValueError("this libzmq was built without CURVE: no keys can be made")
    existing = [p.name for n in _NAMES for p in directory.glob(f"{n}.key*")]
    if existing:
        raise ValueError(
            f"{str(directory)!r} already holds keys {sorted(existing)}: choose an empty "
            "directory (keys are never overwritten)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    for name in _NAMES:
        _, secret_file = zmq.auth.create_certificates(str(directory), name)
        os.chmod(secret_file, 0o600)
    return load_keys(directory)


def load_keys(directory: Path) -> BusKeys:
    """The key pairs in ``directory``; ValueError naming a missing or unreadable file."""
    pairs = {}
    for name in _NAMES:
        path = directory / f"{name}.key_secret"
        if not path.is_file():
            raise ValueError(
                f"bus keys: {str(path)!r} is missing; make keys with `elaswave keys {directory}`"
            )
        try:
            public, secret = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"bus keys: {str(path)!r} is not a key file ({exc})") from None
        if not public or not secret:
            raise ValueError(f"bus keys: {str(path)!r} holds no secret key")
        pairs[name] = KeyPair(public, secret)
    return BusKeys(directory, pairs["server"], pairs["client"])


def serve_curve(sock: zmq.Socket[Any], keys: BusKeys) -> None:
    """Make ``sock`` (a broker socket, before bind) a CURVE server."""
    sock.curve_secretkey = keys.server.secret
    sock.curve_publickey = keys.server.public
    sock.curve_server = True


def use_curve(sock: zmq.Socket[Any], keys: BusKeys) -> None:
    """Make ``sock`` (a client socket, before connect) a CURVE client of the broker."""
    sock.curve_secretkey = keys.client.secret
    sock.curve_publickey = keys.client.public
    sock.curve_serverkey = keys.server.public
