"""Per-key rate limits: one token-bucket algorithm, run atomically in Redis or locally.

Each key has up to two buckets, requests and tokens. A bucket holds at most
``limit`` units (the per-minute limit, so a full minute's allowance may come as a
burst) and refills continuously at ``limit / 60`` units per second. A request is
admitted only if every enabled bucket can pay its cost; then both are debited
together, otherwise neither is.

Shared limits: the whole decision (read the key record, refill, compare, debit)
is one Lua script, so it is atomic on the Redis server and uses the server's
clock; any number of gateways sharing a Redis share one allowance, never a
multiple of it. A bucket key expires once it would be full again, so idle keys
cost no memory.

Fallback: ``LocalLimiter`` runs the same arithmetic in process memory when Redis
is unreachable (per gateway, so N gateways allow up to N times the limit during
an outage; documented in docs/operations.md).

Token accounting: admission reserves ``prompt + max_tokens`` (capped at the
bucket size so a long max_tokens cannot lock a key out forever); after the
request, ``refund`` gives back what was reserved but not generated, or takes
more if the request used more than it reserved. The bucket may go negative
(debt), which delays the key's next requests: the long-run rate is the limit.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

WINDOW_S = 60.0

# KEYS: auth flag, key record, request bucket, token bucket.
# ARGV: prompt tokens, max_tokens. The token cost is prompt + max_tokens capped at
# the bucket size. Returns strings (Redis truncates Lua floats to integers):
# {status, name, priority, rpm, tpm, remaining_req, remaining_tok, retry_after_s,
#  reset_req_s, reset_tok_s, cost}; status is ok | limited | too_large (the prompt
# alone exceeds tpm) | unknown (no such key) | open (no key was ever added).
ADMIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'open'} end
local rec = redis.call('HMGET', KEYS[2], 'name', 'priority', 'rpm', 'tpm')
if not rec[1] then return {'unknown'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm = tonumber(rec[3]) or 0
local tpm = tonumber(rec[4]) or 0
local prompt = tonumber(ARGV[1])
local cost = prompt + tonumber(ARGV[2])
if tpm > 0 and cost > tpm then cost = tpm end
local window = 60.0

local function level(key, cap)
  local s = redis.call('HMGET', key, 'v', 't')
  if not s[1] then return cap end
  local v = tonumber(s[1]) + (now - tonumber(s[2])) * cap / window
  if v > cap then v = cap end
  return v
end

local function store(key, cap, v)
  redis.call('HSET', key, 'v', tostring(v), 't', tostring(now))
  local ms = math.ceil((cap - v) * window / cap * 1000) + 1000
  redis.call('PEXPIRE', key, ms)
end

local req, tok = 0, 0
local wait = 0
local status = 'limited'
if rpm > 0 then
  req = level(KEYS[3], rpm)
  if req < 1 then wait = math.max(wait, (1 - req) * window / rpm) end
end
if tpm > 0 then
  tok = level(KEYS[4], tpm)
  if tok < cost then wait = math.max(wait, (cost - tok) * window / tpm) end
end
if tpm > 0 and prompt > tpm then
  status = 'too_large'
elseif wait == 0 then
  status = 'ok'
  if rpm > 0 then req = req - 1; store(KEYS[3], rpm, req) end
  if tpm > 0 then tok = tok - cost; store(KEYS[4], tpm, tok) end
end
local reset_req, reset_tok = 0, 0
if rpm > 0 then reset_req = (rpm - req) * window / rpm end
if tpm > 0 then reset_tok = (tpm - tok) * window / tpm end
return {status, rec[1], tostring(rec[2] or '0'), tostring(rpm), tostring(tpm), tostring(req),
        tostring(tok), tostring(wait), tostring(reset_req), tostring(reset_tok), tostring(cost)}
"""

# KEYS: token bucket. ARGV: bucket size (tpm), delta (+ gives tokens back, - takes more).
REFUND_LUA = """
local cap = tonumber(ARGV[1])
local delta = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local s = redis.call('HMGET', KEYS[1], 'v', 't')
local v = cap
if s[1] then
  v = tonumber(s[1]) + (now - tonumber(s[2])) * cap / 60.0
  if v > cap then v = cap end
end
v = v + delta
if v > cap then v = cap end
redis.call('HSET', KEYS[1], 'v', tostring(v), 't', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - v) * 60.0 / cap * 1000) + 1000)
return tostring(v)
"""


@dataclass(frozen=True)
class Decision:
    """The outcome of one admission check, with what the headers need."""

    allowed: bool
    rpm: int
    tpm: int
    remaining_requests: float
    remaining_tokens: float
    retry_after_s: float
    reset_requests_s: float
    reset_tokens_s: float

    @classmethod
    def from_script(cls, reply: list[str]) -> Decision:
        _, _, _, rpm, tpm, req, tok, wait, reset_req, reset_tok, _ = reply
        return cls(
            allowed=reply[0] == "ok", rpm=int(float(rpm)), tpm=int(float(tpm)),
            remaining_requests=float(req), remaining_tokens=float(tok),
            retry_after_s=float(wait), reset_requests_s=float(reset_req),
            reset_tokens_s=float(reset_tok),
        )

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers (plus Retry-After when refused)."""
        out: dict[str, str] = {}
        if self.rpm > 0:
            out["x-ratelimit-limit-requests"] = str(self.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self.remaining_requests)))
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s)
        if self.tpm > 0:
            out["x-ratelimit-limit-tokens"] = str(self.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(self.remaining_tokens)))
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s)
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


def format_duration(seconds: float) -> str:
    """Durations the way OpenAI's reset headers write them: '120ms', '6s', '1m30s'."""
    seconds = max(0.0, seconds)
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def token_cost(num_prompt_tokens: int, max_tokens: int, tpm: int) -> int:
    """Tokens reserved at admission: the worst case, capped at the bucket size."""
    cost = max(0, num_prompt_tokens) + max(0, max_tokens)
    return min(cost, tpm) if tpm > 0 else cost


@dataclass
class _Bucket:
    level: float
    stamp: float


@dataclass
class LocalLimiter:
    """The same token buckets in process memory: the per-gateway fallback.

    State is bounded by the number of keys: one entry per (key, kind), removed
    once the bucket would be full again.
    """

    clock: object = field(default=time.monotonic)
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)

    def _now(self) -> float:
        return float(self.clock())  # type: ignore[operator]

    def _level(self, ident: tuple[str, str], cap: int, now: float) -> float:
        bucket = self._buckets.get(ident)
        if bucket is None:
            return float(cap)
        return min(float(cap), bucket.level + (now - bucket.stamp) * cap / WINDOW_S)

    def admit(self, key_id: str, rpm: int, tpm: int, cost: int) -> Decision:
        now = self._now()
        self._prune(now)
        req = self._level((key_id, "req"), rpm, now) if rpm > 0 else 0.0
        tok = self._level((key_id, "tok"), tpm, now) if tpm > 0 else 0.0
        wait = 0.0
        if rpm > 0 and req < 1:
            wait = max(wait, (1 - req) * WINDOW_S / rpm)
        if tpm > 0 and tok < cost:
            wait = max(wait, (cost - tok) * WINDOW_S / tpm)
        allowed = wait == 0.0
        if allowed:
            if rpm > 0:
                req -= 1
                self._buckets[(key_id, "req")] = _Bucket(req, now)
            if tpm > 0:
                tok -= cost
                self._buckets[(key_id, "tok")] = _Bucket(tok, now)
        return Decision(
            allowed=allowed, rpm=rpm, tpm=tpm, remaining_requests=req, remaining_tokens=tok,
            retry_after_s=wait,
            reset_requests_s=(rpm - req) * WINDOW_S / rpm if rpm > 0 else 0.0,
            reset_tokens_s=(tpm - tok) * WINDOW_S / tpm if tpm > 0 else 0.0,
        )

    def refund(self, key_id: str, tpm: int, delta: float) -> float:
        now = self._now()
        level = min(float(tpm), self._level((key_id, "tok"), tpm, now) + delta)
        self._buckets[(key_id, "tok")] = _Bucket(level, now)
        return level

    def clear(self) -> None:
        self._buckets.clear()

    def _prune(self, now: float) -> None:
        # Cheap enough per call: entries are per key, not per request.
        if len(self._buckets) < 1024:
            return
        full = [k for k, b in self._buckets.items() if b.level >= 0 and now - b.stamp > WINDOW_S]
        for k in full:
            del self._buckets[k]

    def __len__(self) -> int:
        return len(self._buckets)


_Call = tuple[Any, list[str], list[int], "asyncio.Future[Any]"]  # (script, keys, args, result)


class SharedLimiter:
    """Runs the limit scripts in Redis, coalescing concurrent calls into one round trip.

    Every admission or refund waiting at the same moment goes out in one
    pipeline on one connection (each script still runs atomically on its own),
    so a burst of requests costs one round trip, not one connection each: a
    burst never turns into a storm of connects that time out against a healthy
    Redis.
    """

    MAX_BATCH = 256

    def __init__(self, client: aioredis.Redis, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self._admit = client.register_script(ADMIT_LUA)
        self._refund = client.register_script(REFUND_LUA)
        self._pending: list[_Call] = []
        self._flusher: asyncio.Task[None] | None = None

    async def admit(self, keys: list[str], args: list[int]) -> list[str]:
        """The admission script's reply; raises RedisError/OSError/TimeoutError when Redis fails."""
        return list(await self._call(self._admit, keys, args))

    async def refund(self, key: str, tpm: int, delta: int) -> None:
        await self._call(self._refund, [key], [tpm, delta])

    async def _call(self, script: Any, keys: list[str], args: list[int]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        # At most one batch ahead of ours, then ours.
        return await asyncio.wait_for(asyncio.shield(future), self.timeout_s * 2)

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self.MAX_BATCH], self._pending[self.MAX_BATCH:]
            try:
                replies = await asyncio.wait_for(self._run(batch), self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(exc if isinstance(exc, Exception) else TimeoutError())
                if not isinstance(exc, Exception):
                    raise
                continue
            for (*_, future), reply in zip(batch, replies, strict=True):
                if future.done():
                    continue
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)

    async def _run(self, batch: list[_Call]) -> list[Any]:
        if len(batch) == 1:
            script, keys, args, _ = batch[0]
            return [await script(keys=keys, args=args)]
        pipe = self.client.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            await script(keys=keys, args=args, client=pipe)
        return list(await pipe.execute(raise_on_error=False))
