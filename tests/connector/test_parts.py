"""The connector's pure parts: token fingerprints, the copy of announcements, config, stats,
auto threshold."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvduplex.connector import config as config_module
from kvduplex.connector import held_mirror
from kvduplex.connector import metadata as md
from kvduplex.connector.config import DuplexConfig
from kvduplex.connector.held_mirror import HeldMirror
from kvduplex.connector.stats import DuplexConnectorStats
from kvduplex.connector.threshold import RecomputeThresholdEstimator
from kvduplex.connector.token_fingerprint import (
    PromptFingerprints,
    block_fingerprints,
    matched_prefix_tokens,
)


def test_fingerprints_chain_over_blocks_and_cover_a_partial_tail():
    tokens = list(range(40))
    fps = block_fingerprints(tokens, 16)
    assert len(fps) == 3 and all(len(f) == 16 for f in fps)
    # Same block contents after a different prefix give a different fingerprint (chained).
    shifted = block_fingerprints([99] + tokens[1:], 16)
    assert shifted[0] != fps[0] and shifted[1] != fps[1]
    assert block_fingerprints(tokens[:32], 16) == fps[:2]
    assert block_fingerprints(tokens[:39], 16)[2] != fps[2]
    assert block_fingerprints(tokens, 16, salt="lora-a") != fps
    assert block_fingerprints(tokens, 8)[:1] != fps[:1]


def _documented_chain(tokens, block_size, salt):
    """The module docstring's definition, written out independently."""
    parent = hashlib.blake2b(
        b"kvduplex.token-fingerprint.v1" + block_size.to_bytes(4, "little") + salt.encode(),
        digest_size=8,
    ).digest()
    out = []
    for start in range(0, len(tokens), block_size):
        block = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[start : start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        out.append(parent.hex())
    return out


def test_prompt_fingerprints_hash_each_block_once_and_equal_the_documented_chain():
    tokens = [1000 + i for i in range(45)] + [-3]
    prompt = PromptFingerprints(tokens, 16, "salt")
    assert list(prompt.full_blocks) == _documented_chain(tokens[:32], 16, "salt")
    for n in range(len(tokens) + 1):
        assert prompt.of_prefix(n) == _documented_chain(tokens[:n], 16, "salt"), n
    assert block_fingerprints(tokens, 16, "salt") == _documented_chain(tokens, 16, "salt")
    # The partial blocks after k full blocks: one per length, up to a block less one.
    for full in range(3):
        tails = list(prompt.tails(full))
        assert [n for n, _ in tails] == list(range(1, min(15, len(tokens) - 16 * full) + 1))
        for n, fingerprint in tails:
            assert fingerprint == _documented_chain(tokens[: 16 * full + n], 16, "salt")[-1]
        assert list(prompt.tails(full, 5)) == tails[4:]
    assert list(prompt.tails(2, 15)) == []  # the prompt has 14 tokens after its full blocks


def test_a_turn_extends_its_prompts_fingerprints_hashing_only_the_blocks_past_them(monkeypatch):
    """A decode node holds a turn (prompt and answer) whose prompt it hashed for the pull."""
    from kvduplex.connector import token_fingerprint

    prompt_tokens = [1000 + i for i in range(37)]  # 2 full blocks and a 5-token tail
    turn = prompt_tokens + [7, 8, 9] * 10
    prompt = PromptFingerprints(prompt_tokens, 16, "salt")
    hashed = []
    real = token_fingerprint._digest
    monkeypatch.setattr(
        token_fingerprint, "_digest", lambda parent, block: hashed.append(len(block)) or real(parent, block)
    )
    extended = prompt.extended(turn)
    # Blocks 3 and 4 (the prompt's tail is inside block 3); blocks 1 and 2 were the prompt's.
    assert hashed == [16 * 8, 16 * 8]
    assert extended.of_prefix(len(turn)) == _documented_chain(turn, 16, "salt")
    with pytest.raises(ValueError, match="continue"):
        prompt.extended([1] + turn[1:])


def test_the_copy_of_what_decode_nodes_announced_bounds_what_they_may_hold():
    """Full blocks by the chain, a held turn's partial last block by its tokens; a copy that
    is stale, unsynced or guarding a handoff cannot tell."""
    turn = [1000 + i for i in range(16 * 3 + 10)]  # 3 full blocks and a 10-token tail
    mirror = HeldMirror()
    announced = md.AnnouncedChanges(True, tuple(block_fingerprints(turn, 16)), (), True)
    mirror.on_report(announced, now=100.0)
    nxt = PromptFingerprints(turn + [5] * 40, 16)
    assert mirror.may_hold(nxt, 16 * 3, now=100.1)
    assert mirror.may_hold(nxt, 16 * 3 + 10, now=100.1)
    assert mirror.may_hold(nxt, 16 * 3 + 11, now=100.1) is False
    # The tail's last token differs: only the full blocks are held (a tail counts whole).
    other = PromptFingerprints(turn[:-1] + [6] + [5] * 40, 16)
    assert mirror.may_hold(other, 16 * 3, now=100.1)
    assert mirror.may_hold(other, 16 * 3 + 1, now=100.1) is False
    assert mirror.may_hold(PromptFingerprints([7] * 80, 16), 1, now=100.1) is False
    assert mirror.may_hold(nxt, 1, now=100.0 + held_mirror.FRESH_S + 0.1) is None
    # A prompt handed off continues until its turn is announced.
    handed = [2000 + i for i in range(40)]
    mirror.handed_off(PromptFingerprints(handed, 16))
    assert mirror.may_hold(PromptFingerprints(handed + [3] * 30, 16), 1, now=100.1) is None
    mirror.on_report(md.AnnouncedChanges(False, (), (), False), now=100.2)
    assert mirror.may_hold(nxt, 1, now=100.2) is None


def test_the_copy_asks_to_be_renewed_shortly_before_it_goes_stale_once_it_is_trusted():
    mirror = HeldMirror()
    assert mirror.refresh_at() is None  # nothing arrived: lookups ask anyway
    mirror.on_report(md.AnnouncedChanges(True, (), (), False), now=100.0)
    assert mirror.refresh_at() is None  # a decode node has not announced all it holds
    mirror.on_report(md.AnnouncedChanges(False, (), (), True), now=100.5)
    renew = 100.5 + held_mirror.FRESH_S - held_mirror.REFRESH_LEAD_S
    assert mirror.refresh_at() == pytest.approx(renew)
    assert 100.5 < renew < 100.5 + held_mirror.FRESH_S
    # A step's report with nothing in it (nothing changed) renews it too.
    mirror.on_report(None, now=101.0)
    assert mirror.refresh_at() == pytest.approx(renew + 0.5)
    mirror.on_report(md.AnnouncedChanges(True, (), (), True, complete=False), now=101.2)
    assert mirror.refresh_at() is None


def test_a_prompt_continuing_a_handoff_names_that_prompts_end_until_its_turn_is_announced():
    """Its every token, the partial last block's included: a prompt that only shares full
    blocks with the handoff (a common system prompt) names nothing."""
    mirror = HeldMirror()
    handed = [2000 + i for i in range(40)]  # 2 full blocks and an 8-token tail
    handoff = PromptFingerprints(handed, 16)
    mirror.handed_off(handoff)
    assert mirror.continued(PromptFingerprints(handed + [3] * 30, 16)) == handoff.end
    assert mirror.continued(PromptFingerprints(handed, 16)) == handoff.end
    assert mirror.continued(PromptFingerprints(handed[:-1] + [4] + [3] * 30, 16)) is None
    assert mirror.continued(PromptFingerprints(handed[:39], 16)) is None
    # Whole blocks, and a prompt without one.
    whole, short = [3000 + i for i in range(32)], [4000 + i for i in range(9)]
    for prompt in (whole, short):
        mirror.handed_off(PromptFingerprints(prompt, 16))
        end = PromptFingerprints(prompt, 16).end
        assert mirror.continued(PromptFingerprints(prompt + [5] * 20, 16)) == end
    assert mirror.continued(PromptFingerprints(short[:8] + [5] * 20, 16)) is None
    # Once the turn is announced (its blocks include the handoff's last full one): nothing.
    turn = block_fingerprints(handed + [9] * 24, 16)
    mirror.on_report(md.AnnouncedChanges(False, tuple(turn), (), True), now=1.0)
    assert mirror.continued(PromptFingerprints(handed + [9] * 24 + [3] * 30, 16)) is None


@pytest.mark.parametrize(
    "local,expected",
    [
        (list(range(40)) + [5] * 30, (40, -1)),  # all of it, partial tail included
        (list(range(35)), (32, -1)),  # local ends inside the remote tail: not covered
        (list(range(20)) + [0] * 50, (16, 1)),  # block 1 differs
        ([7] + list(range(1, 40)), (0, 0)),
    ],
)
def test_matched_prefix(local, expected):
    remote = block_fingerprints(list(range(40)), 16)
    assert matched_prefix_tokens(PromptFingerprints(local, 16), remote, 40) == expected


def _option_rows(text: str) -> list[str]:
    """The rows of the `kv_connector_extra_config` table (the one headed `| key | default |`)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| key | default |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| `"):
            break
        rows.append(line)
    return rows


def test_the_docs_list_the_options_as_config_py_documents_them():
    """config.py's docstring owns the option table; docs/connector.md shows the same rows, and
    the README (a front page: no line over 120 characters) the same keys and defaults."""
    root = Path(__file__).resolve().parents[2]
    documented = _option_rows(config_module.__doc__)
    assert len(documented) >= 15
    assert _option_rows((root / "docs" / "connector.md").read_text()) == documented
    readme = (root / "README.md").read_text()

    def key_and_default(row: str) -> list[str]:
        return row.split(" | ")[:2]

    assert [key_and_default(row) for row in _option_rows(readme)] == [
        key_and_default(row) for row in documented
    ]
    assert len(readme.splitlines()) <= 250
    assert [line for line in readme.splitlines() if len(line) > 120] == []


def test_config_defaults_and_validation(monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    config = DuplexConfig.from_extra_config({})
    assert config == DuplexConfig()
    assert config.recompute_threshold == 64 and not config.bidirectional_kv_xfer
    auto = DuplexConfig.from_extra_config(
        {"kv_recompute_threshold": "auto", "bidirectional_kv_xfer": "true"}
    )
    assert auto.auto_recompute_threshold and auto.bidirectional_kv_xfer
    for bad in (
        {"kv_recompute_treshold": 3},
        {"kv_recompute_threshold": -1},
        {"kv_recompute_threshold": "many"},
        {"kv_lease_ttl_s": 0},
        {"kv_lease_ttl_s": 0.5},  # not above the 1 s read margin
        {"decode_kv_hold_max_fraction": 1.5},
        {"side_channel_port": 70000},
        {"side_channel_host": ""},
        {"bidirectional_kv_xfer": "maybe"},
        {"ucx_peer_error_handling": "sometimes"},
        {"lookup_timeout_ms": -1},
        {"lookup_timeout_ms": 10**6},
        {"decode_peers": ["no-port"]},
        {"decode_peers": ["host:99999"]},
        {"decode_peers": 7},
        {"allow_unauthenticated_peers": "perhaps"},
    ):
        with pytest.raises(ValueError, match="DuplexConnector"):
            DuplexConfig.from_extra_config(bad)


def test_nixl_connector_option_names_are_taken_or_refused_with_ours(caplog):
    """A config carried over from NixlConnector starts: its names for our options are taken
    (and logged with ours); its options with no equivalent are refused naming what we do."""
    with caplog.at_level(logging.WARNING, logger="kvduplex.connector.config"):
        config = DuplexConfig.from_extra_config(
            {"kv_lease_duration": 45, "decoder_kv_blocks_ttl": "480", "bidirectional_kv_xfer": True}
        )
    assert config.kv_lease_ttl_s == 45 and config.decode_kv_hold_ttl_s == 480
    assert "'kv_lease_ttl_s'" in caplog.text and "'decode_kv_hold_ttl_s'" in caplog.text
    same = DuplexConfig.from_extra_config({"kv_lease_duration": 45, "kv_lease_ttl_s": 45})
    assert same.kv_lease_ttl_s == 45
    with pytest.raises(ValueError, match="disagree; keep kv_lease_ttl_s"):
        DuplexConfig.from_extra_config({"kv_lease_duration": 45, "kv_lease_ttl_s": 30})
    with pytest.raises(ValueError, match="must exceed read_deadline_margin_s"):
        DuplexConfig.from_extra_config({"kv_lease_duration": 0.5})
    for key in ("backends", "num_threads", "engine_ttl", "enforce_handshake_compat"):
        with pytest.raises(ValueError, match=f"'{key}' is a NixlConnector option"):
            DuplexConfig.from_extra_config({key: 1})


def test_lookup_options():
    config = DuplexConfig.from_extra_config(
        {"lookup_timeout_ms": 40, "decode_peers": "10.0.0.2:5600, [::1]:5601"}
    )
    assert config.lookup_timeout_s == pytest.approx(0.04)
    assert config.decode_peers == ("10.0.0.2:5600", "[::1]:5601")
    assert DuplexConfig().lookup_timeout_s == pytest.approx(0.25)
    assert DuplexConfig.from_extra_config({"lookup_timeout_ms": 0}).lookup_timeout_s == 0


def test_secret_comes_from_the_named_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    config = DuplexConfig.from_extra_config(
        {"auth_secret_env": "MY_SECRET", "side_channel_host": "10.0.0.2"}
    )
    monkeypatch.delenv("MY_SECRET", raising=False)
    assert config.auth_secret() is None  # off loopback: the transfer core refuses to serve
    assert not (tmp_path / "kvduplex").exists()
    monkeypatch.setenv("MY_SECRET", "s3cret")
    assert config.auth_secret() == b"s3cret"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost"])
def test_loopback_engines_of_one_user_share_a_private_secret_by_default(
    monkeypatch, tmp_path, host
):
    """Without the variable, engines on loopback authenticate with a per-user secret file:
    made once, readable by its user alone, the same for every engine of that user."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVDUPLEX_SECRET", raising=False)
    config = DuplexConfig.from_extra_config({"side_channel_host": host})
    secret = config.auth_secret()
    path = tmp_path / "kvduplex" / "side-channel-secret"
    assert secret is not None and len(secret) >= 32
    assert path.read_bytes() == secret and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    assert DuplexConfig().auth_secret() == secret
    # Another user's secret (here: one others may read) is refused, not used.
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by it alone"):
        config.auth_secret()


def test_engines_made_together_agree_on_one_secret(tmp_path):
    """Eight processes create the secret at once: all read the one that was linked first."""
    path = tmp_path / "kvduplex" / "side-channel-secret"
    script = (
        "import sys; from pathlib import Path; "
        "from kvduplex.connector.config import per_user_secret; "
        "print(per_user_secret(Path(sys.argv[1])).decode())"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE)
        for _ in range(8)
    ]
    secrets = {process.communicate(timeout=60)[0].strip() for process in processes}
    assert all(process.returncode == 0 for process in processes)
    assert secrets == {path.read_bytes()}


def test_without_a_place_for_the_secret_loopback_peers_do_not_authenticate(
    monkeypatch, tmp_path, caplog
):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(blocked))
    monkeypatch.delenv("KVDUPLEX_SECRET", raising=False)
    with caplog.at_level(logging.WARNING):
        assert DuplexConfig().auth_secret() is None
    assert "connect without authenticating" in caplog.text


def test_stats_aggregate_and_reduce():
    worker = DuplexConnectorStats()
    for ms in range(1, 101):
        worker.record_transfer(ms / 1000, blocks_per_group=(2,), nbytes=1_000_000, tokens=32)
    scheduler = DuplexConnectorStats()
    scheduler.add("pulls_declined")
    scheduler.add("tokens_recomputed", 40)
    total = DuplexConnectorStats(data=worker.take().data).aggregate(scheduler)
    assert worker.is_empty() and worker.take() is None
    reduced = total.reduce()
    assert reduced["transfers"] == 100 and reduced["blocks"] == 200
    assert reduced["tokens_pulled"] == 3200 and reduced["tokens_recomputed"] == 40
    assert reduced["MB"] == 100.0
    assert reduced["mean_transfer_ms"] == pytest.approx(50.5)
    assert reduced["p99_transfer_ms"] == pytest.approx(99.0)
    assert "group0_blocks" not in reduced  # one KV-cache group: no per-group breakdown


def test_stats_per_kv_cache_group_add_up_and_aggregate():
    first = DuplexConnectorStats()
    first.record_transfer(0.001, blocks_per_group=[7, 3], nbytes=10_000, tokens=100)
    second = DuplexConnectorStats()
    second.record_transfer(0.001, blocks_per_group=[0, 2], nbytes=2_000, tokens=16)
    total = DuplexConnectorStats(data=first.take().data).aggregate(second.take())
    assert total.data["group_blocks"] == [7, 5]
    assert total.data["group_bytes"] == [7_000, 5_000]
    reduced = total.reduce()
    assert reduced["blocks"] == 12 and reduced["group0_blocks"] == 7
    assert reduced["group1_MB"] == 0.005


def test_auto_threshold_from_measured_speeds():
    estimator = RecomputeThresholdEstimator(default_threshold=64, max_model_len=4096)
    assert estimator.threshold() == 64
    # Steps of 256 tokens take 0.256 s: prefill costs 1 ms per token, a step 0.256 s.
    # Reads cost 5 ms + 0.1 ms per token.
    for tokens in (100, 200, 400, 800):
        estimator.observe_step(0.256, 256)
        estimator.observe_read(0.005 + 0.0001 * tokens, tokens)
    # Pull when 0.256 + 0.005 + 0.0001 n < 0.001 n, i.e. n > 290.
    assert estimator.threshold() == 291
    # An idle engine's lookup costs a round trip: worth what a pull is worth. A busy one's
    # costs the step the request misses (0.256 s): look up when
    # 0.256 + 0.256 + 0.005 + 0.0001 n < 0.001 n, i.e. n > 574.4.
    assert estimator.lookup_threshold(busy=False) == 291
    assert estimator.lookup_threshold(busy=True) == 575
    assert estimator.threshold() == 291


def test_auto_threshold_never_pulls_when_reading_is_slower_than_computing():
    estimator = RecomputeThresholdEstimator(default_threshold=64, max_model_len=4096)
    for tokens in (100, 200, 400, 800):
        estimator.observe_step(0.064, 256)
        estimator.observe_read(0.001 * tokens, tokens)
    assert estimator.threshold() == 4097


def test_rank_reads_map_kv_heads_between_tp_sizes():
    from kvduplex.connector.tp import RankRead, mappable, rank_reads

    # Equal sizes: rank r reads rank r's whole pages.
    assert rank_reads(8, 2, 1, 2, None) == [RankRead(1, None)]
    # P at TP=1, D at TP=2: each D rank reads its half of P's page into its whole page.
    assert rank_reads(8, 2, 0, 1, 100) == [RankRead(0, (0, 0, 400))]
    assert rank_reads(8, 2, 1, 1, 100) == [RankRead(0, (400, 0, 400))]
    # P at TP=2, D at TP=1: D's one rank reads each P rank's page into its half.
    assert rank_reads(8, 1, 0, 2, 100) == [RankRead(0, (0, 0, 400)), RankRead(1, (0, 400, 400))]
    # TP=4 reader from TP=2 owner, and TP=2 from TP=4: quarter and half pages.
    assert rank_reads(8, 4, 3, 2, 10) == [RankRead(1, (20, 0, 20))]
    assert rank_reads(8, 2, 1, 4, 10) == [RankRead(2, (0, 0, 20)), RankRead(3, (0, 20, 20))]
    # Every head of every reader rank comes from exactly one owner rank, once.
    for reader_tp, owner_tp in [(1, 4), (4, 1), (2, 8), (8, 2), (4, 2)]:
        covered = []
        for rank in range(reader_tp):
            for read in rank_reads(8, reader_tp, rank, owner_tp, 1):
                remote, local, length = read.block_slice
                covered += [(rank, local + i, read.owner_rank * 8 // owner_tp + remote + i)
                            for i in range(length)]
        assert sorted(h for _, _, h in covered) == list(range(8)), (reader_tp, owner_tp)
        assert all(rank * 8 // reader_tp + local == head for rank, local, head in covered)
    # Not mappable: replicated heads, pages that are not head-major.
    assert "replicates" in mappable(2, 1, 4)
    assert mappable(2, 2, 2) is None
    with pytest.raises(ValueError, match="do not split evenly over tensor-parallel size 4"):
        rank_reads(2, 4, 0, 1, 100)
    with pytest.raises(ValueError, match="not head-major"):
        rank_reads(8, 2, 0, 1, None)


def test_the_options_and_the_params_are_checked_by_one_set_of_validators():
    """`config.py` and `params.py` used to repeat each other's checks, each with its own rules
    and messages; both now use `validate.py`'s, the options taking text too (a command line)."""
    from kvduplex.connector import validate

    for extra, check in (
        ({"layerwise_load": "yes"}, lambda: validate.boolean("yes", "layerwise_load")),
        ({"lookup_timeout_ms": 1.5}, lambda: validate.integer(1.5, "lookup_timeout_ms")),
        (
            {"side_channel_port": "70000"},
            lambda: validate.integer(70000, "side_channel_port", minimum=0, maximum=65535),
        ),
        ({"side_channel_host": ""}, lambda: validate.text("", "side_channel_host")),
    ):
        with pytest.raises(validate.Invalid) as checked:
            check()
        with pytest.raises(ValueError) as option:
            DuplexConfig.from_extra_config(extra)
        assert str(option.value) == f"DuplexConnector: {checked.value}"
    assert DuplexConfig.from_extra_config({"layerwise_load": "True"}).layerwise_load is True
    assert DuplexConfig.from_extra_config({"side_channel_port": "41000"}).side_channel_port == 41000
