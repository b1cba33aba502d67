"""API keys stored in Redis: the key format, hashing, the Redis layout and CRUD.

A key is ``ferry-`` followed by 43 url-safe random characters (256 bits). Redis
never sees the key itself, only its SHA-256 (hex); a gateway hashes the presented
key and looks the record up by that hash, so no secret comparison happens in
Python at all. Because the key has 256 bits of entropy a plain (unsalted) hash is
enough: nothing can be brute-forced from it.

Layout (all under one prefix, ``ferry:`` by default)::

    ferry:key:<sha256>         HASH  name, priority, rpm, tpm, created[, admin]
    ferry:keynames             HASH  name -> sha256
    ferry:auth                 "1" once any key was ever added; it turns
                               authentication on and revoking keys never clears it,
                               so revoking the last key cannot open the server
    ferry:rl:<sha256>:req|tok  rate-limit buckets (see ratelimit.py)

Used by ``ferry keys`` (synchronous client) and by the gateway's admission
(asynchronous client); both take a client, this module only knows the layout.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

KEY_PREFIX = "ferry-"
DEFAULT_NAMESPACE = "ferry:"


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class KeyRecord:
    """One API key as stored (never the secret itself)."""

    name: str
    key_hash: str
    priority: int = 0
    rpm: int = 0
    """Requests per minute (0: unlimited)."""
    tpm: int = 0
    """Tokens (prompt + generated) per minute (0: unlimited)."""
    created: float = 0.0
    admin: bool = False
    """May read the operator's pages (/metrics, /dashboard, /v1/config) on a public bind."""

    def to_redis(self) -> dict[Any, Any]:
        fields = {
            "name": self.name,
            "priority": str(self.priority),
            "rpm": str(self.rpm),
            "tpm": str(self.tpm),
            "created": repr(self.created),
        }
        if self.admin:
            fields["admin"] = "1"
        return fields

    @classmethod
    def from_redis(cls, key_hash: str, fields: dict[Any, Any]) -> KeyRecord:
        def text(name: str, default: str = "0") -> str:
            value = fields.get(name, fields.get(name.encode(), default))
            return value.decode() if isinstance(value, bytes) else str(value)

        return cls(
            name=text("name", ""),
            key_hash=key_hash,
            priority=int(text("priority")),
            rpm=int(text("rpm")),
            tpm=int(text("tpm")),
            created=float(text("created")),
            admin=text("admin") == "1",
        )


@dataclass(frozen=True)
class Layout:
    """Redis key names under one namespace."""

    namespace: str = DEFAULT_NAMESPACE

    def record(self, key_hash: str) -> str:
        return f"{self.namespace}key:{key_hash}"

    @property
    def names(self) -> str:
        return f"{self.namespace}keynames"

    @property
    def auth_flag(self) -> str:
        return f"{self.namespace}auth"

    def bucket(self, key_hash: str, kind: str) -> str:
        return f"{self.namespace}rl:{key_hash}:{kind}"


def sync_client(url: str, timeout_s: float = 2.0) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0), decode_responses=True,
    )


def async_client(url: str, timeout_s: float) -> aioredis.Redis:
    """A client that fails fast: no retries, short socket timeouts.

    A dead or hung Redis must cost a request at most ``timeout_s``; the
    caller falls back to local limits and reconnects in the background.
    """
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=AsyncRetry(NoBackoff(), 0), decode_responses=True,
    )


class KeyExistsError(Exception):
    pass


class KeyStore:
    """Add, list and revoke keys (synchronous; used by ``ferry keys``)."""

    def __init__(self, client: redis.Redis, layout: Layout | None = None) -> None:
        self.client = client
        self.layout = layout or Layout()

    def add(self, name: str, priority: int = 0, rpm: int = 0, tpm: int = 0,
            admin: bool = False) -> tuple[str, KeyRecord]:
        """Create a key; returns (secret, record). The secret exists only in the return value."""
        if not name or any(c.isspace() for c in name):
            raise ValueError("key name must be non-empty and contain no whitespace")
        if rpm < 0 or tpm < 0:
            raise ValueError("limits must be >= 0 (0: unlimited)")
        secret = new_secret()
        record = KeyRecord(name=name, key_hash=hash_key(secret), priority=priority,
                           rpm=rpm, tpm=tpm, created=time.time(), admin=admin)
        # HSETNX reserves the name atomically, so two concurrent adds cannot both win.
        if not self.client.hsetnx(self.layout.names, name, record.key_hash):
            raise KeyExistsError(f"a key named {name!r} already exists")
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.layout.record(record.key_hash), mapping=record.to_redis())
        pipe.set(self.layout.auth_flag, "1")
        pipe.execute()
        return secret, record

    def list(self) -> list[KeyRecord]:
        names: dict[str, str] = self.client.hgetall(self.layout.names)  # type: ignore[assignment]
        pipe = self.client.pipeline(transaction=False)
        ordered = sorted(names.items())
        for _, key_hash in ordered:
            pipe.hgetall(self.layout.record(key_hash))
        records = []
        for (_, key_hash), fields in zip(ordered, pipe.execute(), strict=True):
            if fields:
                records.append(KeyRecord.from_redis(key_hash, fields))
        return records

    def revoke(self, name: str) -> bool:
        key_hash = self.client.hget(self.layout.names, name)
        if key_hash is None:
            return False
        assert isinstance(key_hash, str), "client must decode responses"
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.layout.record(key_hash))
        pipe.delete(self.layout.bucket(key_hash, "req"), self.layout.bucket(key_hash, "tok"))
        pipe.hdel(self.layout.names, name)
        pipe.execute()
        return True


async def load_all(client: aioredis.Redis, layout: Layout) -> tuple[bool, dict[str, KeyRecord]]:
    """(auth enabled, every key record by hash): the gateway's cache for Redis outages."""
    enabled = bool(await client.exists(layout.auth_flag))
    names = await client.hgetall(layout.names)  # type: ignore[misc]
    hashes = [h.decode() if isinstance(h, bytes) else str(h) for h in names.values()]
    records: dict[str, KeyRecord] = {}
    if hashes:
        pipe = client.pipeline(transaction=False)
        for key_hash in hashes:
            pipe.hgetall(layout.record(key_hash))
        for key_hash, fields in zip(hashes, await pipe.execute(), strict=True):
            if fields:
                records[key_hash] = KeyRecord.from_redis(key_hash, fields)
    return enabled, records


def redis_auth_enabled(url: str, timeout_s: float = 2.0) -> bool | None:
    """Whether keys in this Redis turn authentication on (None: Redis unreachable).

    For start-up checks such as refusing a public bind without authentication.
    """
    client = sync_client(url, timeout_s)
    try:
        return bool(client.exists(Layout().auth_flag))
    except redis.RedisError:
        return None
    finally:
        client.close()


# KEYS: names hash, key record, auth flag. ARGV: name, key hash, priority, rpm, tpm, created, admin.
# Puts one record back unless its name is taken (so concurrent restores from several
# gateways, or a key re-added meanwhile, never clobber anything).
RESTORE_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HSET', KEYS[2], 'name', ARGV[1], 'priority', ARGV[3], 'rpm', ARGV[4], 'tpm', ARGV[5],
             'created', ARGV[6])
  if ARGV[7] == '1' then
    redis.call('HSET', KEYS[2], 'admin', '1')
  end
end
redis.call('SET', KEYS[3], '1')
return 1
"""


async def restore(client: aioredis.Redis, layout: Layout, records: list[KeyRecord]) -> None:
    """Write cached key records back into a Redis that lost them (restarted without persistence).

    Only hashes and limits are written: the same records ``ferry keys add`` made.
    Gateways call this when authentication was on and the flag is gone, so a Redis
    crash never turns an authenticated server into an open one.
    """
    script = client.register_script(RESTORE_LUA)
    pipe = client.pipeline(transaction=False)
    for r in records:
        fields = r.to_redis()
        await script(keys=[layout.names, layout.record(r.key_hash), layout.auth_flag],
                     args=[r.name, r.key_hash, fields["priority"], fields["rpm"], fields["tpm"], fields["created"],
                           "1" if r.admin else "0"],
                     client=pipe)
    pipe.set(layout.auth_flag, "1")  # authentication stays on even with no key left to restore
    await pipe.execute()
