"""A radix tree over token ids whose values are KV slots: finished requests leave their KV
here, and a new request whose prompt starts with a cached prefix skips recomputing it.

Nodes on the path of a running request are locked; unlocked leaves are evicted least
recently used first when the slot allocator runs short.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

import numpy as np

from srt.scheduler.kv_allocator import TokenSlotAllocator

if TYPE_CHECKING:
    from srt.scheduler.req import Req


class _Node:
    __slots__ = ("children", "parent", "key", "slots", "lock_ref", "last_access")

    def __init__(self, parent: _Node | None, key: list[int], slots: np.ndarray) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key
        self.slots = slots
        self.lock_ref = 0
        self.last_access = 0


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, allocator: TokenSlotAllocator) -> None:
        self.allocator = allocator
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget every cached prefix; only valid with no request holding a lock."""
        for node in self._nodes():
            self.allocator.free(node.slots)
        self.root = _Node(None, [], np.zeros(0, np.int32))
        self.root.lock_ref = 1
        self.size = 0
        self.locked_size = 0

    @property
    def evictable_size(self) -> int:
        return self.size - self.locked_size

    # ---- the scheduler's view ----------------------------------------------------------------

    def attach(self, req: Req) -> None:
        """Give a waiting request its longest cached prefix (never the whole prompt: the last
        token is always computed, for its logits) and lock it."""
        slots, node = self._match(req.input_ids[:-1])
        self._lock(node, +1)
        req.slots, req.cache_node = slots, node
        req.kv_len = req.cached_tokens = len(slots)

    def detach(self, req: Req) -> None:
        self._lock(req.cache_node, -1)
        req.slots, req.kv_len, req.cached_tokens, req.cache_node = (
            np.zeros(0, np.int32),
            0,
            0,
            None,
        )

    def release(self, req: Req, tokens: list[int], slots: np.ndarray) -> None:
        """A request is done: cache its computed KV and unlock its prefix."""
        existed = self._insert(tokens, slots)
        # Tokens past the request's own hit that another request cached meanwhile: ours are
        # duplicates of slots the tree already owns.
        self.allocator.free(slots[req.cached_tokens : existed])
        if req.cache_node is not None:
            self._lock(req.cache_node, -1)
            req.cache_node = None

    def evict(self, num_slots: int) -> int:
        """Free at least `num_slots` slots from unlocked leaves (LRU first) if possible."""
        leaves = [
            (n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_slots and leaves:
            _, _, node = heapq.heappop(leaves)
            self.allocator.free(node.slots)
            freed += len(node.slots)
            self.size -= len(node.slots)
            parent = node.parent
            assert parent is not None, "only the root has no parent, and it is never a leaf here"
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    # ---- the tree ------------------------------------------------------------------------------

    def _nodes(self) -> list[_Node]:
        if not hasattr(self, "root"):
            return []
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; return the new upper node."""
        parent = node.parent
        assert parent is not None, "the root is never split"
        upper = _Node(parent, node.key[:at], node.slots[:at])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        upper.children = {node.key[at]: node}
        parent.children[node.key[0]] = upper
        node.parent, node.key, node.slots = upper, node.key[at:], node.slots[at:]
        return upper

    def _match(self, tokens: list[int]) -> tuple[np.ndarray, _Node]:
        node, parts, now = self.root, [], next(self._clock)
        while tokens:
            child = node.children.get(tokens[0])
            if child is None:
                break
            n = _common_len(child.key, tokens)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            node, tokens = child, tokens[n:]
        slots = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return slots, node

    def _insert(self, tokens: list[int], slots: np.ndarray) -> int:
        """Insert, returning how many leading tokens were already cached."""
        node, done, now = self.root, 0, next(self._clock)
        while done < len(tokens):
            child = node.children.get(tokens[done])
            if child is None:
                leaf = _Node(node, list(tokens[done:]), slots[done:].copy())
                leaf.last_access = now
                node.children[tokens[done]] = leaf
                self.size += len(leaf.key)
                return done
            n = _common_len(child.key, tokens[done:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, done = child, done + n
        return done

    def _lock(self, node: _Node | None, delta: int) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0 and delta > 0:
                self.locked_size += len(node.key)
            node.lock_ref += delta
            if node.lock_ref == 0 and delta < 0:
                self.locked_size -= len(node.key)
            node = node.parent
