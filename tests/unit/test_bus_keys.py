"""CURVE on the bus: a loopback bus needs no keys; any other bind needs them, and then
only processes holding the job's keys get through (encrypted, ZAP-authenticated)."""

from __future__ import annotations

import asyncio
import socket
import stat

import pytest

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient, BusError
from elaswave.bus.keys import check_bind, generate_keys, load_keys
from elaswave.bus.schema import StepCompleted, Topic

pytestmark = pytest.mark.timeout(60)


def _interface_address() -> str:
    """This host's address on its default route (no packet is sent), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def test_keys_are_written_once_with_private_secrets(tmp_path):
    keys = generate_keys(tmp_path / "k")
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    for name in ("client.key_secret", "server.key_secret"):
        assert stat.S_IMODE((tmp_path / "k" / name).stat().st_mode) == 0o600
    assert load_keys(tmp_path / "k") == keys and keys.server.public != keys.client.public
    with pytest.raises(ValueError, match="already holds keys"):
        generate_keys(tmp_path / "k")


def test_missing_or_bad_keys_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"server.key_secret' is missing; make keys with"):
        load_keys(tmp_path)
    generate_keys(tmp_path / "k")
    (tmp_path / "k" / "client.key_secret").write_text("not a certificate")
    with pytest.raises(ValueError, match=r"client\.key_secret"):
        load_keys(tmp_path / "k")


def test_binding_beyond_loopback_without_keys_is_refused():
    check_bind("127.0.0.1", keyed=False)
    check_bind("::1", keyed=False)
    check_bind("192.0.2.2", keyed=True)
    with pytest.raises(ValueError, match=r"0\.0\.0\.0: binding beyond loopback needs CURVE keys"):
        Broker("0.0.0.0")
    with pytest.raises(ValueError, match=r"192\.0\.2\.2: binding beyond loopback needs CURVE"):
        Broker("192.0.2.2")
    with pytest.raises(ValueError, match="'localhost': must be an IP address of this host"):
        Broker("localhost")


WAIT_S = 1.5


async def _round_trip(broker: Broker, keys) -> StepCompleted:
    client = BusClient("rank0", broker.publish_endpoint, broker.subscribe_endpoint,
                       [Topic.METRICS], handshake_timeout=WAIT_S, keys=keys)  # fmt: skip
    async with client:
        sent = await client.publish(
            StepCompleted(sender="x", rank=0, step=1, loss=1.0, step_time_s=0.1, samples=4)
        )
        got = await asyncio.wait_for(client.recv(), WAIT_S)
        assert got == sent
        return got


async def test_only_holders_of_the_jobs_keys_get_through(tmp_path):
    keys = generate_keys(tmp_path / "job")
    other = generate_keys(tmp_path / "other")
    host = _interface_address()
    with Broker(host, keys=keys) as broker:
        assert broker.publish_endpoint.startswith(f"tcp://{host}:")
        await _round_trip(broker, keys)
        with pytest.raises(BusError, match="got no echo of its hello"):
            await _round_trip(broker, None)  # plain text against a CURVE server
        with pytest.raises(BusError, match="got no echo of its hello"):
            await _round_trip(broker, other)  # keys of another job: ZAP refuses them
