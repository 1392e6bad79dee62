"""SecAgg+'s primitives and the bytes its parties sign (fedsd.secure.secagg has the protocol):
the sizes of its keys, seeds and shares; `ProtocolError`; masks expanded from a seed
(AES-256-CTR), key agreement (X25519) and derivation (HKDF-SHA256), ids checked, Shamir's
sharing of a secret; what each stage's signature covers (`_advert`, `_commitment`,
`commit_root`, `_dealing_message`, `_view_message`, `identify_message`); the smallest
threshold a client accepts (`minimum_threshold`); and `verify_blame`, the check anyone holding
the roster runs on the evidence that a dealer's shares rebuild another secret than it signed.
Both sides use them: the client's (fedsd.secure.secagg.SecAggClient) and the server's
(fedsd.secure.secagg_server.SecAggServer).
"""
from __future__ import annotations

import functools
import hashlib
import threading

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from fedsd.secure import shamir
from fedsd.secure.identity import SIGNATURE_BYTES, verify

MODULUS_BITS = 64  # the vectors are uint64, summed modulo 2^64
SEED_BYTES = 32  # pairwise keys and mask keys: 256 bits
SELF_SEED_BYTES = 16  # the self-mask seed b: 128 bits, one Shamir secret (its mask key is HKDF(b), 256 bits)
NONCE = 12
SHARE_BYTES = SELF_SEED_BYTES + SEED_BYTES  # a share of b and a share of s, in one ciphertext
MAX_ID = (1 << 63) - 1


class ProtocolError(Exception):
    """A stage message this client refuses; its text says why and nothing of the data."""


# -- primitives ------------------------------------------------------------------------------
def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """`length` uint64 words of AES-256-CTR keystream under `seed` (32 bytes). Each seed masks
    one vector of one round, so the zero nonce is never reused under a key."""
    return _keystream(seed, np.empty(length + 2, dtype="<u8"), length)


def _keystream(seed: bytes, words: np.ndarray, length: int) -> np.ndarray:
    """`length` words of the keystream written into `words` (at least length + 2 long: update_into
    may ask for a block's room beyond the data); returns them."""
    encryptor = Cipher(algorithms.AES(seed), _CTR_ZERO).encryptor()
    encryptor.update_into(_zeros(8 * length), memoryview(words[:length + 2]).cast("B"))
    encryptor.finalize()
    return words[:length]


def add_mask(total: np.ndarray, seed: bytes, sign: int = 1) -> np.ndarray:
    """`total` ± expand_mask(seed), in place (modulo 2^64); returns `total`. The keystream goes
    through one buffer a thread, reused: a fresh one a mask costs its pages' first touch."""
    length = len(total)
    words = getattr(_SCRATCH, "words", None)
    if words is None or len(words) < length + 2:
        words = _SCRATCH.words = np.empty(length + 2, dtype="<u8")
    mask = _keystream(seed, words, length)
    return np.add(total, mask, out=total) if sign > 0 else np.subtract(total, mask, out=total)


_SCRATCH = threading.local()
_CTR_ZERO = modes.CTR(bytes(16))  # the zero counter block: each key masks one vector


@functools.lru_cache(maxsize=4)
def _zeros(size: int) -> bytes:
    return bytes(size)  # the plaintext a keystream is made from, one buffer a vector length


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
    return _parsed(bytes(raw))


@functools.lru_cache(maxsize=1 << 12)
def _parsed(raw: bytes) -> X25519PublicKey:
    return X25519PublicKey.from_public_bytes(raw)  # a pure function of public bytes: each neighbour's alike


def _agree(private: X25519PrivateKey, public: X25519PublicKey, what: str) -> bytes:
    try:
        return private.exchange(public)
    except ValueError:  # a low-order point: the shared secret would be all zeros
        raise ProtocolError(f"{what}: a key that agrees on no secret") from None


def _ids(values: object, what: str) -> list[int]:
    if not isinstance(values, (list, tuple)) or not set(map(type, values)) <= {int} or (
            values and not 0 <= min(values) <= max(values) <= MAX_ID):  # type(v) is int: a bool is not an id
        raise ProtocolError(f"{what}: a list of client ids (integers in [0, 2^63)) was expected")
    if len(set(values)) != len(values):
        raise ProtocolError(f"{what}: an id appears twice")
    return sorted(values)


def _info(round_id: bytes, *parts: object) -> bytes:
    return b"fedsd-secagg|" + round_id + b"|" + "|".join(map(str, parts)).encode()


def split_secret(secret: bytes, threshold: int, holders: list[int]) -> dict[int, bytes]:
    """Shamir shares of a secret, t-of-len(holders) (fedsd.secure.shamir: byte by byte over
    GF(2^8), a share as long as the secret); the holder at position k of the sorted list holds the
    share at x = k + 1."""
    shares = shamir.split(secret, threshold, len(holders))
    return {holder: shares[k] for k, holder in enumerate(holders)}


def combine_secret(shares: dict[int, bytes], holders: list[int], threshold: int) -> bytes:
    """The secret from `threshold` of its shares (holder id → share)."""
    position = {holder: k + 1 for k, holder in enumerate(holders)}
    chosen = sorted(shares)[:threshold]
    return shamir.combine([position[h] for h in chosen], [shares[h] for h in chosen])


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


MAX_EVIDENCE_HOLDERS = shamir.MAX_SHARES  # a dealing has at most as many holders as Shamir has points


def verify_blame(evidence: dict, dealer_key: bytes) -> bool:
    """Whether `evidence` (what SecAggServer.finish found) proves that its dealer's t shares of b
    or of s, each committed to in its signed dealing (every holder's commitments, `commit_root`),
    rebuild a secret other than the one that dealing names (b's digest, s's public key). Anyone
    holding the roster checks it with one rebuilding of t ≤ 255 shares; a changed share,
    commitment, order, t or secret fails."""
    try:
        rid, dealer, part = bytes.fromhex(evidence["round_id"]), int(evidence["dealer"]), evidence["part"]
        holders, t = [int(h) for h in evidence["holders"]], int(evidence["threshold"])
        committed = {"b": bytes.fromhex(evidence["seed_digest"]), "s": bytes.fromhex(evidence["s_public"])}
        size = {"b": SELF_SEED_BYTES, "s": SEED_BYTES}.get(part)
        # both 32 bytes: the dealing signs them side by side, and a split moved by one byte would
        # still verify (a review playing the attacker framed an honest dealer so)
        if any(len(v) != 32 for v in committed.values()):
            return False
        if size is None or not len(holders) <= MAX_EVIDENCE_HOLDERS or len(set(holders)) != len(holders) or \
                not minimum_threshold(len(holders)) <= t <= len(holders) or len(evidence["shares"]) != t:
            return False
        pairs = [bytes.fromhex(evidence["commits"][str(h)]) for h in holders]
        root = commit_root(rid, dealer, b"".join(pairs))
        signed = _dealing_message(rid, dealer, holders, t, committed["b"], committed["s"], root)
        if any(len(pair) != 64 for pair in pairs) or not verify(dealer_key, bytes.fromhex(evidence["dealing"]), signed):
            return False
        shares = {}
        for holder, share in evidence["shares"].items():
            holder, share = int(holder), bytes.fromhex(share)
            if holder not in holders or len(share) != size:
                return False
            commit = pairs[holders.index(holder)]
            if _commitment(rid, dealer, holder, part, share) != (commit[:32] if part == "b" else commit[32:]):
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


# -- what the parties sign -----------------------------------------------------------------
def _advert(round_id: bytes, member: int, cohort: list[int] | bytes, threshold: int, c: bytes, s: bytes, v: bytes,
            context: bytes = b"", graph: bytes = b"") -> bytes:
    """What a client signs at stage 0: its keys for this round, its id, the cohort (or its
    `cohort_digest`) and the threshold it was told, the digest of the round's settings it was
    given (`context`) and, on a ring, the graph's round-wide numbers (`graph_tag`), so that two
    clients told two cohorts, thresholds, graphs or settings (a noise plan) refuse."""
    digest = bytes(cohort) if isinstance(cohort, (bytes, bytearray)) else cohort_digest(cohort)
    return _info(round_id, "advertise", member, threshold) + b"|" + digest + bytes(c) + bytes(s) + bytes(v) + \
        b"|" + bytes(context) + b"|" + bytes(graph)


def graph_tag(degree: int, honest: int, colluders: int) -> bytes:
    """The ring's round-wide numbers every advert on it signs: k, t and F (the threshold is
    signed beside them); empty for the complete graph."""
    return b"ring|%d|%d|%d" % (degree, honest, colluders)


def masked_with_message(round_id: bytes, member: int, masked_with: list[int]) -> bytes:
    """What an owner on a ring signs with its masked input: the neighbours it masked with, M, in
    order (docs/design/sparse-secure-aggregation.md, fix (i)); a holder not in M reveals no share
    of its self mask."""
    return _info(round_id, "masked-with", member) + b"|" + packed_ids(masked_with)


def packed_ids(ids: list[int]) -> bytes:
    """Ids as signatures cover them: 8 bytes each, big-endian, in the order given (ids checked
    by `_ids`, or made here)."""
    return np.asarray(ids, dtype=">u8").tobytes()


def _commitment(round_id: bytes, dealer: int, holder: int, what: str, share: bytes) -> bytes:
    """A dealer's commitment to one share (SHA-256; a share has 256 bits of entropy to the
    server, which sees fewer than t of them in the clear)."""
    return hashlib.sha256(_info(round_id, "commit", what, dealer, holder) + bytes(share)).digest()


def commitments(round_id: bytes, dealer: int, holder: int, share: bytes) -> bytes:
    """A holder's 64 bytes of its dealer's commitments: to its share of b, then to its share of s
    (`share`: the two side by side, as dealt)."""
    tail = f"|{dealer}|{holder}".encode()
    prefix = b"fedsd-secagg|" + round_id + b"|commit|"
    return hashlib.sha256(prefix + b"b" + tail + share[:SELF_SEED_BYTES]).digest() + \
        hashlib.sha256(prefix + b"s" + tail + share[SELF_SEED_BYTES:]).digest()


def commit_root(round_id: bytes, dealer: int, pairs: bytes) -> bytes:
    """SHA-256 of a dealer's commitments, each holder's (b's, s's) 64 bytes in holder order: what
    its one signed dealing covers (one signature a dealer, not one a holder)."""
    return hashlib.sha256(_info(round_id, "commit-root", dealer) + b"|" + bytes(pairs)).digest()


def pack_dealing(digest: bytes, dealing: bytes, holders: list[int], pairs: dict[int, bytes]) -> bytes:
    """What a holder is given of a dealer's dealing, one blob: b's digest, the signature, and every
    holder's id and commitments in order (`unpack_dealing`)."""
    rows = np.zeros((len(holders), 72), dtype=np.uint8)
    rows[:, :8] = np.frombuffer(packed_ids(holders), dtype=np.uint8).reshape(-1, 8)
    rows[:, 8:] = np.frombuffer(b"".join(bytes(pairs[h]) for h in holders), dtype=np.uint8).reshape(-1, 64)
    return bytes(digest) + bytes(dealing) + rows.tobytes()


def unpack_dealing(blob: object) -> tuple[bytes, bytes, list[int], bytes]:
    """A dealing blob's b digest, signature, holders and their commitments (64 bytes each, in
    order); ProtocolError where it is not one."""
    head = 32 + SIGNATURE_BYTES
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < head + 72 or (len(blob) - head) % 72 or \
            (len(blob) - head) // 72 > MAX_EVIDENCE_HOLDERS:
        raise ProtocolError("a dealing: its digest, signature and holders' commitments were expected")
    rows = np.frombuffer(bytes(blob), dtype=np.uint8, offset=head).reshape(-1, 72)
    ids = rows[:, :8].copy().view(">u8").ravel()
    if np.any(ids > MAX_ID) or np.any(np.diff(ids.astype(np.int64)) <= 0):
        raise ProtocolError("a dealing: its holders are distinct ids in order")
    return bytes(blob[:32]), bytes(blob[32:head]), ids.tolist(), rows[:, 8:].tobytes()


@functools.lru_cache(maxsize=1 << 12)
def signed_dealing(round_id: bytes, dealer: int, threshold: int, s_public: bytes, key: bytes,
                   blob: bytes) -> dict[int, bytes] | None:
    """Each holder's 64 bytes of commitments in a dealing blob (`pack_dealing`) that `key` signed
    for this round, dealer, threshold and s key; None where the signature fails, ProtocolError
    where the blob is malformed. A pure function of public bytes, memoised: a dealer's blob reaches
    each of its holders alike (callers must not change the map)."""
    digest, signature, holders, pairs = unpack_dealing(blob)
    if not verify(key, signature, _dealing_message(round_id, dealer, holders, threshold, digest, s_public,
                                                   commit_root(round_id, dealer, pairs))):
        return None
    return {h: pairs[64 * k:64 * k + 64] for k, h in enumerate(holders)}


def _dealing_message(round_id: bytes, dealer: int, holders: list[int], threshold: int, b_digest: bytes,
                     s_public: bytes, root: bytes = b"") -> bytes:
    """What a dealer signs of its dealing (fedsd's addition to stage 1): who holds its shares, in
    the order that gives each its x (position + 1), t, its self-mask seed's digest and its s key's
    public half. With its signed commitments, t shares that rebuild another secret are evidence
    anyone with the roster can check (`verify_blame`); the server cannot frame an honest dealer by
    listing its holders in another order. Both digests are 32 bytes (ValueError otherwise)."""
    if len(b_digest) != 32 or len(s_public) != 32:
        raise ValueError("_dealing_message: a seed digest and an s key are 32 bytes each")
    return _info(round_id, "dealing", dealer, threshold, len(holders)) + b"|" + packed_ids(holders) + \
        bytes(b_digest) + bytes(s_public) + bytes(root)


def _view_message(round_id: bytes, survivors: list[int], dropped: list[int]) -> bytes:
    """A view: the survivors' and dropped clients' ids, 8 bytes each, in order."""
    return _info(round_id, "view", len(survivors), len(dropped)) + b"|" + packed_ids(list(survivors) + list(dropped))


def minimum_threshold(holders: int) -> int:
    """The smallest threshold a client accepts: more than two thirds of the share holders
    (Bonawitz et al.'s bound for a server that deviates from the protocol, with up to a third
    of the clients its own), and at least 2."""
    return max(2, (2 * holders) // 3 + 1) if holders > 1 else 1


def lowest_threshold(holders: int, colluders: int) -> int:
    """The smallest threshold an owner that allows `colluders` of the server's accepts: above
    `minimum_threshold`, and above (holders + colluders) / 2, so that only one view of a round
    can reach it (SecAggClient.advertise's checks)."""
    return max(minimum_threshold(holders), (holders + colluders) // 2 + 1)


def check_threshold(holders: int, threshold: object, min_cohort: int, max_colluders: int) -> None:
    """An owner's checks of the holders of its shares and their threshold, before anything is
    drawn or charged (SecAggClient.advertise, and a multi-round run's setup): the owner's t
    honest clients with its f of the server's must fit, the threshold must be above two thirds of
    the holders and above (holders + f) / 2 (one view a round), and at most holders − f (f silent
    members cannot abandon a paid round). ProtocolError says which failed."""
    if holders < min_cohort + max_colluders:  # it could never unmask: refused before any cost
        raise ProtocolError(f"neighbours: {holders} clients, below the {min_cohort} honest ones "
                            f"and {max_colluders} of the server's this owner requires")
    if not isinstance(threshold, int) or isinstance(threshold, bool) or not (
            minimum_threshold(holders) <= threshold <= holders):
        raise ProtocolError(f"threshold: must be in [{minimum_threshold(holders)}, {holders}] "
                            f"for {holders} neighbours (more than two thirds of them)")
    if 2 * threshold <= holders + max_colluders:
        # Two stories: the server's f clients confirm both, and two groups of honest ones each
        # reach t unless 2t > neighbours + f.
        raise ProtocolError(f"threshold: {threshold} is at or below ({holders} neighbours + "
                            f"{max_colluders} of the server's) / 2; two views of the round could both "
                            f"reach it")
    if threshold > holders - max_colluders:
        # f silent members at the unmask would abandon a round this client has paid for.
        raise ProtocolError(f"threshold: {threshold} is above {holders} neighbours − {max_colluders} "
                            f"of the server's, who could abandon the round after this owner is charged "
                            f"(an owner that allows f needs more than 3f neighbours)")
    if holders - max_colluders < min_cohort + max_colluders:
        # It unmasks only with t + f neighbours: f silent members would leave fewer, after the charge.
        raise ProtocolError(f"neighbours: {holders}, below this owner's {min_cohort} honest ones and "
                            f"twice {max_colluders} of the server's: that many silent after the masked input "
                            f"would leave fewer than it unmasks with, after this owner is charged")


# -- a multi-round run's messages (fedsd.secure.secagg_runs; docs/design/multi-round-secure-aggregation.md) --
def run_tag(first_round_id: bytes, epoch: int = 1) -> bytes:
    """τ: what binds every signature, AAD and key derivation of a multi-round run (its first
    round's id, and the setup epoch) and keeps them apart from the per-round protocol's."""
    return b"fedsd-secagg-mr|" + bytes(first_round_id) + b"|" + str(int(epoch)).encode()


def round_tag(tau: bytes, round_number: int) -> bytes:
    """rid_r: round r of the run τ."""
    return bytes(tau) + b"|round|" + str(int(round_number)).encode()


def cohort_digest(members) -> bytes:
    """SHA-256 of a cohort: its sorted ids, each 8 bytes big-endian (never a printed list)."""
    return hashlib.sha256(b"fedsd-secagg-mr|cohort|" + packed_ids(sorted(members))).digest()


def round_digest(settings: bytes, arrays=(), plan: bytes = b"") -> bytes:
    """What every receipt of a round binds beside its cohort: the digest of the round's settings,
    the model's arrays (dtype, shape and bytes, in order) and the plan, so that owners sent
    different models or plans sign receipts no holder unmasks together (Pasquini et al., CCS 2022)."""
    h = hashlib.sha256(b"fedsd-secagg-mr|round|" + len(settings).to_bytes(4, "big") + bytes(settings))
    for array in arrays:
        array = np.ascontiguousarray(array)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(array.tobytes())
    h.update(b"|plan|" + bytes(plan))
    return h.digest()


def receipt_message(rid: bytes, member: int, cohort_hash: bytes, round_hash: bytes, needed: int,
                    y_hash: bytes) -> bytes:
    """What an owner signs with its masked input: the round, itself, the cohort and the round's
    digest it masked for, the fewest inputs it lets be summed (its t + f), and SHA-256 of y. The
    three digests are 32 bytes each (ValueError otherwise): with fields of any length, a server
    could move one digest's bytes into the next and keep the signature (a review playing the
    attacker opened owners sent different models together so)."""
    if not all(isinstance(d, (bytes, bytearray)) and len(d) == 32 for d in (cohort_hash, round_hash, y_hash)):
        raise ValueError("receipt_message: the cohort's, the round's and y's digests are 32 bytes each")
    return _info(rid, "receipt", member, needed) + b"|" + bytes(cohort_hash) + bytes(round_hash) + bytes(y_hash)


def channel_message(tau: bytes, member: int, batch: int, key: bytes) -> bytes:
    """What an owner signs of its X25519 channel key for one batch of dealt rounds."""
    return _info(tau, "channel", member, batch) + b"|" + bytes(key)


def commit_list_hash(tau: bytes, dealer: int, holder: int, batch: int, commits: bytes) -> bytes:
    return hashlib.sha256(_info(tau, "commit-list", dealer, holder, batch) + b"|" + bytes(commits)).digest()


def batch_root(tau: bytes, dealer: int, batch: int, list_hashes: list[bytes], entries: bytes) -> bytes:
    """One digest of a dealer's batch: every holder's commitment list's hash, in holder order, and
    its dealing entries (`entries_digest`), so that a holder's acknowledgement covers the s keys and
    seed digests every owner masks with (without them a dealer could give two halves of the holders
    two entries for one round under one acknowledged root, and spoil a paid round unnamed)."""
    return hashlib.sha256(_info(tau, "batch-root", dealer, batch) + b"|" + b"".join(list_hashes) +
                          bytes(entries)).digest()


def entries_digest(tau: bytes, dealer: int, entries: list[tuple[int, bytes, bytes]]) -> bytes:
    """SHA-256 of a dealer's entries of a batch, (round, b's digest, s's public half) in round order,
    each digest and key 32 bytes."""
    h = hashlib.sha256(_info(tau, "entries", dealer))
    for r, digest, public in entries:
        if len(digest) != 32 or len(public) != 32:
            raise ValueError("entries_digest: a seed digest and an s key are 32 bytes each")
        h.update(int(r).to_bytes(8, "big") + bytes(digest) + bytes(public))
    return h.digest()


def batch_message(tau: bytes, dealer: int, batch: int, root: bytes) -> bytes:
    return _info(tau, "batch", dealer, batch) + b"|" + bytes(root)


def held_message(tau: bytes, holder: int, dealer: int, batch: int, root: bytes) -> bytes:
    """A holder's acknowledgement: it holds, checked against their commitments, its shares of the
    dealer's batch with this root."""
    return _info(tau, "held", holder, dealer, batch) + b"|" + bytes(root)
