"""Where policies come from, and noticing when they change.

A ``PolicySource`` is a path (a file, or a directory such as a Kubernetes ConfigMap volume)
or a fixed policy (``gateway serve --upstream``).  Changes are found by hashing the files'
contents on every poll: that follows the ConfigMap's ``..data`` symlink swap, which a watch
on the file itself would miss, and costs microseconds for policy-sized files.

A change is applied only once it has settled (``Settling``).  An atomic one at the next
poll: a ConfigMap's ``..data`` swap, or files renamed into place (each changed file a new
inode, as ``sed -i``, ``mv`` and most editors leave it).  An edit in place only once its
content has held still for ``server.reload_settle_s`` (default 10 s), so a half-written file
whose first half happens to be a valid policy is never live, even when its writer pauses
mid-file for seconds (before, two polls a second apart sufficed, and a writer that paused
a second had its half applied).  Either way the policy must also parse and pass its checks.

The files the live policy's ``${file:...}`` values came from (a Secret's volume) are read
with it on every poll, so a rotated secret reloads the policy as an edit of it would: the
kubelet's swap of the Secret's ``..data`` gives each file a new inode, an atomic change.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import PolicyError
from gateway.policy.convert import secret_bytes
from gateway.policy.load import Loaded, parse_sources, read_sources
from gateway.policy.model import Policy


@dataclass(frozen=True, slots=True)
class Reading:
    """One poll of a policy path: the hash of everything read, each file's inode and hash,
    and where a ConfigMap's ``..data`` pointed."""

    fingerprint: str
    files: dict[str, tuple[int, str]] = field(default_factory=dict)
    data_target: str | None = None


class Settling:
    """When a changed policy may be applied (see the module docstring)."""

    def __init__(self, applied: Reading, clock: Clock = SYSTEM_CLOCK) -> None:
        self.applied = applied
        self._clock = clock
        self._pending: str | None = None
        self._since = 0.0

    def ready(self, reading: Reading, settle_s: float = 0.0) -> bool:
        """Whether ``reading`` is a change to apply now (else: unchanged, or wait): an
        atomic one at once, an edit in place once the same content has been read for
        ``settle_s`` (with 0: on the next poll that reads it again)."""
        if reading.fingerprint == self.applied.fingerprint:
            self._pending = None
            return False
        if self._atomic(reading):
            return True
        now = self._clock.now()
        if reading.fingerprint != self._pending:
            self._pending, self._since = reading.fingerprint, now
            return False
        return now - self._since >= settle_s

    def done(self, reading: Reading) -> None:
        """``reading`` is what is live now."""
        self.applied = reading
        self._pending = None

    def _atomic(self, reading: Reading) -> bool:
        before = self.applied
        if reading.data_target is not None and reading.data_target != before.data_target:
            return True  # a ConfigMap's ..data swap
        if set(reading.files) != set(before.files):
            return False
        changed = [n for n in reading.files if reading.files[n][1] != before.files[n][1]]
        return bool(changed) and all(reading.files[n][0] != before.files[n][0] for n in changed)

    def __repr__(self) -> str:
        pending = f" pending={self._pending[:8]} since={self._since:.1f}" if self._pending else ""
        return f"<Settling applied={self.applied.fingerprint[:8]}{pending}>"


class PolicySource:
    """A policy path to (re)read, or a fixed policy."""

    def __init__(self, path: str | Path | None = None, fixed: Policy | None = None) -> None:
        if (path is None) == (fixed is None):
            raise ValueError("give a policy path or a fixed policy, not both")
        self.path = Path(path) if path is not None else None
        self._fixed = fixed
        self.secret_files: tuple[str, ...] = ()
        """The last policy loaded's ``${file:...}`` files, read with it on every poll."""

    @property
    def watchable(self) -> bool:
        return self.path is not None

    def fingerprint(self) -> str:
        """A hash of the raw sources, to tell cheaply whether anything changed."""
        return self.read().fingerprint

    def read(self) -> Reading:
        """One poll: the sources' hash, and what tells an atomic change from an edit."""
        if self.path is None:
            return Reading("fixed")
        h = hashlib.sha256()
        files: dict[str, tuple[int, str]] = {}
        try:
            for name, text in [*read_sources(self.path), *_secrets(self.secret_files)]:
                data = name.encode() + b"\0" + text.encode() + b"\0"
                h.update(data)
                try:
                    inode = os.stat(name).st_ino
                except OSError:
                    inode = 0
                files[name] = (inode, hashlib.sha256(data).hexdigest())
        except PolicyError as exc:
            h.update(str(exc).encode())
        data_target = None
        link = self.path / "..data" if self.path.is_dir() else None
        if link is not None and link.is_symlink():
            data_target = os.readlink(link)
        return Reading(h.hexdigest(), files, data_target)

    def load(self) -> Loaded:
        """Read and validate (raises PolicyError)."""
        if self._fixed is not None:
            return Loaded(
                self._fixed, hashlib.sha256(repr(self._fixed).encode()).hexdigest()[:16], ()
            )
        assert self.path is not None
        loaded = parse_sources(read_sources(self.path))
        self.secret_files = loaded.secret_files
        return loaded

    def __repr__(self) -> str:
        return f"<PolicySource {self.path or 'fixed'}>"


def _secrets(files: tuple[str, ...]) -> list[tuple[str, str]]:
    """Each file's content as text to hash (a file that cannot be read: why, which changes
    when it can be again)."""
    read = []
    for name in files:
        try:
            data = secret_bytes(name)
        except OSError as exc:
            data = f"unreadable: {exc.strerror}".encode()
        read.append((name, hashlib.sha256(data).hexdigest()))
    return read
