"""Typed surface of the Rust extension `kvduplex._core`.

One `Engine` per process (per vLLM worker): it owns a UCX context and worker with a progress
thread, and a TCP side channel that serves this engine's metadata (UCX worker address, registered
regions with their rkeys, block layout, compatibility fingerprint) to peers. A reader connects to
an owner once, then posts batched one-sided READs of the owner's blocks; when the last byte of a
batch is read, the owner receives the batch's notification payload.
"""

from collections.abc import Sequence
from typing import Literal, final

ANNOUNCE_STRIDE: int
"""Of each held turn an owner announces every this many blocks (with its first, its prompt's
last full block and its last two): see `Engine.hold`."""

class KvDuplexError(Exception):
    """Base class of every error raised by kvduplex's Rust core."""

class UcxError(KvDuplexError):
    """UCX could not be loaded or a UCX call failed (message has the UCX status)."""

class HandshakeError(KvDuplexError):
    """The side-channel handshake with a peer failed (unreachable, timeout, malformed bytes)."""

class IncompatiblePeerError(HandshakeError):
    """Protocol version or compatibility fingerprint differs; the message names the field."""

class AuthenticationError(HandshakeError):
    """Shared-secret challenge/response failed or one side has no secret."""

class PlanError(KvDuplexError, ValueError):
    """Block ids or layouts are invalid (negative, out of range, outside registered memory)."""

class TransferError(KvDuplexError):
    """A batch read failed: peer gone, endpoint error, deadline passed, or cancelled."""

class PeerNotConnectedError(KvDuplexError):
    """No ready connection to the named peer engine (call `connect` first, or it died)."""

@final
class Transfer:
    """One posted batch of reads. Completion is reported once for the whole batch."""

    @property
    def nbytes(self) -> int: ...
    @property
    def num_descriptors(self) -> int:
        """Number of coalesced (local, remote, length) reads posted for the batch."""
    @property
    def same_host(self) -> bool:
        """Read directly from a process on this host (`same_host_reads`), not through
        UCX."""
    def done(self) -> bool:
        """True when every byte arrived; False while pending. Raises TransferError if failed."""
    def wait(self, timeout_s: float | None = None) -> None:
        """Block (GIL released) until done; raises TransferError on failure or TimeoutError."""

@final
class Lookup:
    """A lookup sent to several owners at once (`Engine.start_lookup`)."""

    def answers(
        self,
    ) -> list[
        tuple[str, str | None, tuple[str, int, int, float, bytes] | None, str | None] | None
    ]:
        """Per target, None until it answered, then (address asked, owner engine id, match,
        error): the match is (owner request id, matched blocks, claim id, claim seconds,
        offer), None when the owner holds none of the blocks; error says why there is no
        answer (unreachable, gone, or silent until 60 s past the lookup's timeout: replies
        are taken that long, so that the claim of a late one can be handed back)."""
    @property
    def asked(self) -> int:
        """How many targets were asked: without `request_id`, an owner that announced it holds
        none of the prompt is not asked, and its answer (no match) is there at once."""

@final
class Engine:
    def __init__(
        self,
        engine_id: str,
        fingerprint: dict[str, str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        ucx_lib_dir: str | None = None,
        heartbeat_s: float = 1.0,
        peer_error_handling: bool = True,
        lookup_claim_s: float = 30.0,
        allow_unauthenticated: bool = False,
        same_host_reads: bool = True,
    ) -> None:
        """Start UCX and the side channel. `port=0` picks a free port. `ucx_lib_dir`
        defaults to $KVDUPLEX_UCX_LIB_DIR, else the `libucx` wheel's lib directory.
        A peer is declared dead after 3 missed `heartbeat_s`. `peer_error_handling`: UCX peer
        error handling on every endpoint, so that a batch fails at its deadline whatever its
        peer does (its reads are cancelled without the peer's reply); off, a read a frozen peer
        never serves keeps its batch pending, and `close` waiting, until the peer serves it or
        dies. Off only to measure UCX's own same-host transports (with it UCX 1.22 reads host
        memory on one host over tcp instead of cma; same-host reads do not use UCX), and the
        same on every engine (UCX refuses a pair of endpoints that differ). A lookup's match
        stays claimed for its reader `lookup_claim_s`. Without a `secret` the side
        channel must listen on a loopback `host` unless `allow_unauthenticated` (trusted
        networks only). With `same_host_reads`, a peer on this host that proves which process
        it is has its host memory read with `process_vm_readv` (a batch per call) instead of
        UCX; off by itself when `UCX_TLS` rules out UCX's cma. Raises HandshakeError when it
        cannot listen."""
    @property
    def engine_id(self) -> str: ...
    @property
    def generation(self) -> int:
        """Random per engine start; peers use it to notice a restart."""
    @property
    def side_channel_host(self) -> str: ...
    @property
    def side_channel_port(self) -> int: ...
    def register_region(self, addr: int, length: int, *, owner: object | None = None) -> None:
        """Register memory (host or CUDA; UCX detects which) so peers can read it and reads
        write into it. `owner`: the object whose memory ``[addr, addr+length)`` is (a tensor,
        an array), which must keep it allocated while it lives: the engine holds it for as long
        as a read may write into the range, past ``close()`` when a read that close cannot stop
        is still out (a same-host copy blocked in the kernel, a read to a frozen peer without
        `peer_error_handling`), so ``close()`` returns after a bounded wait. Without an owner
        the caller keeps the range allocated until ``close()`` returned, and ``close()`` then
        waits for every such read, however long it takes. Either way the range is used for its
        blocks only: peers read it, and reads write into it, at any time until then (a batch's
        blocks only until it settles; after ``close()``, those of a batch that had not settled
        while the engine still holds `owner`). A null or empty range, or a host range not mapped
        now, is a ValueError or UcxError; nothing else can be checked."""
    def unregister_regions(self) -> int:
        """Stop offering this engine's memory (vLLM is about to unmap it for sleep): every
        region is unregistered (one a read of ours still writes into stays so until that read
        settles), no region nor layout is published and every reader's side-channel connection
        is closed, so a peer's read fails (a new handshake finds nothing to read) and our own
        reads fail too. `register_region` and `set_layout` serve again. Returns how many
        regions were unregistered."""
    def set_layout(
        self, segment_bases: Sequence[int], block_len: int, block_stride: int, num_blocks: int
    ) -> None:
        """Describe where blocks live: block b of segment s is
        [segment_bases[s] + b*block_stride, +block_len). Must lie in registered regions."""
    def connect(self, host: str, port: int, timeout_s: float = 10.0) -> str:
        """Handshake with the engine at host:port (blocking, GIL released; cached, retried
        with backoff until the deadline). Returns the connection's handle,
        "engine-id@host:port#n", which `read_blocks`, `notify` and `peer_alive` take."""
    def peer_status(
        self,
        host: str,
        port: int,
        *,
        expected_engine_id: str | None = None,
        timeout_s: float = 10.0,
    ) -> tuple[Literal["ready", "connecting", "failed"], str | None]:
        """Non-blocking: ("ready", handle), ("connecting", None) or ("failed", reason).
        The handle ("engine-id@host:port#n") names this connection: a read through it fails,
        rather than go elsewhere, once the connection died or was replaced. Starts a handshake
        (at most timeout_s, on a thread of the core) when none is under way and the backoff
        after the last failure passed; with expected_engine_id, a peer of another id is a
        failure."""
    def peer_alive(self, peer_engine_id: str) -> bool:
        """Whether the handle (or bare engine id) names a live connection."""
    def read_blocks(
        self,
        peer_engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        *,
        notify: bytes | None = None,
        timeout_s: float = 30.0,
        segments: tuple[int, int] | None = None,
        block_slice: tuple[int, int, int] | None = None,
    ) -> Transfer:
        """Copy the peer's blocks remote_block_ids[i] into local_block_ids[i] for every
        segment, or only for the segments in `range(*segments)` (e.g. one layer's, for a
        layer-by-layer pull). `block_slice=(remote_offset, local_offset, len)` copies only
        `len` bytes of each block pair, from `remote_offset` bytes into the remote block to
        `local_offset` bytes into the local one (heterogeneous TP: one rank's heads of a
        heads-outermost page); ids then pair one to one even where the two engines' block_len
        differ, the slice must fit inside each side's block_len, and sliced reads are never
        coalesced. A block_slice that is not three non-negative ints raises ValueError; one
        with len 0 or that does not fit a block raises PlanError (also a ValueError). Ids are
        bounds-checked before anything is posted. `notify` is delivered to
        the peer after the last byte was read. Fails after `timeout_s`, once none of its reads can
        still land (without peer error handling a read to a frozen peer may keep it pending).
        A same-host peer (`same_host_reads`) is read directly, by a copy thread of that peer's
        own (a peer whose reads never return stalls only its own batches). `peer_engine_id` is
        a connection's handle (`peer_status`, `connect`), or a bare engine id that exactly one
        live connection declared (PeerNotConnectedError while several do)."""
    def notify(self, peer_engine_id: str, payload: bytes) -> None:
        """Queue a notification without reading (e.g. 'not pulling; free your blocks') on the
        peer's own link, whose thread writes it, in order after the read-done notifications of
        batches already finished: a peer that stops reading delays only its own. Raises
        HandshakeError when 16 MiB wait for the peer already (a write that fails later ends
        the link)."""
    def known_peers(self) -> list[tuple[str, str]]:
        """(engine id, "host:port") of connected engines that announced their side channel:
        the engines that read from this one; forgotten when their connection ends."""
    def hold(
        self,
        request_id: str,
        num_blocks: int,
        lease_expiry: float,
        *,
        fingerprints: Sequence[str],
        turn: bool,
        offer: bytes = b"",
        prompt_blocks: int = 0,
    ) -> None:
        """Hold a finished request's blocks, whose tokens have `fingerprints` (16 hex
        characters per block), for readers until `lease_expiry` (seconds since the Unix epoch;
        one already past ends the hold at the next `expire_holds`). A reader is granted the leading blocks
        whose fingerprints equal its own, with a claim and `offer`. `turn=False`: a prefill
        node's prompt for its decode node, granted by name only and ended once a reader
        releases its claim; `turn=True`: a decode node's finished turn, also found by lookups
        and evictable; of a turn, its first block, every 16th, the last full block of its
        prompt (the first `prompt_blocks`; 0: unknown) and its last two are announced to the
        readers connected (the others count through the chain). Raises ValueError for a request
        already held, over 65,536 fingerprints or an offer over 512 KiB."""
    def expect_turn(self, request_id: str, end: str) -> None:
        """A decode node computes `request_id`'s turn and will hold it when it finishes
        (`end`: the fingerprint of its whole prompt, 16 hex characters): until `settle_turns`,
        a lookup that says it `continues` that prompt is told to ask again. Raises ValueError
        for a malformed fingerprint or past 4,096 turns expected at once."""
    def settle_turns(self, request_ids: Sequence[str]) -> None:
        """These expected turns are held now, or will not be (unknown ids are ignored)."""
    def release_hold(self, reader: str, request_id: str, claim_id: int) -> bool:
        """`reader` is done with its claim (only the claim's own reader can end it; it never
        ends the hold of a turn). True when this freed the hold."""
    def renew_hold(self, request_id: str, first_fingerprint: str) -> bool:
        """Renew the lease of a prompt held for a decode node that has not claimed it yet, for
        a reader whose prompt's first block has `first_fingerprint` (16 hex characters): by
        the hold's first lease's length from now, never past 10 first leases from when it was
        taken. False when nothing was renewed (unknown, ended, claimed, other tokens). Raises
        ValueError for a malformed fingerprint."""
    def expire_holds(self) -> list[str]:
        """End holds and claims whose time is up; returns the holds freed."""
    def evict_holds(
        self, num_blocks: int, *, prompts: bool = False, unread_prompts_s: float | None = None
    ) -> list[str]:
        """Free unclaimed held turns (`prompts`: prompts held for decode nodes too;
        `unread_prompts_s`: those no reader has claimed for that many seconds), least recently
        used first, until `num_blocks` blocks were freed or none is left; returns the holds
        freed. Raises ValueError for an `unread_prompts_s` that is negative or not finite."""
    def end_holds(self) -> list[str]:
        """The engine's weights changed (vLLM reset its caches): every hold ends, claimed ones
        too, and none is granted or found by a lookup again. Returns the holds freed now (the
        unclaimed ones); a claimed one is freed, and returned by `release_hold` or
        `expire_holds`, when its last claim ends."""
    def ended_claims_s(self) -> float | None:
        """Seconds until the last claim alive on an ended hold ends at the latest (released
        earlier, or not); None when no reader reads an ended hold."""
    def hold_occupancy(self) -> tuple[int, int, int]:
        """(claims alive now, blocks held, lookups told to ask again so far, as this engine
        computed the turn they continue: see `expect_turn`) on this engine's hold book."""
    def start_lookup(
        self,
        targets: Sequence[tuple[str, int]],
        fingerprints: Sequence[str],
        timeout_s: float = 1.0,
        *,
        request_id: str | None = None,
        continues: str | None = None,
    ) -> Lookup:
        """Ask every side channel in `targets` at once for the longest held turn starting with
        these blocks or, with `request_id`, for a grant of that hold's leading blocks that
        carry them, without waiting: a connected owner is asked right away, others are
        connected to first (within `timeout_s`; one handshake per owner at a time, on a thread
        of the core, however many lookups wait for it). A named
        hold the owner has not taken yet is asked for again until `timeout_s`, and so is an
        owner still computing the turn whose prompt ends with `continues` (the fingerprint of
        a whole prompt handed to a decode node, which this prompt continues). Without
        `request_id`, owners whose announcements say they hold none of the prompt are not
        asked (`Lookup.asked`), except, with `continues`, the engines this one granted that
        prompt to (every owner when it knows none of them among `targets`). Poll the returned
        lookup. A match is claimed for us until we release the claim."""
    def announced_changes(
        self, cursor: int | None, targets: Sequence[tuple[str, int]], max_whole: int
    ) -> tuple[int, bool, bool, list[str], list[str], bool]:
        """The block fingerprints the engines we are connected to announced they hold, as
        changes since `cursor` (from the last call; None: the whole set): `(cursor, whole,
        too_large, added, removed, synced)`. `whole`: `added` is the whole set. `too_large`:
        the whole set was due but has more than `max_whole` fingerprints (none sent). `synced`:
        every one of `targets` has announced all it holds."""
    def lookup_answers_seen(self) -> int:
        """How many answers this engine's lookups have had so far: read it before looking at
        the lookups' answers, then pass it to `wait_for_lookup_answers`."""
    def wait_for_lookup_answers(self, seen: int, timeout_s: float) -> int:
        """Wait (without the GIL) until the engine's lookups have more than `seen` answers in
        all, at most `timeout_s`; returns the count."""
    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Drain (sender, payload) notifications received so far, in order. The sender is
        `engine-id#connection`: pass it to `release_hold` as the reader."""
    def close(self) -> None:
        """Stop the progress thread and side channel, fail what is in flight (cancelling its
        reads), close endpoints, unregister memory. Returns once no read can write into memory
        registered without an owner; a read into memory registered with its owner that is
        still out after 2 s keeps that owner (and its region) alive until it ends."""
    def __enter__(self) -> Engine: ...
    def __exit__(self, _exc_type: object, _exc: object, _tb: object) -> None:
        """`close()`."""
