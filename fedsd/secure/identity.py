"""Owners' long-term identities and the federation's roster: who may take part in a round of
secure aggregation, known to every owner, never named by the server.

Each owner's data service has an Ed25519 identity key (from `cryptography`), made on its first
start in its state folder (`identity.key`, mode 0600) and shown as one line,
`ed25519:<base64 of the 32-byte public key>` (`fedsd data-service --identity`). The owners of a
federation agree on a **roster**, a file like SSH's known_hosts: one member a line,

    # name   public key
    alice    ed25519:3q2+7w...=
    bob      ed25519:yv66vg...=

and each owner names its own copy in its node config (`secagg-roster=PATH`); the server never
supplies it. A member's id in the protocol is derived from its public key (`protocol_id`), so
the server can neither choose an owner's id nor give one owner two. What a roster buys is in
fedsd.secure.secagg's docstring (the signatures of Bonawitz et al.'s malicious-server protocol).
"""
from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from Crypto.Signature import eddsa
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from fedsd.errors import ConfigError
from fedsd.files.state_folder import StateFolder

PREFIX = "ed25519:"
KEY_BYTES = 32
SIGNATURE_BYTES = 64
MAX_ID = (1 << 63) - 1
IDENTITY_FILE = "identity.key"
NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")


class RosterError(ConfigError):
    """A roster file this owner cannot rely on; the text names the file, the line and why."""


def protocol_id(public: bytes) -> int:
    """A member's id in the protocol: 63 bits of SHA-256 of its public key (ids travel as
    signed 64-bit integers). The server learns it; it cannot choose it."""
    return int.from_bytes(hashlib.sha256(b"fedsd-secagg-id|" + bytes(public)).digest()[:8], "big") & MAX_ID


def public_line(public: bytes) -> str:
    return PREFIX + base64.b64encode(bytes(public)).decode()


def parse_public(text: str, where: str = "key") -> bytes:
    """The 32 raw bytes of an `ed25519:<base64>` public key, checked to be the canonical encoding
    of a point of large order (pycryptodome decodes it): `cryptography` takes any 32 bytes, and
    under a small-order key such as 01 00..00 one forged signature verifies for every message;
    a point under a second encoding would be a second member."""
    if not isinstance(text, str) or not text.startswith(PREFIX):
        raise RosterError(f"{where}: a public key is written ed25519:<base64>")
    try:
        raw = base64.b64decode(text[len(PREFIX):], validate=True)
    except ValueError:
        raise RosterError(f"{where}: not a 32-byte Ed25519 public key in base64") from None
    why = _point_refusal(raw)
    if why is not None:
        raise RosterError(f"{where}: {why}")
    return raw


@functools.lru_cache(maxsize=1024)
def _point_refusal(raw: bytes) -> str | None:
    """Why `raw` is not the canonical encoding of an Ed25519 point of large order (None: it is). A
    function of the 32 bytes alone, kept for the last keys checked: an owner's service reads its
    roster at each message, and the point's decoding and order check were most of the Python
    time of its message outside the training (py-spy on a deployed round)."""
    try:
        Ed25519PublicKey.from_public_bytes(raw)
        point = eddsa.import_public_key(raw)
    except ValueError:
        return "not a 32-byte Ed25519 public key in base64"
    if point.public_key().export_key(format="raw") != raw:
        return "not the canonical encoding of its Ed25519 point"
    if (point.pointQ * 8).is_point_at_infinity():
        return "an Ed25519 key of small order (anyone can sign for it)"
    return None


def verify(public: bytes, signature: object, message: bytes) -> bool:
    """Whether `signature` is `public`'s Ed25519 signature of `message` (False for anything
    malformed: everything relayed by the server is hostile)."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        return False
    return _verified(bytes(public), bytes(signature), bytes(message))


# A verification is a function of its three byte strings alone, so a repeat is answered from memory:
# in a simulation every client of a neighbourhood checks the same signatures (each is checked once a
# process, not once a neighbour), and a holder shown one receipt twice checks it once. The key is
# the bytes themselves, compared whole, never a digest of them.
@functools.lru_cache(maxsize=1 << 14)
def _verified(public: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An Ed25519 signing key: an owner's long-term one (`load_identity`), or one made for a
    single round where an owner has no roster (it then proves nothing to the others)."""

    def __init__(self, key: Ed25519PrivateKey | None = None):
        self._key = key if key is not None else Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def id(self) -> int:
        return protocol_id(self.public)

    def line(self) -> str:
        return public_line(self.public)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def private_bytes(self) -> bytes:
        """The private key's 32 bytes: only for a simulation's worker processes, which hold its
        simulated clients (fedsd.secure.client_groups); an owner's never leaves its state folder."""
        return self._key.private_bytes_raw()


def load_identity(state: StateFolder) -> Identity:
    """The owner's identity in its state folder (fedsd.files.state_folder, held open): read, or made on
    first use (32 random bytes from the OS, through `cryptography`) and written 0600, under a
    lock, relative to the folder's descriptor, never through a link. A file others can read, or
    a link, is refused: it would be someone else's identity."""
    with state.lock(IDENTITY_FILE + ".lock"):
        try:
            fd = state.open_file(IDENTITY_FILE, os.O_RDONLY)
        except FileNotFoundError:
            key = Ed25519PrivateKey.generate()
            state.write_atomic(IDENTITY_FILE, key.private_bytes_raw())  # complete or absent
            return Identity(key)
        except OSError as e:
            raise ConfigError(f"{IDENTITY_FILE} in the state folder: cannot be opened without following a link "
                              f"({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise ConfigError(f"{IDENTITY_FILE} in the state folder: must be a file of this user's alone (mode 0600)")
        raw = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(raw) != KEY_BYTES:
        raise ConfigError(f"{IDENTITY_FILE} in the state folder: not a 32-byte Ed25519 private key")
    return Identity(Ed25519PrivateKey.from_private_bytes(raw))


@dataclass(frozen=True)
class Member:
    name: str
    public: bytes

    @property
    def id(self) -> int:
        return protocol_id(self.public)


class Roster:
    """The members an owner accepts in a round, by protocol id."""

    def __init__(self, members: list[Member], source: str = "roster"):
        self.source = source
        self.by_id: dict[int, Member] = {}
        for m in members:
            if m.id in self.by_id:
                raise RosterError(f"{source}: the key of {m.name} is listed twice")
            self.by_id[m.id] = m
        if len({m.name for m in members}) != len(members):
            raise RosterError(f"{source}: a name is listed twice")

    def __contains__(self, member_id: object) -> bool:
        return member_id in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def name(self, member_id: int) -> str:
        m = self.by_id.get(member_id)
        return m.name if m is not None else f"a stranger (id {member_id})"

    def key(self, member_id: int) -> bytes | None:
        m = self.by_id.get(member_id)
        return m.public if m is not None else None

    @classmethod
    def of(cls, named: dict[str, bytes]) -> "Roster":
        return cls([Member(n, bytes(k)) for n, k in named.items()])

    def text(self) -> str:
        return "".join(f"{m.name} {public_line(m.public)}\n" for m in self.by_id.values())


def read_roster(path: str | Path) -> Roster:
    """A roster file, checked before it is used: a regular file (no link) that no other user can
    write, one `name ed25519:<base64>` a line (blank lines and # comments aside), no name or
    key twice. Anything else is a RosterError naming the file and the line."""
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO put in its place would hold the open, and the service with it, forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise RosterError(f"secagg-roster={path}: cannot be read without following a link ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RosterError(f"secagg-roster={path}: not a regular file")
        if st.st_mode & 0o022 or st.st_uid not in (0, os.getuid()):
            raise RosterError(f"secagg-roster={path}: others can write it (mode {st.st_mode & 0o777:o}, owner "
                              f"{st.st_uid}); it must be this user's or root's and not group- or world-writable")
        with os.fdopen(os.dup(fd), "r", encoding="utf-8") as f:
            lines = f.read(1 << 20).splitlines()
    finally:
        os.close(fd)
    members = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        where = f"secagg-roster={path}, line {number}"
        if len(parts) != 2 or NAME.fullmatch(parts[0]) is None:
            raise RosterError(f"{where}: one member a line, 'name ed25519:<base64>' (names: letters, digits, . _ @ -)")
        members.append(Member(parts[0], parse_public(parts[1], where)))
    if not members:
        raise RosterError(f"secagg-roster={path}: lists no member")
    return Roster(members, f"secagg-roster={path}")
