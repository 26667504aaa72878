"""The `kvduplex` command line. Each subcommand is one `register_*` function in `COMMANDS`: it adds
its parser to the subparsers and sets `run`, a function of the parsed arguments returning the exit
status."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from .demo import register_demo
from .proxy import config as proxy_config


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def register_proxy(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="OpenAI-compatible P/D router that remembers where each conversation's KV lives",
        description=(
            "Routes /v1/completions and /v1/chat/completions through a prefill server (P) and a "
            "decode server (D). A conversation (X-Conversation-Id header or 'conversation_id' "
            "body field) has its next turn's prefill pull the history's KV back from the D that "
            "holds it."
        ),
    )
    parser.add_argument(
        "--prefill", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="prefill servers"
    )
    parser.add_argument(
        "--decode", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="decode servers"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default %(default)s)")
    parser.add_argument(
        "--store",
        default="memory",
        metavar="memory|redis://HOST:PORT/DB",
        help="conversation store; Redis lets several proxy replicas share it (default %(default)s)",
    )
    parser.add_argument(
        "--conversation-ttl",
        type=_positive_float,
        default=proxy_config.DEFAULT_CONVERSATION_TTL_S,
        metavar="SECONDS",
        help="forget a conversation's decode-side KV after this long; keep it below the decode "
        "servers' lease on those blocks (default %(default)s)",
    )
    parser.add_argument(
        "--max-conversations",
        type=_positive_int,
        default=proxy_config.DEFAULT_MAX_CONVERSATIONS,
        help="conversations remembered at once; least recently written are evicted "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-store-bytes",
        type=_positive_int,
        default=proxy_config.DEFAULT_MAX_STORE_BYTES,
        help="memory bound of the in-memory store (default %(default)s)",
    )
    parser.add_argument(
        "--tenant-header",
        metavar="NAME",
        help="header naming the caller, set by a trusted gateway; conversations are scoped to "
        "it (default: scoped to the bearer API key)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=proxy_config.DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default %(default)s)",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="longest silence from an upstream during a response (default %(default)s)",
    )
    parser.add_argument(
        "--max-upstream-connections",
        type=_positive_int,
        default=512,
        help="connections to all upstreams together (default %(default)s)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=1024,
        help="requests handled at once; more get 503 (default %(default)s)",
    )
    parser.add_argument(
        "--health-interval",
        type=_non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="period of /health probes of the upstreams; 0 turns them off (default %(default)s)",
    )
    parser.add_argument(
        "--routing-headers",
        action="store_true",
        help="add x-kvduplex-prefill, x-kvduplex-decode and x-kvduplex-conversation headers "
        "to responses",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default %(default)s)",
    )
    parser.set_defaults(run=run_proxy, parser=parser)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from .proxy.app import create_app

    try:
        config = proxy_config.ProxyConfig(
            prefill=proxy_config.parse_upstream_list(args.prefill, "prefill"),
            decode=proxy_config.parse_upstream_list(args.decode, "decode"),
            store=args.store,
            conversation_ttl_s=args.conversation_ttl,
            max_conversations=args.max_conversations,
            max_store_bytes=args.max_store_bytes,
            tenant_header=args.tenant_header,
            max_body_bytes=args.max_body_bytes,
            read_timeout_s=args.upstream_timeout,
            max_upstream_connections=args.max_upstream_connections,
            health_interval_s=args.health_interval,
            routing_headers=args.routing_headers,
        )
    except proxy_config.ConfigError as exc:
        args.parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        limit_concurrency=args.max_concurrency,
        access_log=args.log_level == "debug",
    )
    return 0


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    register_proxy,
    register_demo,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvduplex", description="Bidirectional KV-cache transfer for vLLM P/D serving."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
