"""``ferry keys add|list|revoke``: manage the API keys stored in Redis.

The secret is printed once, by ``add``, and exists nowhere else: Redis keeps
only its SHA-256. Gateways read keys at request time, so a new or revoked key
takes effect on the next request (during a Redis outage gateways keep using
their cached copy; see docs/operations.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import redis

from services.gateway.admission.keystore import KeyExistsError, KeyRecord, KeyStore, Layout, sync_client
from shared import envs

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry keys", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--redis-url", default=None,
        help=f"Redis holding the keys [env FERRY_REDIS_URL; default {DEFAULT_REDIS_URL}]",
    )
    parser.add_argument(
        "--runtime-dir", default=None,
        help="use the embedded Redis of a `ferry serve --runtime-dir DIR` (unix://DIR/redis.sock)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="create a key and print its secret once")
    add.add_argument("name")
    add.add_argument("--priority", type=int, default=0,
                     help="default request priority for this key (lower runs first) [0]")
    add.add_argument("--rpm", type=_non_negative, default=0, help="requests per minute (0: unlimited)")
    add.add_argument("--tpm", type=_non_negative, default=0,
                     help="tokens (prompt + generated) per minute (0: unlimited)")
    add.add_argument("--admin", action="store_true",
                     help="may also read /metrics, /dashboard and /v1/config when the gateway binds a public address")
    sub.add_parser("list", help="names, priorities, limits and creation times (never secrets)")
    revoke = sub.add_parser("revoke", help="delete a key; requests using it get 401")
    revoke.add_argument("name")
    # Accept --redis-url and --runtime-dir after the subcommand too (`ferry keys add x --runtime-dir D`).
    for child in (add, revoke, sub.choices["list"]):
        child.add_argument("--redis-url", dest="redis_url_sub", default=None, help=argparse.SUPPRESS)
        child.add_argument("--runtime-dir", dest="runtime_dir_sub", default=None, help=argparse.SUPPRESS)
    return parser


def redis_target(args: argparse.Namespace) -> tuple[str, str]:
    """The Redis URL to use and where it came from (for the message when it is unreachable).

    An explicit flag wins over the other (after the subcommand over before it), then
    FERRY_REDIS_URL, then the default.
    """
    runtime_dir = args.runtime_dir_sub or args.runtime_dir
    if args.redis_url_sub:
        return args.redis_url_sub, "--redis-url"
    if runtime_dir:
        return f"unix://{os.path.abspath(runtime_dir)}/redis.sock", f"--runtime-dir {runtime_dir}"
    if args.redis_url:
        return args.redis_url, "--redis-url"
    if url := envs.field_env("redis_url"):
        return url, "FERRY_REDIS_URL"
    return DEFAULT_REDIS_URL, "the default"


def unreachable_message(url: str, source: str, exc: Exception) -> str:
    return (f"ferry keys: cannot reach Redis at {_redact(url)} ({source}): {exc}\n"
            "  `ferry serve` keeps its keys in an embedded Redis at unix://RUNTIME_DIR/redis.sock; point at it\n"
            "  with --runtime-dir RUNTIME_DIR (the runtime folder `ferry serve` prints, or its --runtime-dir),\n"
            "  or at any other Redis with --redis-url URL (or FERRY_REDIS_URL)")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _format_list(records: list[KeyRecord]) -> str:
    if not records:
        return "no keys"
    rows = [("NAME", "PRIORITY", "RPM", "TPM", "CREATED", "ADMIN")]
    for r in records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created)) + "Z"
        rows.append((r.name, str(r.priority), str(r.rpm or "-"), str(r.tpm or "-"), created, "yes" if r.admin else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def _redact(url: str) -> str:
    """Never print a Redis password."""
    scheme, sep, rest = url.partition("://")
    _, at, host = rest.rpartition("@")
    return f"{scheme}{sep}***@{host}" if at else url


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    url, source = redis_target(args)
    store = KeyStore(sync_client(url), Layout())
    try:
        if args.command == "add":
            secret, record = store.add(args.name, priority=args.priority, rpm=args.rpm, tpm=args.tpm,
                                       admin=args.admin)
            print(secret)
            print(f"key {record.name!r} created (priority {record.priority}, rpm {record.rpm or 'unlimited'}, "
                  f"tpm {record.tpm or 'unlimited'}{', admin' if record.admin else ''}); "
                  "the secret above is shown only once",
                  file=sys.stderr)
        elif args.command == "list":
            print(_format_list(store.list()))
        elif args.command == "revoke":
            if not store.revoke(args.name):
                print(f"ferry keys: no key named {args.name!r}", file=sys.stderr)
                return 1
            print(f"key {args.name!r} revoked", file=sys.stderr)
    except (KeyExistsError, ValueError) as exc:
        print(f"ferry keys: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(unreachable_message(url, source, exc), file=sys.stderr)
        return 2
    finally:
        store.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
