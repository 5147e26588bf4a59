"""Exact-match response cache for deterministic requests (temperature 0, or a fixed seed).

The key is the sha256 of the model's fingerprint, the server's routing settings and the request's normalised
generation fields, so equal requests to servers of the same checkpoint share entries (Redis) and nothing else
does. Values are the finished completion (text, token ids, finish reason) as JSON.

Why not cache expert outputs (hidden state -> expert output): a cache needs an exact key, and hidden states differ
from one context to the next in every bit (they mix the whole prefix through attention), so such a cache never
hits outside of identical prefixes, which the response cache (and a prefix cache) already cover.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any


def cache_key(fingerprint: str, fields: dict[str, Any]) -> str:
    """``moetrain:v1:`` + sha256 hex of the fingerprint and the fields as canonical JSON."""
    blob = json.dumps({"model": fingerprint, **fields}, sort_keys=True, separators=(",", ":"))
    return "moetrain:v1:" + hashlib.sha256(blob.encode()).hexdigest()


class LRUCache:
    """In-process LRU of at most ``capacity`` entries (thread-safe)."""

    kind = "memory"
    remote = False  # called inline on the event loop (a dict lookup under a lock)

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._data: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> dict | None:
        with self._lock:
            value = self._data.get(key)
            if value is None:
                return None
            self._data.move_to_end(key)
        return json.loads(value)

    def put(self, key: str, value: dict) -> None:
        with self._lock:
            self._data[key] = json.dumps(value)
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)


class RedisCache:
    """A shared cache in Redis (``redis://host:port/db``); entries expire after ``ttl`` seconds.

    Raises:
        MoetrainError: the server cannot be reached (checked once at start-up with PING).
    """

    kind = "redis"
    remote = True  # network round trips: called on a worker thread

    def __init__(self, url: str, ttl: int = 24 * 3600):
        import redis

        from moetrain.errors import MoetrainError

        self.url, self.ttl = url, ttl
        self._client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            self._client.ping()
        except redis.RedisError as e:
            raise MoetrainError(f"--cache {url}: cannot reach Redis: {e}") from None

    def get(self, key: str) -> dict | None:
        import redis

        try:
            value = self._client.get(key)
        except redis.RedisError:  # a cache that is down is a miss, not a failed request
            return None
        return None if value is None else json.loads(value)

    def put(self, key: str, value: dict) -> None:
        import redis

        try:
            self._client.set(key, json.dumps(value), ex=self.ttl)
        except redis.RedisError:
            pass


def open_cache(spec: str | None):
    """``None``/``memory`` -> :class:`LRUCache`; ``memory:N`` -> LRU of N entries; ``off`` -> ``None``;
    ``redis://...`` -> :class:`RedisCache`.

    Raises:
        MoetrainError: any other spec, or an unreachable Redis.
    """
    from moetrain.errors import MoetrainError

    if spec is None or spec == "memory":
        return LRUCache()
    if spec == "off":
        return None
    if spec.startswith("memory:") and spec[7:].isdigit() and int(spec[7:]) > 0:
        return LRUCache(int(spec[7:]))
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisCache(spec)
    raise MoetrainError(f"--cache {spec!r}: expected memory, memory:N, off or redis://HOST:PORT[/DB]")
