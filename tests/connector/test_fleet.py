"""The fleet a prefill node looks prompts up in (`fleet.py`): this host's fleet directory and
`decode_peers` names, so that a P asks every D from its first lookup, whatever routed before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from duplex_harness import look_up, make_kv_caches, make_worker
from kvduplex.connector.fleet import (
    MAX_ENTRY_BYTES,
    Fleet,
    FleetDirectory,
    advertised_address,
    fleet_key,
)
from test_worker_transfer import NUM_BLOCKS, OWNER_ID, TURN_FINGERPRINTS, OwnerProcess

BIDIRECTIONAL = {"bidirectional_kv_xfer": True}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_directory_lists_live_engines_and_drops_the_dead_and_the_malformed(tmp_path: Path):
    directory = FleetDirectory(tmp_path / "fleet-x")
    directory.publish("d0/tp0", "127.0.0.1:7001")
    other = FleetDirectory(tmp_path / "fleet-x")
    other.publish("d1/tp0", "[::1]:7002")
    dead = tmp_path / "fleet-x" / "dead.json"
    dead.write_text(json.dumps({"engine_id": "gone", "address": "127.0.0.1:7003",
                                "pid": dead_pid()}))
    alive = {"engine_id": "big", "address": "127.0.0.1:7004", "pid": os.getpid()}
    (tmp_path / "fleet-x" / "big.json").write_text(
        json.dumps({**alive, "pad": "x" * MAX_ENTRY_BYTES})
    )
    (tmp_path / "fleet-x" / "bad.json").write_text("{not json")
    (tmp_path / "fleet-x" / "noport.json").write_text(json.dumps({**alive, "address": "h"}))
    (tmp_path / "fleet-x" / "link.json").symlink_to(tmp_path / "fleet-x" / "big.json")

    assert sorted(directory.read()) == [("d0/tp0", "127.0.0.1:7001"), ("d1/tp0", "[::1]:7002")]
    assert not dead.exists(), "a dead engine's entry is removed"
    assert (tmp_path / "fleet-x").stat().st_mode & 0o777 == 0o700

    other.withdraw()
    assert directory.read() == [("d0/tp0", "127.0.0.1:7001")]


def test_only_engines_of_one_secret_and_one_model_share_a_directory():
    model = {"kvduplex_protocol": "5", "model": "/m/a", "revision": "", "block_size": "128"}
    key = fleet_key(b"secret", model)
    assert key == fleet_key(b"secret", dict(model, page_layout="other: pairs by head"))
    assert key != fleet_key(b"other secret", model)
    assert key != fleet_key(None, model)
    assert key != fleet_key(b"secret", dict(model, model="/m/b"))


def test_members_are_the_directorys_others_and_decode_peers_resolved(tmp_path: Path):
    directory = FleetDirectory(tmp_path / "fleet-y")
    FleetDirectory(directory.path).publish("d0/tp0", "127.0.0.1:7001")
    fleet = Fleet(("localhost:7100", "no-such-host.invalid:7101"), directory)
    fleet.start("p0/tp0", advertised_address("0.0.0.0", 7000))
    try:
        members = fleet.members()
        # A name is dialed at each address it resolves to; one that does not resolve as written.
        assert ("127.0.0.1", 7100) in members and ("localhost", 7100) not in members
        assert ("no-such-host.invalid", 7101) in members
        assert ("127.0.0.1", 7001) in members
        assert ("127.0.0.1", 7000) not in members, "not itself"
        assert ("p0/tp0", "127.0.0.1:7000") in directory.read()
    finally:
        fleet.close()
    assert ("p0/tp0", "127.0.0.1:7000") not in directory.read(), "withdrawn at close"


@pytest.mark.slow
def test_a_prefill_node_finds_a_decode_node_on_its_host_that_never_read_from_it(
    tiny_config_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """No `decode_peers`, no pull between them: P's first lookup asks the D that holds the
    turn, found in this host's fleet directory (both processes share it). Before the fleet
    directory P knew no D and looked nothing up."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    owner = OwnerProcess(tiny_config_dir, engine_id=OWNER_ID, extra_config=BIDIRECTIONAL)
    worker = make_worker(tiny_config_dir, "p-fleet", make_kv_caches(NUM_BLOCKS), BIDIRECTIONAL)
    try:
        owner.hold(
            "turn", ttl_s=30, num_blocks=4, fingerprints=TURN_FINGERPRINTS, turn=True, offer="{}"
        )
        match = look_up(worker, "p-first", TURN_FINGERPRINTS)
        assert match is not None and match.matched_blocks == 4
        listed = list((tmp_path / "kvduplex").glob("fleet-*/*.json"))
        assert len(listed) == 2, listed
    finally:
        worker.shutdown()
        owner.stop()
    assert list((tmp_path / "kvduplex").glob("fleet-*/*.json")) == [], "both withdrew"
