"""One kvduplex process of compare_transfer.py: `owner` (publishes its region) or `reader`
(READs the owner's blocks). Started and driven by compare_transfer.py over a JSON-lines channel
on stdin/stdout.

A layout has one block size, so each pattern gets fresh engines on both sides: the owner's
region as one segment of blocks of the pattern's size (stride = block size), and the same over
the reader's destination region. Engine start, registration and the handshake are untimed; a
timed batch is read_blocks (plan, bounds checks, posting; for a same-host owner and a batch up
to 1 MiB, the reads themselves) plus Transfer.wait. `same_host_reads` in the config turns same-host reads off
(kvduplex-ucx). Each engine listens on the config's `host` and authenticates its peers with
$KVDUPLEX_SECRET when that is set (a non-loopback host needs it).
"""

import os

from _bench_common import (
    Channel,
    Region,
    block_ids,
    pattern_from_dict,
    run_side,
    serve_commands,
    timed_batches,
)


def fingerprint(block_bytes: int) -> dict[str, str]:
    return {"model": "compare_transfer", "dtype": "uint8", "block_bytes": str(block_bytes)}


def start_engine(name: str, region: Region, block_bytes: int, host: str,
                 same_host_reads: bool = True):
    from kvduplex._core import Engine

    secret = os.environ.get("KVDUPLEX_SECRET")
    # Without same-host reads the comparison measures UCX's own same-host transport (cma),
    # which peer error handling (on by default) would trade for tcp.
    engine = Engine(name, fingerprint(block_bytes), host=host, same_host_reads=same_host_reads,
                    peer_error_handling=same_host_reads,
                    secret=secret.encode() if secret else None)
    engine.register_region(region.addr, region.nbytes)
    engine.set_layout([region.addr], block_bytes, block_bytes, region.nbytes // block_bytes)
    return engine


def owner(chan: Channel, config: dict) -> None:
    region = Region(config["region_bytes"], config["hugepages"])
    region.fill_pattern()
    chan.send(event="ready", memory=region.describe(), info={"host": config["host"]})
    engine = None

    def setup(cmd: dict) -> None:
        nonlocal engine
        pattern = pattern_from_dict(cmd["pattern"])
        engine = start_engine(f"kvd-owner-{pattern.name}", region, pattern.block_bytes,
                              config["host"])
        chan.send(event="setup", info={"port": engine.side_channel_port})

    def teardown(cmd: dict) -> None:
        nonlocal engine
        if engine is not None:
            engine.close()
            engine = None
        chan.send(event="teardown")

    serve_commands(chan, "kvduplex-owner", {"setup": setup, "teardown": teardown})


def reader(chan: Channel, config: dict) -> None:
    region = Region(config["region_bytes"], config["hugepages"])
    region.touch()
    chan.send(event="ready", memory=region.describe())

    def connect(cmd: dict) -> None:
        # Connections are per pattern (see run_pattern): a layout has one block size.
        chan.send(event="connect", info={})

    def run(cmd: dict) -> None:
        chan.send(event="result", **run_pattern(region, cmd, config))

    serve_commands(chan, "kvduplex-reader", {"connect": connect, "run": run})


def run_pattern(region: Region, cmd: dict, config: dict) -> dict:
    pattern = pattern_from_dict(cmd["pattern"])
    num_slots = region.nbytes // pattern.block_bytes
    local_ids = block_ids(pattern, num_slots, "local")
    remote_ids = block_ids(pattern, num_slots, "remote")
    local_list, remote_list = local_ids.tolist(), remote_ids.tolist()
    timeout_s = cmd["batch_timeout_s"]
    engine = start_engine(f"kvd-reader-{pattern.name}", region, pattern.block_bytes,
                          config["host"], config["same_host_reads"])
    try:
        peer = engine.connect(cmd["owner"]["host"], cmd["owner"]["port"], timeout_s=timeout_s)
        last = []

        def run_batch():
            transfer = engine.read_blocks(peer, local_list, remote_list, timeout_s=timeout_s)
            transfer.wait(timeout_s)
            last[:] = [transfer]

        result = timed_batches(
            pattern, region.blocks(pattern.block_bytes), local_ids, remote_ids, run_batch,
            cmd["warmup"], cmd["reps"],
        )
        result["num_descriptors"] = last[0].num_descriptors
        result["same_host"] = last[0].same_host
        return result
    finally:
        engine.close()


def check_build() -> None:
    import kvduplex._core  # noqa: F401  (fail before any work when the build is missing)


if __name__ == "__main__":
    run_side("kvduplex", {"owner": owner, "reader": reader}, check_build)
