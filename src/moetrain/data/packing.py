"""Whole documents as training examples (``data.packing=documents``): chunks, packed rows and token-budget
micro-batches, each a deterministic function of (seed, epoch) (the design and its measurements: docs/data.md,
"data.packing" and "Dynamic batching").

Legend: N = tokens in the split, C = chunks, S = data.seq_len, B = train.batch_size, T = train.tokens_per_batch.

A split is one stream ``doc_0 EOS doc_1 EOS ...`` (data/dataset.py). Document i with n tokens gives n + 1
(input, target) pairs: the inputs are the EOS before it and its n tokens, the targets its n tokens and its EOS (the
first document of a split has no EOS before it: n pairs). A document of more than S pairs is cut into chunks of S
pairs (the last one shorter), each a document of its own to the model. An epoch visits the chunks in the order
``default_rng([seed, epoch]).permutation(C)`` and batches them with :func:`pack_rows` (fixed shape,
``train.tokens_per_batch=0``) or :func:`budget_batches` (a token budget).
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np
import torch

from moetrain.data.batch import IGNORE_INDEX, PAD_DOCUMENT, PackedBatch

# Packing's trade-offs between padding and time, measured: docs/data.md, "Dynamic batching".
# Rows kept open while packing (best fit among them): more rows, less padding, more time per chunk.
OPEN_ROWS = 64
# A token-budget pool holds chunks worth this many budgets: sorted by length, neighbours differ little.
POOL_BUDGETS = 64
# A token-budget row is at least this many times as wide as the shortest chunk left (capped at S), so under ~1/32
# of it is padding (_pool_batches).
ROW_FILL = 32


class DocumentChunks:
    """The chunks of a token stream: chunk c has inputs ``tokens[start[c] : start[c] + length[c]]`` and targets
    the same span shifted by one token.

    Args:
        tokens: [N] integer ids, each document followed by ``eos_id`` (a memmap from :class:`PreparedData`); not
            copied. Tokens after the last EOS (a stream without a final EOS) are ignored.
        eos_id: the EOS id.
        seq_len: S, the most pairs per chunk.
    Raises:
        ValueError: ``seq_len < 1`` or no chunk (no document in the stream).
    """

    def __init__(self, tokens: np.ndarray, eos_id: int, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens, self.seq_len = tokens, seq_len
        eos = np.flatnonzero(np.asarray(tokens) == eos_id)  # [docs] positions of the EOS ending each document
        unit_start = np.concatenate([[0], eos[:-1]]).astype(np.int64)  # inputs begin at the previous EOS
        unit_len = eos.astype(np.int64) - unit_start  # pairs per document (0 for an empty first unit)
        keep = unit_len > 0
        unit_start, unit_len = unit_start[keep], unit_len[keep]
        pieces = -(-unit_len // seq_len)  # [docs] chunks per document
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)  # [C] index of the document's first chunk
        k = np.arange(int(pieces.sum())) - first  # [C] chunk number within its document
        self.start = np.repeat(unit_start, pieces) + k * seq_len  # [C]
        self.length = np.minimum(seq_len, np.repeat(unit_start + unit_len, pieces) - self.start)  # [C] in 1..S
        self.num_documents = int(keep.sum())
        if len(self.start) == 0:
            raise ValueError("no document in the token stream (no EOS)")

    def __len__(self) -> int:
        return len(self.start)

    def pairs(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) [length[c]] int64 of chunk ``c``."""
        a, n = int(self.start[c]), int(self.length[c])
        span = np.asarray(self.tokens[a : a + n + 1]).astype(np.int64)
        return span[:-1], span[1:]


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, open_rows: int = OPEN_ROWS) -> list[list[int]]:
    """Pack chunks into rows of ``seq_len`` positions, keeping every chunk whole.

    Chunks are taken in ``order``; each goes into the open row with the least room that fits it (best fit), else
    a new row; when more than ``open_rows`` rows are open, the fullest one is closed. A chunk of ``seq_len`` is a
    row at once. Rows come out in the order they are closed, then the open ones in the order they were opened.

    Args:
        lengths: [C] chunk lengths, each in 1..seq_len.
        order: chunk indices to place, in order.
        seq_len: S.
        open_rows: rows kept open.
    Returns:
        Rows, each a list of chunk indices in placement order; their lengths sum to at most S.
    """
    rows: list[list[int]] = []
    open_ids: list[list[int]] = []
    room = np.zeros(0, dtype=np.int64)  # [open] free positions per open row
    for c, n in zip(order.tolist(), lengths[order].tolist()):
        if n == seq_len:  # a full chunk is a row of its own (most chunks of a corpus of long documents)
            rows.append([c])
            continue
        fits = np.flatnonzero(room >= n)
        if len(fits):
            j = int(fits[np.argmin(room[fits])])
            open_ids[j].append(c)
            room[j] -= n
            continue
        if len(open_ids) == open_rows:
            j = int(np.argmin(room))
            rows.append(open_ids.pop(j))
            room = np.delete(room, j)
        open_ids.append([c])
        room = np.append(room, seq_len - n)
    return rows + open_ids


def budget_batches(lengths: np.ndarray, order: np.ndarray, budget: int, seq_len: int, rng: np.random.Generator,
                   pool_budgets: int = POOL_BUDGETS, row_fill: int = ROW_FILL) -> list[list[list[int]]]:
    """Cut chunks into micro-batches of at most ``budget`` positions (rows x longest row), rows of at most
    ``seq_len`` positions each holding one or more whole chunks.

    ``order`` is split into consecutive pools of about ``pool_budgets * budget`` tokens; each pool's chunks are
    sorted longest first and cut into micro-batches by :func:`_pool_batches`; the micro-batches of a pool are then
    shuffled with ``rng``, so lengths do not fall steadily through a pool.

    Args:
        lengths: [C] chunk lengths, each in 1..seq_len.
        order: chunk indices, in order.
        budget: T, positions per micro-batch (>= seq_len).
        seq_len: S, the widest row.
        rng: shuffles the micro-batches within each pool.
        pool_budgets: budgets of tokens per pool.
        row_fill: a row is at least this many times as wide as the shortest chunk left (capped at S).
    Returns:
        Micro-batches, each a list of rows, each a list of chunk indices.
    """
    out: list[list[list[int]]] = []
    pool_tokens = pool_budgets * budget
    ends = np.searchsorted(np.cumsum(lengths[order]), np.arange(pool_tokens, int(lengths[order].sum()), pool_tokens),
                           side="right")  # pool boundaries, each after ~pool_tokens tokens
    for pool in np.split(order, ends):
        if len(pool):
            batches = _pool_batches(lengths, pool, budget, seq_len, row_fill)
            out += [batches[i] for i in rng.permutation(len(batches))]
    return out


class _Unused:
    """The unused positions 0..n-1 of a list: the first one at or after i, the last one before i (union-find with
    path halving, amortised O(log n) each), and :meth:`take`."""

    def __init__(self, n: int):
        self.n = n
        self._next = list(range(n + 1))  # _next[i]: an index <= the first unused at or after i (n: none)
        self._prev = list(range(n + 1))  # _prev[i]: >= 1 + the last unused before i (0: none)

    def first_from(self, i: int) -> int:
        """The first unused index >= ``i`` (``n``: none)."""
        nxt = self._next
        while nxt[i] != i:
            nxt[i] = nxt[nxt[i]]
            i = nxt[i]
        return i

    def last(self) -> int:
        """The last unused index (-1: none)."""
        prv, i = self._prev, self.n
        while prv[i] != i:
            prv[i] = prv[prv[i]]
            i = prv[i]
        return i - 1

    def take(self, i: int) -> None:
        self._next[i], self._prev[i + 1] = i + 1, i


def _balanced(items: list[tuple[int, int]], rows: int) -> tuple[list[list[int]], int]:
    """Longest-processing-time split of ``items`` ((index, length), longest first) into ``rows`` rows: each goes
    to the row with the fewest positions so far. Returns the rows and the longest row's length."""
    heap = [(0, r) for r in range(rows)]
    out: list[list[int]] = [[] for _ in range(rows)]
    for i, n in items:
        filled, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (filled + n, r))
    return out, max(filled for filled, _ in heap)


def _last_batch(items: list[tuple[int, int]], budget: int, seq_len: int, rows: int) -> list[list[int]] | None:
    """The pool's last micro-batch when its remaining ``items`` ((index, length), longest first) fit in one: as
    few rows as hold them, balanced (:func:`_balanced`), the split with the least padding among ``ceil(tokens / S)``
    to 3 rows more (at most ``rows``); ``None`` when no split fits ``seq_len`` and ``budget``."""
    tokens = sum(n for _, n in items)
    best: tuple[int, list[list[int]]] | None = None
    low = -(-tokens // seq_len)
    for r in range(low, min(rows, low + 3, len(items)) + 1):
        split, longest = _balanced(items, r)
        if longest <= seq_len and r * longest <= budget and (best is None or r * longest - tokens < best[0]):
            best = (r * longest - tokens, split)
    return None if best is None else best[1]


def _pool_batches(lengths: np.ndarray, pool: np.ndarray, budget: int, seq_len: int, row_fill: int
                  ) -> list[list[list[int]]]:
    """Micro-batches of one pool (see :func:`budget_batches`), longest chunks first.

    A micro-batch's row width w is the longest unused chunk, widened to ``row_fill`` x the shortest unused one
    (at most S); it has ``max(1, budget // w)`` rows. Each row starts with the longest unused chunk and is filled
    best-fit: while some unused chunk fits the room left, the longest that fits. So a row ends with less room
    than the shortest chunk left: about ``1 / row_fill`` of a widened row at most; a row of one long chunk is
    padded to the longest of its micro-batch, chunks of like length (sorted). The pool's last micro-batch holds
    what is left in as few balanced rows as fit (:func:`_last_batch`); it can pad more when few chunks are left.
    """
    pool = pool[np.argsort(-lengths[pool], kind="stable")]  # longest first; ties in pool order
    lens = lengths[pool].tolist()
    neg = [-n for n in lens]  # ascending, for bisect: the first index whose length is <= room
    unused = _Unused(len(lens))
    left, batches = sum(lens), []
    while left:
        head = unused.first_from(0)
        width = min(seq_len, max(lens[head], row_fill * lens[unused.last()]))
        rows = max(1, budget // width)
        if left <= rows * width:
            i, items = head, []
            while i < len(lens):
                items.append((i, lens[i]))
                i = unused.first_from(i + 1)
            last = _last_batch(items, budget, seq_len, rows)
            if last is not None:
                batches.append([[int(pool[i]) for i in row] for row in last])
                break
        batch = []
        for _ in range(rows):
            i = unused.first_from(0)
            if i == len(lens):
                break
            row, room = [], width
            while i < len(lens):
                unused.take(i)
                row.append(int(pool[i]))
                room -= lens[i]
                left -= lens[i]
                i = unused.first_from(bisect.bisect_left(neg, -room))
            batch.append(row)
        batches.append(batch)
    return batches


class DocumentBatches:
    """Micro-batches of packed documents, addressed by ``(epoch, index)``: a map-style dataset (the same key gives
    the same batch in any process, so DataLoader workers and a resumed run agree).

    Args:
        chunks: the split's :class:`DocumentChunks`.
        batch_size: B, rows per micro-batch (fixed shape; ignored with a token budget).
        tokens_per_batch: T, the token budget per micro-batch (0: fixed [B, S] micro-batches).
        seed: the order's seed.
        shuffle: visit the chunks in a seeded random order (training); ``False``: in stream order (validation).
    """

    def __init__(self, chunks: DocumentChunks, batch_size: int, tokens_per_batch: int, seed: int,
                 shuffle: bool = True):
        if tokens_per_batch and tokens_per_batch < chunks.seq_len:
            raise ValueError(f"tokens_per_batch {tokens_per_batch} is below seq_len {chunks.seq_len}: the "
                             "longest chunk would not fit")
        self.chunks, self.batch_size, self.tokens_per_batch = chunks, batch_size, tokens_per_batch
        self.seed, self.shuffle = seed, shuffle
        # (seed, epoch) -> plan, per process: each DataLoader worker plans for itself
        self._plans: dict[tuple[int, int], list[list[list[int]]]] = {}

    def _plan(self, epoch: int) -> list[list[list[int]]]:
        key = (self.seed, epoch)
        if key not in self._plans:
            if len(self._plans) >= 2:  # the current epoch and the next: a batch may be read across the boundary
                del self._plans[next(iter(self._plans))]  # the oldest
            self._plans[key] = self._make_plan(epoch)
        return self._plans[key]

    def _make_plan(self, epoch: int) -> list[list[list[int]]]:
        """The epoch's micro-batches, each a list of rows, each a list of chunk indices."""
        c = len(self.chunks)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(c) if self.shuffle else np.arange(c)
        if self.tokens_per_batch:
            return budget_batches(self.chunks.length, order, self.tokens_per_batch, self.chunks.seq_len, rng)
        rows = pack_rows(self.chunks.length, order, self.chunks.seq_len)
        b = self.batch_size
        if len(rows) < b:  # a split smaller than one micro-batch: one short batch
            return [rows]
        return [rows[i : i + b] for i in range(0, len(rows) - b + 1, b)]  # the last partial batch is dropped

    def num_batches(self, epoch: int) -> int:
        """Micro-batches in ``epoch`` (the plan of an epoch is computed once and cached)."""
        return len(self._plan(epoch))

    def key_after(self, key: tuple[int, int]) -> tuple[int, int]:
        """The ``(epoch, index)`` of the batch after ``key``'s (an epoch's last is followed by the next's first)."""
        epoch, index = key
        return (epoch, index + 1) if index + 1 < self.num_batches(epoch) else (epoch + 1, 0)

    def __getitem__(self, key: tuple[int, int]) -> PackedBatch:
        epoch, index = key
        return self.build(self._plan(int(epoch))[int(index)])

    def build(self, rows: list[list[int]]) -> PackedBatch:
        """The :class:`PackedBatch` of ``rows`` (lists of chunk indices): [b, s] with s = the longest row (fixed
        shape: S); ``document_ids`` only when a row holds several chunks."""
        lengths = [sum(int(self.chunks.length[c]) for c in row) for row in rows]
        s = self.chunks.seq_len if not self.tokens_per_batch else max(lengths)
        b = len(rows)
        inputs = np.zeros((b, s), dtype=np.int64)
        targets = np.full((b, s), IGNORE_INDEX, dtype=np.int64)
        doc_ids = np.full((b, s), PAD_DOCUMENT, dtype=np.int64)
        for r, row in enumerate(rows):
            at = 0
            for d, c in enumerate(row):
                x, y = self.chunks.pairs(c)
                inputs[r, at : at + len(x)], targets[r, at : at + len(x)], doc_ids[r, at : at + len(x)] = x, y, d
                at += len(x)
        multi = any(len(row) > 1 for row in rows)
        return PackedBatch(torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(doc_ids >= 0),
                           torch.from_numpy(doc_ids) if multi else None)
