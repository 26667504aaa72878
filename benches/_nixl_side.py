"""One NIXL process of compare_transfer.py: `owner` (registers its region and keeps its UCX
worker progressing) or `reader` (READs the owner's blocks). Started and driven by
compare_transfer.py over a JSON-lines channel on stdin/stdout.

NIXL runs as vLLM's NixlConnector uses it: UCX backend, one descriptor per block prepared once
per pattern with prep_xfer_dlist on both sides, then per batch make_prepped_xfer + transfer +
polling check_xfer_state. Its progress thread is off (on 2 cores it halves throughput), so the
owner polls: spinning, or once a millisecond (see compare_transfer.py --spin-owners).
"""

import base64
import time

import numpy as np

from _bench_common import (
    Channel,
    Region,
    block_ids,
    pattern_from_dict,
    run_side,
    serve_commands,
    timed_batches,
)

MEM = "DRAM"


def make_agent(name: str):
    from nixl_cu12 import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
    agent = nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL has no UCX backend (plugins: {agent.get_plugin_list()})")
    return agent


def register(agent, region: Region) -> None:
    agent.register_memory(np.array([[region.addr, region.nbytes, 0]], dtype=np.uint64), MEM)


def block_descs(base: int, block_bytes: int, num_blocks: int) -> np.ndarray:
    descs = np.zeros((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    return descs


def owner(chan: Channel, config: dict) -> None:
    region = Region(config["region_bytes"], config["hugepages"])
    region.fill_pattern()
    agent = make_agent("nixl-owner")
    register(agent, region)
    chan.send(
        event="ready",
        memory=region.describe(),
        info={
            "name": agent.name,
            "base": region.addr,
            "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        },
    )
    # No progress thread: connection wire-up and tcp-emulated gets need the owner to progress,
    # so it spins; cma reads need nothing from it, so with "idle" it polls once a millisecond,
    # like an engine that checks for notifications once per step.
    wait_s = 0.0 if config["owner_poll"] == "spin" else 0.001
    while True:
        cmd = chan.poll(wait_s)
        if cmd is None:
            agent.get_new_notifs()
            continue
        if cmd["cmd"] == "quit":
            return
        # Nothing to set up or tear down per pattern: the whole region stays registered.
        chan.send(event=cmd["cmd"], info={})


def reader(chan: Channel, config: dict) -> None:
    region = Region(config["region_bytes"], config["hugepages"])
    region.touch()
    agent = make_agent("nixl-reader")
    register(agent, region)
    chan.send(event="ready", memory=region.describe())
    peer = None

    def connect(cmd: dict) -> None:
        nonlocal peer
        peer = agent.add_remote_agent(base64.b64decode(cmd["owner"]["metadata"]))
        agent.make_connection(peer)
        chan.send(event="connect", info={"peer": str(peer)})

    def run(cmd: dict) -> None:
        chan.send(event="result", **run_pattern(agent, peer, region, cmd))

    serve_commands(chan, "nixl-reader", {"connect": connect, "run": run})


def run_pattern(agent, peer, region: Region, cmd: dict) -> dict:
    pattern = pattern_from_dict(cmd["pattern"])
    owner_base = cmd["owner"]["base"]
    num_slots = region.nbytes // pattern.block_bytes
    local_ids = block_ids(pattern, num_slots, "local")
    remote_ids = block_ids(pattern, num_slots, "remote")
    local_idx = local_ids.astype(np.int32)
    remote_idx = remote_ids.astype(np.int32)
    local_side = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", block_descs(region.addr, pattern.block_bytes, num_slots), MEM
    )
    remote_side = agent.prep_xfer_dlist(
        peer, block_descs(owner_base, pattern.block_bytes, num_slots), MEM
    )
    deadline_s = cmd["batch_timeout_s"]

    def run_batch():
        handle = agent.make_prepped_xfer("READ", local_side, local_idx, remote_side, remote_idx)
        state = agent.transfer(handle)
        give_up = time.monotonic() + deadline_s
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            if time.monotonic() > give_up:
                raise TimeoutError(f"NIXL batch not done after {deadline_s} s")
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        agent.release_xfer_handle(handle)

    try:
        return timed_batches(
            pattern, region.blocks(pattern.block_bytes), local_ids, remote_ids, run_batch,
            cmd["warmup"], cmd["reps"],
        )
    finally:
        agent.release_dlist_handle(local_side)
        agent.release_dlist_handle(remote_side)


if __name__ == "__main__":
    run_side("nixl", {"owner": owner, "reader": reader})
