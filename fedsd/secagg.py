"""Secure aggregation: SecAgg+ (Bell, Bonawitz, Gascón, Lepoint & Raykova, CCS 2020), the server
learning only the sum of the clients' vectors, modulo 2^64.

The protocol is Bonawitz et al.'s (CCS 2017) on a neighbourhood graph (SecAgg+: each client
shares with its neighbours only; the complete graph is the 2017 protocol). The stages, as the
papers number their rounds, and what each side does here:

  0. Advertise keys (`SecAggClient.advertise`): the client makes two X25519 key pairs, c for
     encrypting its shares and s for agreeing its pairwise masks, and sends the public halves.
  1. Share keys (`share_keys`): given its neighbours' public keys, it draws its self-mask seed b
     (32 bytes from the operating system), splits b and its secret s key t-of-k with Shamir's
     scheme, and sends each neighbour its two shares, encrypted with AES-GCM under a key HKDF
     derives from X25519(c_i, c_j), bound to the round and to both ids.
  2. Masked input (`masked_input`): given the ciphertexts addressed to it, it keeps its shares
     and sends y = x + PRG(b) + Σ_j ±PRG(s_ij) mod 2^64 over the neighbours j that sent it
     shares; s_ij = HKDF(X25519(s_i, s_j)), the sign by id (the lower id adds).
  3. Consistency check (`confirm`; Bonawitz et al.'s round 3, with pairwise HMACs under keys
     from X25519(c_i, c_j) in place of signatures): given the round's survivors (who sent a
     masked input) and dropped clients, the same lists for every client, it checks them and
     sends each neighbouring survivor a MAC of that one view. It confirms one view only.
  4. Unmask (`unmask`): given its neighbours' MACs, once at least the threshold of them (and
     its owner's t + f) confirmed the view it confirmed, it reveals its share of b for each
     survivor and its share of s for each dropped neighbour: never both for one client, nor a
     second answer in a round. Without the consistency check a server could tell two groups
     two stories and collect both shares of one client (tests/test_attack_secagg.py).

The server (`SecAggServer`) routes the messages, and at the end rebuilds each survivor's b and
each dropped client's s from t shares, removes the self masks and the pairwise masks that
dropped clients left, and has the sum. Fewer than t at any stage: the round is abandoned
before anything is unmasked.

Primitives, none written here: X25519, HKDF-SHA256, AES-GCM and AES-256-CTR from
`cryptography`; Shamir over GF(2^128) from pycryptodome (a Flower dependency). Masks are
AES-256-CTR keystreams under 256-bit seeds. (Flower's own SecAgg+ XORs its 32-byte seed to
32 bits and expands it with numpy's Mersenne Twister: its masks fall to a 2^32 search.)

What the clients' services check (everything from the server is hostile): the stages come in
order, once each (a replayed or late message is refused); the round id is the one this state
was made for; every id is in the cohort the client accepted; the cohort is at least the
owner's `min_cohort` (t), and the survivors at least t + `max_colluders` (f, the most of a
round's clients the owner allows to be the server's), so that t honest noise shares are in the
sum; a neighbourhood is at most `max_neighbours`; a survivor and a dropped client are never
the same; every public key is canonical; and every share decrypts and names this round, its
sender and this client.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

MODULUS_BITS = 64  # the vectors are uint64, summed modulo 2^64
SEED_BYTES = 32  # self-mask seeds and pairwise keys: 256 bits
CHUNK = 16  # pycryptodome's Shamir shares 16-byte secrets: a 32-byte secret is two
NONCE = 12
MAX_ID = (1 << 63) - 1


class ProtocolError(Exception):
    """A stage message this client refuses; its text says why and nothing of the data."""


class RoundAbandoned(Exception):
    """Too few clients went on for the round to be unmasked; nothing was revealed."""


# -- primitives ------------------------------------------------------------------------------
def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """`length` uint64 words of AES-256-CTR keystream under `seed` (32 bytes). Each seed masks
    one vector of one round, so the zero nonce is never reused under a key."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)) + encryptor.finalize(), dtype="<u8").copy()


def _derive(shared: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None, info=info).derive(shared)


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


FIELD_PRIME = 2 ** 255 - 19


def _public(raw: object, what: str) -> X25519PublicKey:
    """A public key in its one canonical encoding (below 2^255 − 19, bit 255 clear): X25519
    ignores bit 255, and two encodings of one point would pass the distinct-keys check."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != 32:
        raise ProtocolError(f"{what}: not a 32-byte X25519 public key")
    if int.from_bytes(raw, "little") >= FIELD_PRIME:
        raise ProtocolError(f"{what}: not a canonical X25519 public key")
    return X25519PublicKey.from_public_bytes(bytes(raw))


def _agree(private: X25519PrivateKey, public: X25519PublicKey, what: str) -> bytes:
    try:
        return private.exchange(public)
    except ValueError:  # a low-order point: the shared secret would be all zeros
        raise ProtocolError(f"{what}: a key that agrees on no secret") from None


def _ids(values: object, what: str) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        and 0 <= v <= MAX_ID for v in values):
        raise ProtocolError(f"{what}: a list of client ids (integers in [0, 2^63)) was expected")
    if len(set(values)) != len(values):
        raise ProtocolError(f"{what}: an id appears twice")
    return sorted(values)


def _info(round_id: bytes, *parts: object) -> bytes:
    return b"fedsd-secagg|" + round_id + b"|" + b"|".join(str(p).encode() for p in parts)


def split_secret(secret: bytes, threshold: int, holders: list[int]) -> dict[int, bytes]:
    """Shamir shares of a 32-byte secret, t-of-len(holders); the holder at position k of the
    sorted list holds the share at x = k + 1 (both 16-byte halves, 32 bytes)."""
    halves = [Shamir.split(threshold, len(holders), secret[i:i + CHUNK]) for i in (0, CHUNK)]
    return {holder: halves[0][k][1] + halves[1][k][1] for k, holder in enumerate(holders)}


def combine_secret(shares: dict[int, bytes], holders: list[int], threshold: int) -> bytes:
    """The secret from `threshold` of its shares (holder id → 32-byte share)."""
    position = {holder: k + 1 for k, holder in enumerate(holders)}
    chosen = sorted(shares)[:threshold]
    return b"".join(Shamir.combine([(position[h], shares[h][i:i + CHUNK]) for h in chosen]) for i in (0, CHUNK))


def pairwise_sign(me: int, other: int) -> int:
    return 1 if me < other else -1


# -- the client's side: one object per round, held by the client's own process ---------------
@dataclass
class SecAggClient:
    """One client's state in one round. `min_cohort`: the fewest clients the owner lets a round
    have (its assumption of honest clients, with distributed noise); a cohort or a survivor set
    below it, or below the threshold, is refused."""

    me: int
    round_id: bytes
    min_cohort: int = 2
    max_colluders: int = 0  # f: the most of a round's clients the owner allows to be the server's
    max_neighbours: int = 128  # the largest neighbourhood it shares with (Shamir's cost grows as its square)
    stage: int = 0
    cohort: list[int] = field(default_factory=list)
    neighbours: list[int] = field(default_factory=list)  # the holders of my shares, me included
    threshold: int = 0
    _c: X25519PrivateKey | None = None
    _s: X25519PrivateKey | None = None
    _b: bytes = b""
    _keys: dict = field(default_factory=dict)  # neighbour → (c public, s public)
    _shares: dict = field(default_factory=dict)  # sender → (share of its b, share of its s)
    _masked_with: list[int] = field(default_factory=list)
    _view: tuple = ((), ())
    _statement: bytes = b""

    @property
    def needed(self) -> int:
        """The fewest neighbours a stage goes on with: the threshold, and the owner's t honest
        ones with up to f of the server's among them (each one a neighbour whose keys, shares
        and MACs this client checks itself)."""
        return max(self.threshold, self.min_cohort + self.max_colluders)

    def _expect(self, stage: int, name: str, advance: bool = True) -> None:
        if self.stage != stage:
            said = "was answered already" if self.stage > stage else "came before its turn"
            raise ProtocolError(f"secure aggregation: the {name} message {said} in this round")
        if advance:
            self.stage = stage + 1

    def _from_neighbours(self, ids: list, stage: str, what: str, went_on: str) -> list[int]:
        """The ids a stage message names, sorted: in this client's neighbourhood, this client
        among them, and at least `needed` of them."""
        holders = _ids(ids, stage)
        if not set(holders) <= set(self.neighbours) or self.me not in holders:
            raise ProtocolError(f"{stage}: {what} outside this client's neighbourhood")
        if len(holders) < self.needed:
            raise ProtocolError(f"{stage}: {len(holders)} clients {went_on}, below the threshold")
        return holders

    def advertise(self, cohort: object, neighbours: object, threshold: object) -> dict:
        """Stage 0: the round's cohort, my neighbourhood (me included) and the threshold t;
        my two public keys."""
        self._expect(0, "advertise-keys")
        cohort, neighbours = _ids(cohort, "cohort"), _ids(neighbours, "neighbours")
        if self.me not in neighbours or not set(neighbours) <= set(cohort):
            raise ProtocolError("neighbours: must hold this client and lie in the cohort")
        if len(neighbours) > self.max_neighbours:
            raise ProtocolError(f"neighbours: {len(neighbours)}, above the {self.max_neighbours} this owner shares with")
        if len(cohort) < self.min_cohort:
            raise ProtocolError(f"cohort: {len(cohort)} clients, below the {self.min_cohort} this owner requires")
        if len(neighbours) < self.min_cohort + self.max_colluders:  # it could never unmask: refused before any cost
            raise ProtocolError(f"neighbours: {len(neighbours)} clients, below the {self.min_cohort} honest ones "
                                f"and {self.max_colluders} of the server's this owner requires")
        if not isinstance(threshold, int) or isinstance(threshold, bool) or not (
                minimum_threshold(len(neighbours)) <= threshold <= len(neighbours)):
            raise ProtocolError(f"threshold: must be in [{minimum_threshold(len(neighbours))}, {len(neighbours)}] "
                                f"for {len(neighbours)} neighbours (more than two thirds of them)")
        self.cohort, self.neighbours, self.threshold = cohort, neighbours, threshold
        self._c, self._s = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        return {"c": _raw(self._c.public_key()), "s": _raw(self._s.public_key())}

    def share_keys(self, keys: object) -> dict[int, bytes]:
        """Stage 1: the public keys of my neighbours that advertised (id → {"c", "s"}); the
        encrypted shares of b and s for each of them."""
        self._expect(1, "share-keys")
        if not isinstance(keys, dict) or not all(isinstance(k, int) for k in keys):
            raise ProtocolError("share-keys: a map of client id to public keys was expected")
        holders = self._from_neighbours(list(keys), "share-keys", "keys of clients", "went on")
        mine = keys[self.me]
        if not isinstance(mine, dict) or (mine.get("c"), mine.get("s")) != (
                _raw(self._c.public_key()), _raw(self._s.public_key())):
            raise ProtocolError("share-keys: this client's own keys came back changed")
        parsed = {j: (_public(keys[j].get("c") if isinstance(keys[j], dict) else None, f"client {j}'s c key"),
                      _public(keys[j].get("s") if isinstance(keys[j], dict) else None, f"client {j}'s s key"))
                  for j in holders}
        raws = [_raw(k) for pair in parsed.values() for k in pair]
        if len(set(raws)) != len(raws):
            raise ProtocolError("share-keys: two clients advertised the same key")
        self._keys, self.neighbours = parsed, holders
        self._b = secrets.token_bytes(SEED_BYTES)
        s_raw = self._s.private_bytes_raw()
        b_shares = split_secret(self._b, self.threshold, holders)
        s_shares = split_secret(s_raw, self.threshold, holders)
        out = {}
        for j in holders:
            key = _derive(_agree(self._c, parsed[j][0], f"client {j}'s c key"), _info(self.round_id, "enc", self.me, j)
                          if self.me < j else _info(self.round_id, "enc", j, self.me))
            nonce = secrets.token_bytes(NONCE)
            out[j] = nonce + AESGCM(key).encrypt(nonce, b_shares[j] + s_shares[j],
                                                  _info(self.round_id, "share", self.me, j))
        return out

    def masked_input(self, ciphertexts: object, vector: np.ndarray) -> np.ndarray:
        """Stage 2: the shares sent to me (sender id → ciphertext), and my vector (uint64);
        the vector masked."""
        self._expect(2, "masked-input")
        self._shares = self._opened(ciphertexts)
        senders = sorted(self._shares)
        vector = np.asarray(vector)
        if vector.dtype != np.uint64 or vector.ndim != 1:
            raise ValueError("masked_input: the vector is one-dimensional uint64")
        masked = vector + expand_mask(self._b, len(vector))
        for j in senders:
            if j != self.me:
                pair = _derive(_agree(self._s, self._keys[j][1], f"client {j}'s s key"),
                               _info(self.round_id, "mask", min(self.me, j), max(self.me, j)))
                mask = expand_mask(pair, len(vector))
                masked = masked + mask if pairwise_sign(self.me, j) > 0 else masked - mask
        self._masked_with = senders
        return masked

    def check_masked_input(self, ciphertexts: object) -> None:
        """Stage 2's checks of the shares, changing nothing: a service runs them before it
        computes its vector (and charges its ledger for it), then masked_input."""
        self._expect(2, "masked-input", advance=False)
        self._opened(ciphertexts)

    def _opened(self, ciphertexts: object) -> dict[int, tuple[bytes, bytes]]:
        if not isinstance(ciphertexts, dict):
            raise ProtocolError("masked-input: a map of sender id to ciphertext was expected")
        senders = self._from_neighbours(list(ciphertexts), "masked-input", "shares from clients", "sent shares")
        return {j: self._open(j, ciphertexts[j]) for j in senders}

    def _open(self, sender: int, ciphertext: object) -> tuple[bytes, bytes]:
        if not isinstance(ciphertext, (bytes, bytearray)) or len(ciphertext) != NONCE + 2 * SEED_BYTES + 16:
            raise ProtocolError(f"masked-input: the share from client {sender} is malformed")
        low, high = min(self.me, sender), max(self.me, sender)
        key = _derive(_agree(self._c, self._keys[sender][0], f"client {sender}'s c key"),
                      _info(self.round_id, "enc", low, high))
        try:
            plain = AESGCM(key).decrypt(bytes(ciphertext[:NONCE]), bytes(ciphertext[NONCE:]),
                                        _info(self.round_id, "share", sender, self.me))
        except InvalidTag:
            raise ProtocolError(f"masked-input: the share from client {sender} is not for this round and "
                                f"client, or was changed") from None
        return plain[:SEED_BYTES], plain[SEED_BYTES:]

    def confirm(self, survivors: object, dropped: object) -> dict[int, bytes]:
        """Stage 3 (consistency, Bonawitz et al.'s round 3 with pairwise MACs in place of
        signatures): the round's global survivor and dropped lists; a MAC of them for each of my
        neighbours among the survivors. I confirm one view only, and reveal nothing yet."""
        self._expect(3, "confirm")
        survivors, dropped = _ids(survivors, "survivors"), _ids(dropped, "dropped")
        if not set(survivors) | set(dropped) <= set(self.cohort):
            raise ProtocolError("unmask: survivors or dropped clients outside the cohort this client accepted")
        if set(survivors) & set(dropped):
            raise ProtocolError("unmask: a client named both a survivor and dropped (that would reveal its input)")
        if self.me not in survivors or not set(self._masked_with) <= set(survivors) | set(dropped):
            raise ProtocolError("unmask: this client not a survivor, or a neighbour it masked with left unnamed")
        local = [j for j in survivors if j in self._masked_with]
        if len(local) < self.needed:  # survivors it can check (its neighbours' MACs), never a list's length
            raise ProtocolError(f"unmask: {len(local)} survivors among its neighbours, below the threshold and "
                                f"the owner's {self.min_cohort} + {self.max_colluders}")
        if len(survivors) < self.min_cohort + self.max_colluders:
            raise ProtocolError(f"unmask: {len(survivors)} survivors; this owner needs {self.min_cohort} honest ones "
                                f"with up to {self.max_colluders} of the server's among them")
        self._view = (survivors, dropped)
        self._statement = hashlib.sha256(_info(self.round_id, "view", *survivors, "|", *dropped)).digest()
        return {j: self._mac(j, self.me, j) for j in local if j != self.me}

    def _mac(self, peer: int, sender: int, receiver: int) -> bytes:
        key = _derive(_agree(self._c, self._keys[peer][0], f"client {peer}'s c key"),
                      _info(self.round_id, "confirm", min(sender, receiver), max(sender, receiver)))
        return hmac.new(key, self._statement + _info(self.round_id, "from", sender, receiver), "sha256").digest()

    def unmask(self, confirmations: object) -> dict[str, dict[int, bytes]]:
        """Stage 4: my neighbours' MACs of the view (sender → tag); my shares of the survivors' b
        and of the dropped clients' s, once at least t of my survivors (me included) confirmed
        the view I confirmed. Never both for one client."""
        self._expect(4, "unmask")
        survivors, dropped = self._view
        if not isinstance(confirmations, dict):
            raise ProtocolError("unmask: a map of client id to confirmation was expected")
        local = [j for j in survivors if j in self._masked_with]
        agreed = 1 + sum(1 for j in local if j != self.me and isinstance(confirmations.get(j), (bytes, bytearray))
                         and hmac.compare_digest(bytes(confirmations[j]), self._mac(j, j, self.me)))
        if agreed < self.needed:
            self._shares, self._b = {}, b""
            raise ProtocolError(f"unmask: {agreed} neighbours confirmed this round's survivors, below the threshold")
        answer = {"b": {j: self._shares[j][0] for j in local},
                  "s": {j: self._shares[j][1] for j in dropped if j in self._masked_with}}
        self._shares, self._b = {}, b""  # nothing more to reveal from this round
        return answer


def minimum_threshold(holders: int) -> int:
    """The smallest threshold a client accepts: more than two thirds of the share holders
    (Bonawitz et al.'s bound for a server that deviates from the protocol, with up to a third
    of the clients its own), and at least 2."""
    return max(2, (2 * holders) // 3 + 1) if holders > 1 else 1


# -- the server's side ----------------------------------------------------------------------
class SecAggServer:
    """The coordinator of one round: it routes the clients' messages and unmasks the sum. The
    neighbourhood graph is the complete graph up to `degree` + 1 clients, else a random graph
    of that degree (SecAgg+'s Harary graph on a shuffled order)."""

    def __init__(self, round_id: bytes, cohort: list[int], length: int, degree: int = 0,
                 threshold: int | None = None, shuffle_seed: int | None = None):
        self.round_id, self.cohort, self.length = round_id, sorted(cohort), length
        n = len(self.cohort)
        k = n - 1 if degree <= 0 or degree >= n - 1 else degree + (degree % 2)
        order = list(self.cohort)
        if k < n - 1:
            np.random.default_rng(shuffle_seed).shuffle(order)
        position = {c: i for i, c in enumerate(order)}
        self.neighbours = {c: (list(self.cohort) if k >= n - 1 else
                               sorted({order[(position[c] + d) % n] for d in range(-(k // 2), k // 2 + 1)}))
                           for c in self.cohort}
        size = k + 1
        self.threshold = threshold if threshold is not None else minimum_threshold(size)
        self.keys: dict[int, dict] = {}
        self.inbox: dict[int, dict[int, bytes]] = {}
        self.masked: dict[int, np.ndarray] = {}
        self.holders: dict[int, list[int]] = {}  # who holds shares of each client's secrets
        self.bytes_in = self.bytes_out = 0

    def setup(self, client: int) -> dict:
        return {"cohort": self.cohort, "neighbours": self.neighbours[client], "threshold": self.threshold}

    def collect_keys(self, keys: dict[int, dict]) -> None:
        self.keys = dict(keys)
        self.bytes_in += 64 * len(keys)
        self._enough(len(self.keys), "advertised keys")

    def keys_for(self, client: int) -> dict[int, dict]:
        out = {j: self.keys[j] for j in self.neighbours[client] if j in self.keys}
        self.bytes_out += 64 * len(out)
        return out

    def collect_shares(self, shares: dict[int, dict[int, bytes]]) -> None:
        self.inbox = {}
        for sender, per_receiver in shares.items():
            self.holders[sender] = sorted(per_receiver)
            for receiver, ciphertext in per_receiver.items():
                self.inbox.setdefault(receiver, {})[sender] = ciphertext
                self.bytes_in += len(ciphertext)
        self._enough(len(shares), "shared their keys")

    def shares_for(self, client: int) -> dict[int, bytes]:
        out = self.inbox.get(client, {})
        self.bytes_out += sum(len(c) for c in out.values())
        return out

    def collect_masked(self, masked: dict[int, np.ndarray]) -> None:
        self.masked = {c: np.asarray(v, dtype=np.uint64) for c, v in masked.items() if c in self.inbox}
        self.bytes_in += 8 * self.length * len(self.masked)
        self._enough(len(self.masked), "sent masked inputs")

    def unmask_request(self, client: int) -> dict:
        """The global view, the same for every client."""
        return {"survivors": sorted(self.masked), "dropped": sorted(set(self.holders) - set(self.masked))}

    def route_confirmations(self, tags: dict[int, dict[int, bytes]]) -> dict[int, dict[int, bytes]]:
        out: dict[int, dict[int, bytes]] = {}
        for sender, per_receiver in tags.items():
            for receiver, tag in per_receiver.items():
                out.setdefault(receiver, {})[sender] = tag
        return out

    def finish(self, answers: dict[int, dict]) -> np.ndarray:
        """The sum of the survivors' vectors, from the unmask answers of at least t survivors."""
        self._enough(len(answers), "answered the unmask request")
        total = np.zeros(self.length, dtype=np.uint64)
        for vector in self.masked.values():
            total += vector
        for j in self.masked:  # self masks
            shares = {h: a["b"][j] for h, a in answers.items() if j in a["b"]}
            self._enough(len(shares), f"hold a share of client {j}'s self mask")
            total -= expand_mask(combine_secret(shares, self.holders[j], self.threshold), self.length)
        for d in sorted(set(self.holders) - set(self.masked)):  # pairwise masks a dropped client left
            shares = {h: a["s"][d] for h, a in answers.items() if d in a["s"]}
            if not shares:
                continue
            self._enough(len(shares), f"hold a share of dropped client {d}'s key")
            private = X25519PrivateKey.from_private_bytes(combine_secret(shares, self.holders[d], self.threshold))
            for j in self.masked:
                if d in self.inbox.get(j, {}) and j != d:
                    pair = _derive(private.exchange(_public(self.keys[j]["s"], "s key")),
                                   _info(self.round_id, "mask", min(j, d), max(j, d)))
                    mask = expand_mask(pair, self.length)
                    total = total - mask if pairwise_sign(j, d) > 0 else total + mask
        self.bytes_in += sum(32 * (len(a["b"]) + len(a["s"])) for a in answers.values())
        return total

    def _enough(self, count: int, what: str) -> None:
        if count < self.threshold:
            raise RoundAbandoned(f"secure aggregation: {count} clients {what}, below the threshold "
                                 f"{self.threshold}; the round is abandoned and nothing was unmasked")
