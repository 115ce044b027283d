"""The buckets a compile cache entry has seen, per phase (`<entry>/manifest.json`): a later
start captures them up front (`--cuda-graph-capture manifest`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from srt.compilation.private_files import locked, write_private

logger = logging.getLogger(__name__)


class BucketManifest:
    """The buckets actually hit, per phase, across runs and across the processes that share
    the entry: each new bucket is merged into the file under a lock (so two servers never
    drop each other's), and the file is replaced atomically. A read-only one (on a read-only
    cache root) is read, and what this process hits is kept in memory only."""

    def __init__(self, path: Path, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self.buckets: dict[str, list[int]] = self._read()

    def _read(self) -> dict[str, list[int]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return {k: sorted(int(b) for b in v) for k, v in data["buckets"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("compile cache: ignoring unreadable manifest %s (%s)", self.path, e)
            return {}

    def record(self, phase: str, bucket: int) -> None:
        if bucket in self.buckets.get(phase, ()):
            return
        if self.read_only:
            self.buckets[phase] = sorted({*self.buckets.get(phase, []), bucket})
            return
        with locked(self.path.with_name(self.path.name + ".lock")):
            merged = self._read()  # with what other processes recorded meanwhile
            for p, buckets in [*self.buckets.items(), (phase, [bucket])]:
                merged[p] = sorted(set(merged.get(p, [])) | set(buckets))
            write_private(self.path, json.dumps({"buckets": merged}, indent=2).encode())
            self.buckets = merged
