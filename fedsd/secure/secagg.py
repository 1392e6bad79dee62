"""Secure aggregation: SecAgg+ (Bell, Bonawitz, Gascón, Lepoint & Raykova, CCS 2020), the server
learning only the sum of the clients' vectors, modulo 2^64, in Bonawitz et al.'s (CCS 2017)
malicious-server form: each client signs with a long-term Ed25519 key its neighbours know from
the owners' roster (fedsd.secure.identity). SecAgg+ shares with a neighbourhood only; the complete
graph is the 2017 protocol. The stages, as the papers number their rounds:

  0. Advertise keys (`SecAggClient.advertise`): the client checks the cohort (every member on
     its roster), its neighbourhood and the threshold (more than two thirds of the neighbours,
     and more than (neighbours + F)/2, so two stories cannot both reach it); makes two X25519 key
     pairs, c for encrypting its shares and s for its pairwise masks; sends the public halves
     with its identity key, signed over the round, its id, the cohort, the threshold and the
     digest of the round's settings (with distributed noise, the plan every share is sized by),
     which every neighbour checks against its own at stage 1: a round whose clients were given
     different settings stops there, before anything is drawn or charged. (Bonawitz et al. bind
     the round's identity into each signature; the settings' digest is fedsd's addition.)
  1. Share keys (`share_keys`): given its neighbours' signed keys, it checks every signature
     against the signer's roster key, every key's encoding, and computes every agreement (a
     low-order key is refused here, before anything is drawn or charged); then draws its
     self-mask seed b (16 bytes from the operating system), splits b and its secret s key t-of-k
     with Shamir's scheme, and sends each neighbour its two shares, encrypted with AES-GCM under
     a key HKDF derives from X25519(c_i, c_j), bound to the round and to both ids, with a signed
     commitment (SHA-256) to each share, and signs its dealing: its holders in order, t, b's
     SHA-256 and its s key's public half (fedsd's addition: t shares that rebuild another secret
     are then evidence against their dealer, `verify_blame`).
  2. Masked input (`masked_input`): given the ciphertexts and commitments addressed to it, it
     checks each share against its dealer's commitment and sends y = x + PRG(HKDF(b)) +
     Σ_j ±PRG(s_ij) mod 2^64 over the neighbours j that sent it shares; s_ij = HKDF(X25519(s_i,
     s_j)), the sign by id (the lower id adds).
  3. Consistency check (`confirm`; Bonawitz et al.'s round 3): given the round's survivors (who
     sent a masked input) and dropped clients, the same lists for every client, it checks them
     and signs that one view.
  4. Unmask (`unmask`): given its neighbours' signatures, once at least the threshold of them
     (and its owner's t + f) signed the view it signed, it reveals its share of b for each
     survivor and its share of s for each dropped neighbour: never both for one client, nor a
     second answer in a round. Without the consistency check a server could tell two groups
     two stories and collect both shares of one client (tests/secure/test_attack_secagg.py).

The server (`SecAggServer`) routes the messages, checks every share it is given against its
dealer's commitment (a holder that sent another is named in `culprits`), and at the end rebuilds
each survivor's b and each dropped client's s from t good shares, removes the self masks and the
pairwise masks that dropped clients left, and has the sum. Fewer than t at any stage: the round
is abandoned before anything is unmasked.

Primitives, none written here: X25519, Ed25519, HKDF-SHA256, AES-GCM and AES-256-CTR from
`cryptography`; Shamir over GF(2^128) from pycryptodome (a Flower dependency). Masks are
AES-256-CTR keystreams under 256-bit keys. (Flower's own SecAgg+ XORs its 32-byte seed to 32
bits and expands it with numpy's Mersenne Twister: its masks fall to a 2^32 search.)

Without a roster each client signs with a key made for the round: the checks run, and prove
nothing against a server that relays keys falsely (docs/algorithms.md, "What it assumes").

What the clients' services check (everything from the server is hostile): the stages come in
order, once each (a replayed or late message is refused); the round id is the one this state
was made for; every id is in the cohort the client accepted; the cohort is at least the
owner's `min_cohort` (t), and the survivors at least t + `max_colluders` (f, the most of a
round's clients the owner allows to be the server's), so that t honest noise shares are in the
sum; a neighbourhood is at most `max_neighbours`; a survivor and a dropped client are never
the same; every public key is canonical; every signature is the signer's; and every share
decrypts, names this round, its sender and this client, and is the one its dealer committed to.
"""
from __future__ import annotations

import hashlib
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

from fedsd.secure.identity import SIGNATURE_BYTES, Identity, Roster, verify

MODULUS_BITS = 64  # the vectors are uint64, summed modulo 2^64
SEED_BYTES = 32  # pairwise keys and mask keys: 256 bits
SELF_SEED_BYTES = 16  # the self-mask seed b: 128 bits, one Shamir secret (its mask key is HKDF(b), 256 bits)
CHUNK = 16  # pycryptodome's Shamir shares 16-byte secrets: a 32-byte secret (the s key) is two
NONCE = 12
SHARE_BYTES = SELF_SEED_BYTES + SEED_BYTES  # a share of b and a share of s, in one ciphertext
MAX_ID = (1 << 63) - 1


class ProtocolError(Exception):
    """A stage message this client refuses; its text says why and nothing of the data."""


class RoundAbandoned(Exception):
    """Too few clients went on for the round to be unmasked, or their shares did not rebuild
    one secret; nothing was revealed or applied. `culprits`: client id → what it did."""

    def __init__(self, message: str, culprits: dict | None = None):
        super().__init__(message)
        self.culprits = dict(culprits or {})


# -- primitives ------------------------------------------------------------------------------
def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """`length` uint64 words of AES-256-CTR keystream under `seed` (32 bytes). Each seed masks
    one vector of one round, so the zero nonce is never reused under a key."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)) + encryptor.finalize(), dtype="<u8").copy()


def self_mask_key(seed: bytes) -> bytes:
    """The AES-256 key of a self mask, from its 128-bit seed b (b is what is Shamir-shared: one
    16-byte secret, half the sharing and rebuilding work of a 32-byte one)."""
    return _derive(seed, b"fedsd-secagg|self-mask")


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
    halves = [Shamir.split(threshold, len(holders), secret[i:i + CHUNK]) for i in range(0, len(secret), CHUNK)]
    return {holder: b"".join(half[k][1] for half in halves) for k, holder in enumerate(holders)}


def combine_secret(shares: dict[int, bytes], holders: list[int], threshold: int) -> bytes:
    """The secret from `threshold` of its shares (holder id → 32-byte share)."""
    position = {holder: k + 1 for k, holder in enumerate(holders)}
    chosen = sorted(shares)[:threshold]
    return b"".join(Shamir.combine([(position[h], shares[h][i:i + CHUNK]) for h in chosen])
                    for i in range(0, len(shares[chosen[0]]), CHUNK))


def seed_digest(round_id: bytes, dealer: int, seed: bytes) -> bytes:
    """SHA-256 of a dealer's self-mask seed b, bound to the round and the dealer: what its signed
    dealing commits b to (b has 128 bits of entropy; its digest tells the server nothing of it)."""
    return hashlib.sha256(_info(round_id, "self-seed", dealer) + bytes(seed)).digest()


def _rebuilt_mismatch(part: str, secret: bytes, round_id: bytes, dealer: int, committed: bytes) -> bool:
    """Whether a secret rebuilt from t shares is not the one the dealer signed for: b's digest, or
    the public half of s (the s key it advertised)."""
    if part == "b":
        return seed_digest(round_id, dealer, secret) != committed
    return _raw(X25519PrivateKey.from_private_bytes(secret).public_key()) != committed


MAX_EVIDENCE_HOLDERS = 1024  # far above the 128 neighbours a client shares with; bounds a check's cost


def verify_blame(evidence: dict, dealer_key: bytes) -> bool:
    """Whether `evidence` (what SecAggServer.finish found) proves that its dealer's t shares of b
    or of s, each committed to and signed by it, rebuild a secret other than the one its signed
    dealing names (b's digest, s's public key). Anyone holding the roster checks it with one
    rebuilding of t ≤ 1,024 shares; a changed share, commitment, order, t or secret fails."""
    try:
        rid, dealer, part = bytes.fromhex(evidence["round_id"]), int(evidence["dealer"]), evidence["part"]
        holders, t = [int(h) for h in evidence["holders"]], int(evidence["threshold"])
        committed = {"b": bytes.fromhex(evidence["seed_digest"]), "s": bytes.fromhex(evidence["s_public"])}
        size = {"b": SELF_SEED_BYTES, "s": SEED_BYTES}.get(part)
        if size is None or not len(holders) <= MAX_EVIDENCE_HOLDERS or len(set(holders)) != len(holders) or \
                not minimum_threshold(len(holders)) <= t <= len(holders) or len(evidence["shares"]) != t:
            return False
        if not verify(dealer_key, bytes.fromhex(evidence["dealing"]),
                      _dealing_message(rid, dealer, holders, t, committed["b"], committed["s"])):
            return False
        shares = {}
        for holder, share in evidence["shares"].items():
            holder, share, commit = int(holder), bytes.fromhex(share), bytes.fromhex(evidence["commits"][str(holder)])
            if holder not in holders or len(share) != size or len(commit) != 64 + SIGNATURE_BYTES or not verify(
                    dealer_key, commit[64:], _commit_message(rid, dealer, holder, commit[:32], commit[32:64])):
                return False
            if _commitment(rid, dealer, holder, part, share) != (commit[:32] if part == "b" else commit[32:64]):
                return False
            shares[holder] = share
        return _rebuilt_mismatch(part, combine_secret(shares, holders, t), rid, dealer, committed[part])
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def identify_message(round_id: bytes, node_id: int) -> bytes:
    """What an owner signs at the identify stage: that it answers for this node in this round
    (an identity key and an id alone are public: a member could tell another owner's)."""
    return _info(round_id, "identify", int(node_id))


def pairwise_sign(me: int, other: int) -> int:
    return 1 if me < other else -1


# -- the client's side: one object per round, held by the client's own process ---------------
def _advert(round_id: bytes, member: int, cohort: list[int], threshold: int, c: bytes, s: bytes, v: bytes,
            context: bytes = b"") -> bytes:
    """What a client signs at stage 0: its keys for this round, its id, the cohort and the
    threshold it was told, and the digest of the round's settings it was given (`context`), so
    that two clients told two cohorts, thresholds or settings (a noise plan) refuse."""
    return _info(round_id, "advertise", member, threshold, *cohort) + b"|" + bytes(c) + bytes(s) + bytes(v) + \
        b"|" + bytes(context)


def _commitment(round_id: bytes, dealer: int, holder: int, what: str, share: bytes) -> bytes:
    """A dealer's commitment to one share (SHA-256; a share has 256 bits of entropy to the
    server, which sees fewer than t of them in the clear)."""
    return hashlib.sha256(_info(round_id, "commit", what, dealer, holder) + bytes(share)).digest()


def _commit_message(round_id: bytes, dealer: int, holder: int, b_digest: bytes, s_digest: bytes) -> bytes:
    return _info(round_id, "commitments", dealer, holder) + b"|" + bytes(b_digest) + bytes(s_digest)


def _dealing_message(round_id: bytes, dealer: int, holders: list[int], threshold: int, b_digest: bytes,
                     s_public: bytes) -> bytes:
    """What a dealer signs of its dealing (fedsd's addition to stage 1): who holds its shares, in
    the order that gives each its x (position + 1), t, its self-mask seed's digest and its s key's
    public half. With its signed commitments, t shares that rebuild another secret are evidence
    anyone with the roster can check (`verify_blame`); the server cannot frame an honest dealer by
    listing its holders in another order."""
    return _info(round_id, "dealing", dealer, threshold, *holders) + b"|" + bytes(b_digest) + bytes(s_public)


def _view_message(round_id: bytes, survivors: list[int], dropped: list[int]) -> bytes:
    return _info(round_id, "view", *survivors, "|", *dropped)


# The largest neighbourhood a client shares with (Shamir's cost grows as its square).
MAX_NEIGHBOURS = 128


@dataclass
class SecAggClient:
    """One client's state in one round. `min_cohort`: the fewest clients the owner lets a round
    have (its assumption of honest clients, with distributed noise); a cohort or a survivor set
    below it, or below the threshold, is refused. `identity` and `roster`: the owner's long-term
    signing key and the members it accepts (fedsd.secure.identity); with them every neighbour's keys,
    commitments and view must be signed by that neighbour's roster key. Without a roster a key
    made for the round signs, which proves nothing against a server that relays keys falsely."""

    me: int
    round_id: bytes
    min_cohort: int = 2
    max_colluders: int = 0  # f: the most of a round's clients the owner allows to be the server's
    max_neighbours: int = MAX_NEIGHBOURS
    identity: Identity | None = None
    roster: Roster | None = None
    stage: int = 0
    cohort: list[int] = field(default_factory=list)
    neighbours: list[int] = field(default_factory=list)  # the holders of my shares, me included
    threshold: int = 0
    _c: X25519PrivateKey | None = None
    _s: X25519PrivateKey | None = None
    _b: bytes = b""
    _keys: dict = field(default_factory=dict)  # neighbour → (c public, s public, signing key)
    _enc: dict = field(default_factory=dict)  # neighbour → the AES-GCM key of our shares
    _pairs: dict = field(default_factory=dict)  # neighbour → our pairwise mask seed
    _shares: dict = field(default_factory=dict)  # sender → (share of its b, share of its s)
    _masked_with: list[int] = field(default_factory=list)
    _view: tuple = ((), ())
    _statement: bytes = b""
    context: bytes = b""  # the digest of the round's settings this client was advertised (advertise)

    def __post_init__(self):
        if self.roster is not None:
            if self.identity is None or self.identity.id != self.me:
                raise ValueError("with a roster, the client's id is its identity's (fedsd.secure.identity.protocol_id)")
            if self.me not in self.roster:
                raise ProtocolError("this owner's own identity is not on its roster")
        elif self.identity is None:
            self.identity = Identity()  # a key for this round only: it signs, and proves nothing to the others

    def name(self, member: int) -> str:
        """A neighbour as the owner knows it: its roster name, else its id."""
        return self.roster.name(member) if self.roster is not None else f"client {member}"

    @property
    def needed(self) -> int:
        """The fewest neighbours a stage goes on with: the threshold, and the owner's t honest
        ones with up to f of the server's among them (each one a neighbour whose keys, shares
        and signatures this client checks itself)."""
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

    def advertise(self, cohort: object, neighbours: object, threshold: object, context: bytes = b"") -> dict:
        """Stage 0: the round's cohort, my neighbourhood (me included) and the threshold t; my
        two public keys, my signing key and my signature of them with the round, the cohort and
        `context`, the digest of the round's settings (fedsd.app.secure_sum.settings_digest): a
        neighbour given other settings (another noise plan) does not verify at share-keys."""
        self._expect(0, "advertise-keys")
        if not isinstance(context, (bytes, bytearray)) or len(context) > 64:
            raise ProtocolError("advertise: the settings' digest is at most 64 bytes")
        cohort, neighbours = _ids(cohort, "cohort"), _ids(neighbours, "neighbours")
        if self.me not in neighbours or not set(neighbours) <= set(cohort):
            raise ProtocolError("neighbours: must hold this client and lie in the cohort")
        if len(neighbours) > self.max_neighbours:
            raise ProtocolError(f"neighbours: {len(neighbours)}, above the {self.max_neighbours} this owner shares with")
        if len(cohort) < self.min_cohort:
            raise ProtocolError(f"cohort: {len(cohort)} clients, below the {self.min_cohort} this owner requires")
        if self.roster is not None:
            strangers = [j for j in cohort if j not in self.roster]
            if strangers:
                raise ProtocolError(f"cohort: {', '.join(self.name(j) for j in strangers[:4])} not on this owner's "
                                    f"roster (culprit: {strangers[0]})")
        if self.roster is not None and neighbours != cohort:
            # A neighbourhood is the server's to choose, and no signature covers it: with uneven
            # ones, shares of one client's b and of its partners' s come from different groups,
            # each story reaching its own threshold (a review playing the attacker unmasked one
            # owner so). With a roster, the complete graph: every neighbourhood is the cohort.
            raise ProtocolError("neighbours: with a roster, every member of the cohort (the complete graph); "
                                "a neighbourhood the server chooses could split the round into two stories")
        if len(neighbours) < self.min_cohort + self.max_colluders:  # it could never unmask: refused before any cost
            raise ProtocolError(f"neighbours: {len(neighbours)} clients, below the {self.min_cohort} honest ones "
                                f"and {self.max_colluders} of the server's this owner requires")
        if not isinstance(threshold, int) or isinstance(threshold, bool) or not (
                minimum_threshold(len(neighbours)) <= threshold <= len(neighbours)):
            raise ProtocolError(f"threshold: must be in [{minimum_threshold(len(neighbours))}, {len(neighbours)}] "
                                f"for {len(neighbours)} neighbours (more than two thirds of them)")
        if 2 * threshold <= len(neighbours) + self.max_colluders:
            # Two stories: the server's f clients confirm both, and two groups of honest ones each
            # reach t unless 2t > neighbours + f.
            raise ProtocolError(f"threshold: {threshold} is at or below ({len(neighbours)} neighbours + "
                                f"{self.max_colluders} of the server's) / 2; two views of the round could both "
                                f"reach it")
        if threshold > len(neighbours) - self.max_colluders:
            # f silent members at the unmask would abandon a round this client has paid for.
            raise ProtocolError(f"threshold: {threshold} is above {len(neighbours)} neighbours − {self.max_colluders} "
                                f"of the server's, who could abandon the round after this owner is charged "
                                f"(an owner that allows f needs more than 3f neighbours)")
        if len(neighbours) - self.max_colluders < self.min_cohort + self.max_colluders:
            # It unmasks only with t + f neighbours: f silent members would leave fewer, after the charge.
            raise ProtocolError(f"neighbours: {len(neighbours)}, below this owner's {self.min_cohort} honest ones and "
                                f"twice {self.max_colluders} of the server's: that many silent after the masked input "
                                f"would leave fewer than it unmasks with, after this owner is charged")
        self.cohort, self.neighbours, self.threshold, self.context = cohort, neighbours, threshold, bytes(context)
        self._c, self._s = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        c, s, v = _raw(self._c.public_key()), _raw(self._s.public_key()), self.identity.public
        return {"c": c, "s": s, "v": v, "sig": self.identity.sign(_advert(self.round_id, self.me, cohort,
                                                                            threshold, c, s, v, self.context))}

    def _checked_keys(self, keys: dict, holders: list[int]) -> dict[int, tuple]:
        """Every neighbour's keys, before anything is drawn or charged: signed by the neighbour
        (its roster key, where the owner has a roster) for this round, cohort and threshold,
        canonical, distinct, and each agreeing on a secret with ours. A failure names the
        neighbour."""
        parsed = {}
        for j in holders:
            entry = keys[j] if isinstance(keys[j], dict) else {}
            c = _public(entry.get("c"), f"{self.name(j)}'s c key (culprit: {j})")
            s = _public(entry.get("s"), f"{self.name(j)}'s s key (culprit: {j})")
            v = entry.get("v")
            if not isinstance(v, (bytes, bytearray)) or len(v) != 32:
                raise ProtocolError(f"share-keys: {self.name(j)} sent no signing key (culprit: {j})")
            if self.roster is not None and self.roster.key(j) != bytes(v):
                raise ProtocolError(f"share-keys: the signing key given for {self.name(j)} is not its roster key "
                                    f"(culprit: {j})")
            if not verify(bytes(v), entry.get("sig"), _advert(self.round_id, j, self.cohort, self.threshold,
                                                               _raw(c), _raw(s), bytes(v), self.context)):
                raise ProtocolError(f"share-keys: the keys of {self.name(j)} are not signed by it for this round, "
                                    f"cohort, threshold and settings (culprit: {j}; given other settings, or not "
                                    f"its keys)")
            parsed[j] = (c, s, bytes(v))
        raws = [_raw(k) for c, s, _ in parsed.values() for k in (c, s)] + [v for _, _, v in parsed.values()]
        if len(set(raws)) != len(raws):
            raise ProtocolError("share-keys: two clients advertised the same key")
        return parsed

    def share_keys(self, keys: object) -> dict[str, dict[int, bytes]]:
        """Stage 1: the public keys of my neighbours that advertised (id → {"c", "s", "v",
        "sig"}); for each of them its encrypted shares of b and s, and my signed commitments to
        them (the server checks the shares it is given at the end against these)."""
        self._expect(1, "share-keys")
        if not isinstance(keys, dict) or not all(isinstance(k, int) for k in keys):
            raise ProtocolError("share-keys: a map of client id to public keys was expected")
        holders = self._from_neighbours(list(keys), "share-keys", "keys of clients", "went on")
        mine = keys[self.me]
        if not isinstance(mine, dict) or (mine.get("c"), mine.get("s"), mine.get("v")) != (
                _raw(self._c.public_key()), _raw(self._s.public_key()), self.identity.public):
            raise ProtocolError("share-keys: this client's own keys came back changed")
        parsed = self._checked_keys(keys, holders)
        enc, pairs = {}, {}
        for j in holders:  # every agreement now: a low-order key is refused before anything is charged
            low, high = min(self.me, j), max(self.me, j)
            enc[j] = _derive(_agree(self._c, parsed[j][0], f"{self.name(j)}'s c key (culprit: {j})"),
                             _info(self.round_id, "enc", low, high))
            if j != self.me:
                pairs[j] = _derive(_agree(self._s, parsed[j][1], f"{self.name(j)}'s s key (culprit: {j})"),
                                   _info(self.round_id, "mask", low, high))
        self._keys, self._enc, self._pairs, self.neighbours = parsed, enc, pairs, holders
        self._b = secrets.token_bytes(SELF_SEED_BYTES)
        b_shares = split_secret(self._b, self.threshold, holders)
        s_shares = split_secret(self._s.private_bytes_raw(), self.threshold, holders)
        out, commits = {}, {}
        for j in holders:
            nonce = secrets.token_bytes(NONCE)
            out[j] = nonce + AESGCM(enc[j]).encrypt(nonce, b_shares[j] + s_shares[j],
                                                     _info(self.round_id, "share", self.me, j))
            hb = _commitment(self.round_id, self.me, j, "b", b_shares[j])
            hs = _commitment(self.round_id, self.me, j, "s", s_shares[j])
            commits[j] = hb + hs + self.identity.sign(_commit_message(self.round_id, self.me, j, hb, hs))
        digest = seed_digest(self.round_id, self.me, self._b)
        dealing = self.identity.sign(_dealing_message(self.round_id, self.me, holders, self.threshold, digest,
                                                      _raw(self._s.public_key())))
        return {"shares": out, "commits": commits, "dealing": dealing, "digest": digest}

    def masked_input(self, ciphertexts: object, commits: object, vector: np.ndarray) -> np.ndarray:
        """Stage 2: the shares sent to me (sender id → ciphertext) with their dealers' signed
        commitments, and my vector (uint64); the vector masked."""
        self._expect(2, "masked-input")
        self._shares = self._opened(ciphertexts, commits)
        senders = sorted(self._shares)
        vector = np.asarray(vector)
        if vector.dtype != np.uint64 or vector.ndim != 1:
            raise ValueError("masked_input: the vector is one-dimensional uint64")
        masked = vector + expand_mask(self_mask_key(self._b), len(vector))
        for j in senders:
            if j != self.me:
                mask = expand_mask(self._pairs[j], len(vector))
                masked = masked + mask if pairwise_sign(self.me, j) > 0 else masked - mask
        self._masked_with = senders
        return masked

    def check_masked_input(self, ciphertexts: object, commits: object) -> None:
        """Stage 2's checks of the shares, changing nothing: a service runs them before it
        computes its vector (and charges its ledger for it), then masked_input."""
        self._expect(2, "masked-input", advance=False)
        self._opened(ciphertexts, commits)

    def _opened(self, ciphertexts: object, commits: object) -> dict[int, tuple[bytes, bytes]]:
        if not isinstance(ciphertexts, dict) or not isinstance(commits, dict):
            raise ProtocolError("masked-input: maps of sender id to ciphertext and to commitment were expected")
        senders = self._from_neighbours(list(ciphertexts), "masked-input", "shares from clients", "sent shares")
        return {j: self._open(j, ciphertexts[j], commits.get(j)) for j in senders}

    def _open(self, sender: int, ciphertext: object, commit: object) -> tuple[bytes, bytes]:
        who = f"{self.name(sender)} (culprit: {sender})"
        if not isinstance(ciphertext, (bytes, bytearray)) or len(ciphertext) != NONCE + SHARE_BYTES + 16:
            raise ProtocolError(f"masked-input: the share from {who} is malformed")
        try:
            plain = AESGCM(self._enc[sender]).decrypt(bytes(ciphertext[:NONCE]), bytes(ciphertext[NONCE:]),
                                                      _info(self.round_id, "share", sender, self.me))
        except InvalidTag:
            raise ProtocolError(f"masked-input: the share from {who} is not for this round and client, or was "
                                f"changed") from None
        b, s = plain[:SELF_SEED_BYTES], plain[SELF_SEED_BYTES:]
        if not isinstance(commit, (bytes, bytearray)) or len(commit) != 64 + SIGNATURE_BYTES or not verify(
                self._keys[sender][2], bytes(commit[64:]),
                _commit_message(self.round_id, sender, self.me, bytes(commit[:32]), bytes(commit[32:64]))):
            raise ProtocolError(f"masked-input: the commitment to the share from {who} is not signed by it")
        if (bytes(commit[:32]), bytes(commit[32:64])) != (_commitment(self.round_id, sender, self.me, "b", b),
                                                         _commitment(self.round_id, sender, self.me, "s", s)):
            raise ProtocolError(f"masked-input: the share from {who} is not the one it committed to")
        return b, s

    def confirm(self, survivors: object, dropped: object) -> bytes:
        """Stage 3 (consistency, Bonawitz et al.'s round 3): the round's global survivor and
        dropped lists; my signature of that view. I sign one view only, and reveal nothing yet."""
        self._expect(3, "confirm")
        survivors, dropped = _ids(survivors, "survivors"), _ids(dropped, "dropped")
        if not set(survivors) | set(dropped) <= set(self.cohort):
            raise ProtocolError("unmask: survivors or dropped clients outside the cohort this client accepted")
        if set(survivors) & set(dropped):
            raise ProtocolError("unmask: a client named both a survivor and dropped (that would reveal its input)")
        if self.me not in survivors or not set(self._masked_with) <= set(survivors) | set(dropped):
            raise ProtocolError("unmask: this client not a survivor, or a neighbour it masked with left unnamed")
        local = [j for j in survivors if j in self._masked_with]
        if len(local) < self.needed:  # survivors it can check (its neighbours' signatures), never a list's length
            raise ProtocolError(f"unmask: {len(local)} survivors among its neighbours, below the threshold and "
                                f"the owner's {self.min_cohort} + {self.max_colluders}")
        if len(survivors) < self.min_cohort + self.max_colluders:
            raise ProtocolError(f"unmask: {len(survivors)} survivors; this owner needs {self.min_cohort} honest ones "
                                f"with up to {self.max_colluders} of the server's among them")
        self._view = (survivors, dropped)
        self._statement = _view_message(self.round_id, survivors, dropped)
        return self.identity.sign(self._statement)

    def unmask(self, confirmations: object) -> dict[str, dict[int, bytes]]:
        """Stage 4: my neighbours' signatures of the view (signer → signature); my shares of the
        survivors' b and of the dropped clients' s, once at least `needed` of my surviving
        neighbours (me included) signed the view I signed. Never both for one client."""
        self._expect(4, "unmask")
        survivors, dropped = self._view
        if not isinstance(confirmations, dict):
            raise ProtocolError("unmask: a map of client id to signature was expected")
        local = [j for j in survivors if j in self._masked_with]
        agreed = 1 + sum(1 for j in local if j != self.me
                         and verify(self._keys[j][2], confirmations.get(j), self._statement))
        if agreed < self.needed:
            self._shares, self._b = {}, b""
            raise ProtocolError(f"unmask: {agreed} neighbours signed this round's survivors, below the threshold")
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
    of that degree (SecAgg+'s Harary graph on a shuffled order). `culprits` names, by id, each
    client that sent a share other than the one its dealer committed to."""

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
        self.commits: dict[int, dict[int, bytes]] = {}  # dealer → holder → signed commitment
        self.masked: dict[int, np.ndarray] = {}
        self.holders: dict[int, list[int]] = {}  # who holds shares of each client's secrets
        self.dealings: dict[int, tuple[bytes, bytes]] = {}  # dealer → its signed dealing, its b's digest
        self.evidence: dict[int, dict] = {}  # dealer → proof that its shares rebuild another secret
        self.culprits: dict[int, str] = {}
        self.bytes_in = self.bytes_out = 0

    def setup(self, client: int) -> dict:
        return {"cohort": self.cohort, "neighbours": self.neighbours[client], "threshold": self.threshold}

    def collect_keys(self, keys: dict[int, dict]) -> None:
        self.keys = dict(keys)
        self.bytes_in += 160 * len(keys)
        self._enough(len(self.keys), "advertised keys")

    def keys_for(self, client: int) -> dict[int, dict]:
        out = {j: self.keys[j] for j in self.neighbours[client] if j in self.keys}
        self.bytes_out += 160 * len(out)
        return out

    def collect_shares(self, shares: dict[int, dict[str, dict[int, bytes]]]) -> None:
        """Each dealer's {"shares": holder → ciphertext, "commits": holder → signed commitment}."""
        self.inbox, shares = {}, dict(shares)
        for sender, dealt in list(shares.items()):
            holders = sorted(dealt["shares"])
            key, digest = self.keys.get(sender, {}), dealt.get("digest")
            if not isinstance(digest, bytes) or len(digest) != 32 or not verify(
                    key.get("v", b""), bytes(dealt.get("dealing") or b""),
                    _dealing_message(self.round_id, sender, holders, self.threshold, digest, key.get("s", b""))):
                # without it, shares of another secret could not be laid at its door: left out
                self.culprits[sender] = "a dealing (its holders and t) it did not sign"
                del shares[sender]
                continue
            self.holders[sender] = holders
            self.commits[sender] = dict(dealt["commits"])
            self.dealings[sender] = (dealt["dealing"], digest)
            for receiver, ciphertext in dealt["shares"].items():
                self.inbox.setdefault(receiver, {})[sender] = ciphertext
                self.bytes_in += len(ciphertext) + len(dealt["commits"].get(receiver, b""))
        self._enough(len(shares), "shared their keys")

    def shares_for(self, client: int) -> dict[str, dict[int, bytes]]:
        """The ciphertexts addressed to `client`, and each dealer's commitment to them."""
        out = self.inbox.get(client, {})
        commits = {j: self.commits.get(j, {}).get(client, b"") for j in out}
        self.bytes_out += sum(len(c) for c in out.values()) + sum(len(c) for c in commits.values())
        return {"ciphertexts": out, "commits": commits}

    def collect_masked(self, masked: dict[int, np.ndarray]) -> None:
        self.masked = {c: np.asarray(v, dtype=np.uint64) for c, v in masked.items() if c in self.inbox}
        self.bytes_in += 8 * self.length * len(self.masked)
        self._enough(len(self.masked), "sent masked inputs")

    def unmask_request(self, client: int) -> dict:
        """The global view, the same for every client."""
        return {"survivors": sorted(self.masked), "dropped": sorted(set(self.holders) - set(self.masked))}

    def route_confirmations(self, signatures: dict[int, bytes]) -> dict[int, dict[int, bytes]]:
        """Each survivor's signature of the view, to each of its neighbours."""
        out = {receiver: {j: signatures[j] for j in self.neighbours[receiver] if j in signatures and j != receiver}
               for receiver in signatures}
        self.bytes_in += 64 * len(signatures)
        self.bytes_out += sum(64 * len(v) for v in out.values())
        return out

    def _secret(self, dealer: int, part: str, answers: dict[int, dict]) -> bytes:
        """One client's b or s from the shares its holders sent, each checked against the
        dealer's commitment (a holder that sent another share is named, and its share set
        aside, as is a share from a holder the dealer did not deal to). Fewer than t good shares
        abandon the round. The secret rebuilt is checked against the dealer's signed dealing (b's
        digest, s's public key): another one is the dealer's doing, recorded with its evidence
        (`_blame`), and `finish` abandons the round."""
        good = self._good_shares(dealer, part, answers)
        self._enough(len(good), f"sent a good share of client {dealer}'s {'self mask' if part == 'b' else 'key'}")
        chosen = {h: good[h] for h in sorted(good)[:self.threshold]}
        secret = combine_secret(chosen, self.holders[dealer], self.threshold)
        committed = self.dealings[dealer][1] if part == "b" else bytes(self.keys[dealer]["s"])
        if _rebuilt_mismatch(part, secret, self.round_id, dealer, committed):
            self._blame(dealer, part, chosen)
        return secret

    def _good_shares(self, dealer: int, part: str, answers: dict[int, dict]) -> dict[int, bytes]:
        """The shares of `dealer`'s b or s its holders sent that match its commitments; a holder
        that sent another share, or one it was not dealt, is named."""
        good, dealt_to = {}, set(self.holders.get(dealer, ()))
        for holder, answer in answers.items():
            if dealer not in answer[part]:
                continue
            if holder not in dealt_to:  # a commitment the dealer made outside the holders it listed
                self.culprits[holder] = f"sent a share of client {dealer}'s {part} it was not dealt"
                continue
            commit = self.commits.get(dealer, {}).get(holder, b"")
            expected = commit[:32] if part == "b" else commit[32:64]
            if _commitment(self.round_id, dealer, holder, part, answer[part][dealer]) == expected:
                good[holder] = answer[part][dealer]
            else:
                self.culprits[holder] = f"sent a share of client {dealer}'s {part} other than the one committed to"
        return good

    def _blame(self, dealer: int, part: str, chosen: dict[int, bytes]) -> None:
        """`dealer`'s t committed shares rebuild a secret other than the one its dealing signed:
        named in `culprits`, with the evidence `verify_blame` checks (the round is then abandoned
        by `finish`: its mask cannot be removed)."""
        self.evidence[dealer] = {
            "round_id": self.round_id.hex(), "dealer": dealer, "part": part, "threshold": self.threshold,
            "holders": self.holders[dealer], "dealing": self.dealings[dealer][0].hex(),
            "seed_digest": self.dealings[dealer][1].hex(), "s_public": bytes(self.keys[dealer]["s"]).hex(),
            "shares": {str(h): v.hex() for h, v in chosen.items()},
            "commits": {str(h): self.commits[dealer][h].hex() for h in chosen}}
        self.culprits[dealer] = (f"dealt shares of its {'self mask' if part == 'b' else 'key'} that rebuild a "
                                 f"secret other than the one it signed (checkable evidence in "
                                 f"secure-aggregation.json)")

    def finish(self, answers: dict[int, dict]) -> np.ndarray:
        """The sum of the survivors' vectors, from the unmask answers of at least t survivors."""
        self._enough(len(answers), "answered the unmask request")
        total = np.zeros(self.length, dtype=np.uint64)
        for vector in self.masked.values():
            total += vector
        for j in self.masked:  # self masks
            total -= expand_mask(self_mask_key(self._secret(j, "b", answers)), self.length)
        for d in sorted(set(self.holders) - set(self.masked)):  # pairwise masks a dropped client left
            if not any(d in a["s"] for a in answers.values()):
                continue
            private = X25519PrivateKey.from_private_bytes(self._secret(d, "s", answers))
            for j in self.masked:
                if d in self.inbox.get(j, {}) and j != d:
                    pair = _derive(private.exchange(_public(self.keys[j]["s"], "s key")),
                                   _info(self.round_id, "mask", min(j, d), max(j, d)))
                    mask = expand_mask(pair, self.length)
                    total = total - mask if pairwise_sign(j, d) > 0 else total + mask
        self.bytes_in += sum(SELF_SEED_BYTES * len(a["b"]) + SEED_BYTES * len(a["s"]) for a in answers.values())
        if self.evidence:
            raise RoundAbandoned(f"secure aggregation: clients {sorted(self.evidence)} dealt shares that rebuild "
                                 f"secrets other than those they signed; their masks cannot be removed, the round is "
                                 f"abandoned and nothing was applied", self.culprits)
        return total

    def _enough(self, count: int, what: str) -> None:
        if count < self.threshold:
            raise RoundAbandoned(f"secure aggregation: {count} clients {what}, below the threshold "
                                 f"{self.threshold}; the round is abandoned and nothing was unmasked", self.culprits)
