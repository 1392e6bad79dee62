"""Secure aggregation: SecAgg+ (Bell, Bonawitz, Gascón, Lepoint & Raykova, CCS 2020), the server
learning only the sum of the clients' vectors, modulo 2^64, in Bonawitz et al.'s (CCS 2017)
malicious-server form: each client signs with a long-term Ed25519 key its neighbours know from
the owners' roster (fedsd.secure.identity). SecAgg+ shares with a neighbourhood only; the complete
graph is the 2017 protocol, and the ring (fedsd.secure.ring) neighbourhoods every owner derives
from the round and cohort (docs/design/sparse-secure-aggregation.md). The stages, as the papers
number their rounds:

  0. Advertise keys (`SecAggClient.advertise`): the client checks the cohort (every member on
     its roster), its neighbourhood and the threshold (more than two thirds of the neighbours,
     and more than (neighbours + F)/2, so two stories cannot both reach it); makes two X25519 key
     pairs, c for encrypting its shares and s for its pairwise masks; sends the public halves
     with its identity key, signed over the round, its id, the cohort, the threshold and the
     digest of the round's settings (with distributed noise, the plan every share is sized by),
     which every neighbour checks against its own at stage 1: a round whose clients were given
     different settings stops there, before anything is drawn or charged. (Bonawitz et al. bind
     the round's identity into each signature; the settings' digest is fedsd's addition.) On the
     ring (`_ring`): its numbers (k, t, F) signed too, each at least the owner's, the threshold at
     least t + F, and the neighbourhood the one this owner derives.
  1. Share keys (`share_keys`): given its neighbours' signed keys, it checks every signature
     against the signer's roster key, every key's encoding, and computes every agreement (a
     low-order key is refused here, before anything is drawn or charged); then draws its
     self-mask seed b (16 bytes from the operating system), splits b and its secret s key t-of-k
     with Shamir's scheme, and sends each neighbour its two shares, encrypted with AES-GCM under
     a key HKDF derives from X25519(c_i, c_j), bound to the round and to both ids, with a
     commitment (SHA-256) to each share, and signs its dealing once: its holders in order, t, b's
     SHA-256, its s key's public half and the digest of every holder's commitments (fedsd's
     addition: t shares that rebuild another secret are then evidence against their dealer,
     `verify_blame`).
  2. Masked input (`masked_input`): given the ciphertexts and commitments addressed to it, it
     checks each share against its dealer's commitment and sends y = x + PRG(HKDF(b)) +
     Σ_j ±PRG(s_ij) mod 2^64 over the neighbours j that sent it shares; s_ij = HKDF(X25519(s_i,
     s_j)), the sign by id (the lower id adds). On the ring it signs M, the neighbours it masked
     with (`masked_set`).
  3. Consistency check (`confirm`; Bonawitz et al.'s round 3): given the round's survivors (who
     sent a masked input) and dropped clients, the same lists for every client, it checks them
     and signs that one view.
  4. Unmask (`unmask`): given its neighbours' signatures, once at least the threshold of them
     (and its owner's t + f) signed the view it signed, it reveals its share of b for each
     survivor (on the ring, only where the survivor's signed M names it) and its share of s for
     each dropped neighbour: never both for one client, nor a second answer in a round. Without
     the consistency check a server could tell two groups two stories and collect both shares of
     one client (tests/secure/test_secagg_hostile_server.py).

This module holds the client's side (`SecAggClient`); the server's side (`SecAggServer`) is
fedsd.secure.secagg_server, and the primitives both use, with the bytes each stage signs, are
fedsd.secure.secagg_primitives.

The server (`SecAggServer`) routes the messages, checks every share it is given against its
dealer's commitment (a holder that sent another is named in `culprits`), and at the end rebuilds
each survivor's b and each dropped client's s from t good shares, removes the self masks and the
pairwise masks that dropped clients left, and has the sum. Fewer than t at any stage: the round
is abandoned before anything is unmasked.

Primitives, none written here: X25519, Ed25519, HKDF-SHA256, AES-GCM and AES-256-CTR from
`cryptography`; Shamir byte by byte over GF(2^8), vectorised (fedsd.secure.shamir). Masks are
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

import secrets
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedsd.secure.identity import Identity, Roster, verify
from fedsd.secure.ring import neighbourhood, ring_order, sparse_threshold
from fedsd.secure.secagg_primitives import (NONCE, SELF_SEED_BYTES, SHARE_BYTES, ProtocolError, _advert,
                                            _dealing_message, _derive, _ids, _info, _public, _raw, _view_message,
                                            add_mask, check_threshold, cohort_digest, commit_root, commitments,
                                            graph_tag, masked_with_message, pairwise_sign, seed_digest,
                                            self_mask_key, signed_dealing, split_secret)

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
    _raws: dict = field(default_factory=dict)  # neighbour → its c and s public keys' bytes
    _masked_with: list[int] = field(default_factory=list)
    _view: tuple = ((), ())
    _statement: bytes = b""
    context: bytes = b""  # the digest of the round's settings this client was advertised (advertise)
    degree: int = 0  # k on a ring (fedsd.secure.ring); 0: the complete graph
    _graph: bytes = b""  # the ring's round-wide numbers its adverts sign (graph_tag); empty: the complete graph
    _cohort: bytes = b""  # the cohort's digest, signed in every advert
    _masked_sig: bytes = b""  # on a ring: my signature of the neighbours I masked with (masked_set)
    # One process holding every client (fedsd.secure.distributed_step.secure_round): each pair's
    # agreement computed once, by whichever end comes first, for both. None in an owner's service.
    agreements: dict | None = field(default=None, repr=False)

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
        outside = sorted(set(holders) - set(self.neighbours))
        if outside:
            raise ProtocolError(f"{stage}: {what} outside this client's neighbourhood (culprit: {outside[0]})")
        if self.me not in holders:
            raise ProtocolError(f"{stage}: {what} without this client")
        if len(holders) < self.needed:
            raise ProtocolError(f"{stage}: {len(holders)} clients {went_on}, below the threshold")
        return holders

    def advertise(self, cohort: object, neighbours: object, threshold: object, context: bytes = b"",
                  graph: object = None) -> dict:
        """Stage 0: the round's cohort, my neighbourhood (me included) and the threshold t; my
        two public keys, my signing key and my signature of them with the round, the cohort and
        `context`, the digest of the round's settings (fedsd.app.secure_sum.settings_digest): a
        neighbour given other settings (another noise plan) does not verify at share-keys.
        `graph`: None for the complete graph, else the ring's round-wide numbers {"k", "honest",
        "colluders"} (`_ring`'s checks), signed in the advert."""
        self._expect(0, "advertise-keys")
        if not isinstance(context, (bytes, bytearray)) or len(context) > 64:
            raise ProtocolError("advertise: the settings' digest is at most 64 bytes")
        cohort, neighbours = _ids(cohort, "cohort"), _ids(neighbours, "neighbours")
        if self.me not in neighbours or not set(neighbours) <= set(cohort):
            raise ProtocolError("neighbours: must hold this client and lie in the cohort")
        if len(neighbours) > self.max_neighbours:
            raise ProtocolError(f"neighbours: {len(neighbours)}, above the {self.max_neighbours} "
                                f"this owner shares with")
        if len(cohort) < self.min_cohort:
            raise ProtocolError(f"cohort: {len(cohort)} clients, below the {self.min_cohort} this owner requires")
        if self.roster is not None:
            strangers = sorted(set(cohort) - self.roster.by_id.keys())
            if strangers:
                raise ProtocolError(f"cohort: {', '.join(self.name(j) for j in strangers[:4])} not on this owner's "
                                    f"roster (culprit: {strangers[0]})")
        if graph is not None:
            self._ring(cohort, neighbours, threshold, graph)
        elif self.roster is not None and neighbours != cohort:
            # A neighbourhood is the server's to choose, and no signature covers it: with uneven
            # ones, shares of one client's b and of its partners' s come from different groups,
            # each story reaching its own threshold (a review playing the attacker unmasked one
            # owner so). With a roster, the complete graph: every neighbourhood is the cohort.
            raise ProtocolError("neighbours: with a roster, every member of the cohort (the complete graph); "
                                "a neighbourhood the server chooses could split the round into two stories")
        else:
            check_threshold(len(neighbours), threshold, self.min_cohort, self.max_colluders)
        self.cohort, self.neighbours, self.threshold, self.context = cohort, neighbours, threshold, bytes(context)
        self._cohort = cohort_digest(cohort)
        self._c, self._s = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        c, s, v = _raw(self._c.public_key()), _raw(self._s.public_key()), self.identity.public
        return {"c": c, "s": s, "v": v, "sig": self.identity.sign(_advert(self.round_id, self.me, self._cohort,
                                                                            threshold, c, s, v, self.context,
                                                                            self._graph))}

    def _ring(self, cohort: list[int], neighbours: list[int], threshold: object, graph: object) -> None:
        """A ring's numbers, before anything is drawn (docs/design/sparse-secure-aggregation.md §3):
        k even, its neighbourhood below the cohort and at most `max_neighbours`; the round's t and F
        at least this owner's; the threshold at least t + F and above (k + 1 + F) / 2 and two thirds
        of k + 1 (`sparse_threshold`), at most k + 1 − F (`check_threshold`); and the neighbourhood
        the server named the one this owner derives from the round and cohort (`fedsd.secure.ring`)."""
        if not isinstance(graph, dict) or set(graph) != {"k", "honest", "colluders"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20 for v in graph.values()):
            raise ProtocolError("graph: a ring's k, honest and colluders, integers, were expected")
        k, honest, colluders = graph["k"], graph["honest"], graph["colluders"]
        if k < 2 or k % 2 or k + 1 >= len(cohort) or k + 1 > self.max_neighbours:
            raise ProtocolError(f"graph: k = {k}; a ring's k is even, its neighbourhood of k + 1 below the cohort of "
                                f"{len(cohort)} and at most the {self.max_neighbours} this owner shares with")
        if honest < self.min_cohort or colluders < self.max_colluders:
            raise ProtocolError(f"graph: t = {honest} and F = {colluders}; this owner requires at least "
                                f"t = {self.min_cohort} and F = {self.max_colluders}")
        least = sparse_threshold(k, colluders, honest)
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < least:
            raise ProtocolError(f"threshold: {threshold!r}, below the {least} a ring of k = {k} needs with t = "
                                f"{honest} and F = {colluders} (t + F, and above (k + 1 + F) / 2)")
        check_threshold(k + 1, threshold, honest, colluders)
        # only its own neighbourhood: every member's would cost O(n·k) for a cohort the server names
        if neighbours != neighbourhood(ring_order(self.round_id, cohort, k), self.me, k):
            raise ProtocolError("neighbours: not this client's neighbourhood on the round's ring (every owner derives "
                                "it from the round and cohort; a neighbourhood the server chooses is refused)")
        self.degree, self._graph = k, graph_tag(k, honest, colluders)

    def _checked_keys(self, keys: dict, holders: list[int]) -> dict[int, tuple]:
        """Every neighbour's keys, before anything is drawn or charged: signed by the neighbour
        (its roster key, where the owner has a roster) for this round, cohort and threshold,
        canonical, distinct, and each agreeing on a secret with ours. A failure names the
        neighbour."""
        parsed = {}
        for j in holders:
            entry = keys[j] if isinstance(keys[j], dict) else {}
            c, s = (self._neighbour_key(entry.get(part), part, j) for part in "cs")
            v = entry.get("v")
            if not isinstance(v, (bytes, bytearray)) or len(v) != 32:
                raise ProtocolError(f"share-keys: {self.name(j)} sent no signing key (culprit: {j})")
            if self.roster is not None and self.roster.key(j) != bytes(v):
                raise ProtocolError(f"share-keys: the signing key given for {self.name(j)} is not its roster key "
                                    f"(culprit: {j})")
            if not verify(bytes(v), entry.get("sig"), _advert(self.round_id, j, self._cohort, self.threshold,
                                                               entry["c"], entry["s"], bytes(v), self.context,
                                                               self._graph)):
                raise ProtocolError(f"share-keys: the keys of {self.name(j)} are not signed by it for this round, "
                                    f"cohort, threshold, graph and settings (culprit: {j}; given other settings, or "
                                    f"not its keys)")
            parsed[j] = (c, s, bytes(v))
            self._raws[j] = (bytes(entry["c"]), bytes(entry["s"]))
        raws = [k for j in parsed for k in self._raws[j]] + [v for _, _, v in parsed.values()]
        if len(set(raws)) != len(raws):
            raise ProtocolError("share-keys: two clients advertised the same key")
        return parsed

    def _neighbour_key(self, raw: object, part: str, j: int):
        """Neighbour j's c or s public key, parsed; a refusal names it (built only when refused)."""
        try:
            return _public(raw, "")
        except ProtocolError:  # again, to be refused with the neighbour named
            return _public(raw, f"{self.name(j)}'s {part} key (culprit: {j})")

    def _agreement(self, kind: str, j: int, private: X25519PrivateKey, public) -> bytes:
        """The key HKDF derives from X25519(mine, j's) for this round and pair. With `agreements` (one
        process holding both ends: a simulation), the end that comes second finds it there."""
        which = 0 if kind == "enc" else 1
        mine, theirs = self._raws[self.me][which], self._raws[j][which]
        slot = (kind, mine, theirs) if mine < theirs else (kind, theirs, mine)
        if self.agreements is not None and slot in self.agreements:
            return self.agreements[slot]
        try:
            secret = private.exchange(public)
        except ValueError:  # a low-order point: the shared secret would be all zeros
            raise ProtocolError(f"{self.name(j)}'s {'cs'[which]} key (culprit: {j}): a key that agrees on no "
                                f"secret") from None
        key = _derive(secret, _info(self.round_id, kind, min(self.me, j), max(self.me, j)))
        if self.agreements is not None:
            self.agreements[slot] = key
        return key

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
            enc[j] = self._agreement("enc", j, self._c, parsed[j][0])
            if j != self.me:
                pairs[j] = self._agreement("mask", j, self._s, parsed[j][1])
        self._keys, self._enc, self._pairs, self.neighbours = parsed, enc, pairs, holders
        self._b = secrets.token_bytes(SELF_SEED_BYTES)
        # b and s in one sharing: Shamir's is byte by byte, so each share is b's share then s's
        both = split_secret(self._b + self._s.private_bytes_raw(), self.threshold, holders)
        out, commits = {}, {}
        for j in holders:
            nonce = secrets.token_bytes(NONCE)
            out[j] = nonce + AESGCM(enc[j]).encrypt(nonce, both[j], _info(self.round_id, "share", self.me, j))
            commits[j] = commitments(self.round_id, self.me, j, both[j])
        digest = seed_digest(self.round_id, self.me, self._b)
        root = commit_root(self.round_id, self.me, b"".join(commits[j] for j in holders))
        dealing = self.identity.sign(_dealing_message(self.round_id, self.me, holders, self.threshold, digest,
                                                      _raw(self._s.public_key()), root))
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
        masked = add_mask(vector.copy(), self_mask_key(self._b))
        for j in senders:
            if j != self.me:
                add_mask(masked, self._pairs[j], pairwise_sign(self.me, j))
        self._masked_with = senders
        if self.degree:  # on a ring, M signed: a holder outside it reveals no share of my b (fix (i))
            self._masked_sig = self.identity.sign(masked_with_message(self.round_id, self.me, senders))
        return masked

    def masked_set(self) -> dict:
        """On a ring, after masked_input: the neighbours I masked with and my signature of them, which
        the server relays to my neighbours with the view (unmask's `masked_sets`)."""
        return {"with": list(self._masked_with), "sig": self._masked_sig}

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
        def who() -> str:  # named only when refused (a round opens k shares)
            return f"{self.name(sender)} (culprit: {sender})"

        if not isinstance(ciphertext, (bytes, bytearray)) or len(ciphertext) != NONCE + SHARE_BYTES + 16:
            raise ProtocolError(f"masked-input: the share from {who()} is malformed")
        try:
            plain = AESGCM(self._enc[sender]).decrypt(bytes(ciphertext[:NONCE]), bytes(ciphertext[NONCE:]),
                                                      _info(self.round_id, "share", sender, self.me))
        except InvalidTag:
            raise ProtocolError(f"masked-input: the share from {who()} is not for this round and client, or was "
                                f"changed") from None
        b, s = plain[:SELF_SEED_BYTES], plain[SELF_SEED_BYTES:]
        try:
            if not isinstance(commit, (bytes, bytearray)):
                raise ProtocolError("not bytes")
            pairs = signed_dealing(self.round_id, sender, self.threshold, self._raws[sender][1],
                                   self._keys[sender][2], bytes(commit))
        except ProtocolError:
            raise ProtocolError(f"masked-input: the dealing of {who()} is malformed") from None
        if pairs is None or self.me not in pairs:
            raise ProtocolError(f"masked-input: the commitments to the shares of {who()} are not in a dealing it "
                                f"signed for this client, round and threshold")
        mine = pairs[self.me]
        if mine != commitments(self.round_id, sender, self.me, plain):
            raise ProtocolError(f"masked-input: the share from {who()} is not the one it committed to")
        return b, s

    def confirm(self, survivors: object, dropped: object) -> bytes:
        """Stage 3 (consistency, Bonawitz et al.'s round 3): the round's global survivor and
        dropped lists; my signature of that view. I sign one view only, and reveal nothing yet."""
        self._expect(3, "confirm")
        survivors, dropped = _ids(survivors, "survivors"), _ids(dropped, "dropped")
        alive, gone, mine = set(survivors), set(dropped), set(self._masked_with)
        if not alive | gone <= set(self.cohort):
            raise ProtocolError("unmask: survivors or dropped clients outside the cohort this client accepted")
        if alive & gone:
            raise ProtocolError("unmask: a client named both a survivor and dropped (that would reveal its input)")
        if self.me not in alive or not mine <= alive | gone:
            raise ProtocolError("unmask: this client not a survivor, or a neighbour it masked with left unnamed")
        local = sorted(mine & alive)
        if len(local) < self.needed:  # survivors it can check (its neighbours' signatures), never a list's length
            raise ProtocolError(f"unmask: {len(local)} survivors among its neighbours, below the threshold and "
                                f"the owner's {self.min_cohort} + {self.max_colluders}")
        if len(survivors) < self.min_cohort + self.max_colluders:
            raise ProtocolError(f"unmask: {len(survivors)} survivors; this owner needs {self.min_cohort} honest ones "
                                f"with up to {self.max_colluders} of the server's among them")
        self._view = (survivors, dropped)
        self._statement = _view_message(self.round_id, survivors, dropped)
        return self.identity.sign(self._statement)

    def unmask(self, confirmations: object, masked_sets: object = None) -> dict[str, dict[int, bytes]]:
        """Stage 4: my neighbours' signatures of the view (signer → signature); my shares of the
        survivors' b and of the dropped clients' s, once at least `needed` of my surviving
        neighbours (me included) signed the view I signed. Never both for one client. On a ring,
        `masked_sets` (survivor → its `masked_set`): a survivor's b only where its signed M names me."""
        self._expect(4, "unmask")
        survivors, dropped = self._view
        if not isinstance(confirmations, dict):
            raise ProtocolError("unmask: a map of client id to signature was expected")
        local = sorted(set(self._masked_with) & set(survivors))
        agreed = 1 + sum(1 for j in local if j != self.me
                         and verify(self._keys[j][2], confirmations.get(j), self._statement))
        if agreed < self.needed:
            self._shares, self._b = {}, b""
            raise ProtocolError(f"unmask: {agreed} neighbours signed this round's survivors, below the threshold")
        revealed = local if not self.degree else self._named_me(local, masked_sets)
        answer = {"b": {j: self._shares[j][0] for j in revealed},
                  "s": {j: self._shares[j][1] for j in sorted(set(dropped) & set(self._masked_with))}}
        self._shares, self._b = {}, b""  # nothing more to reveal from this round
        return answer

    def _named_me(self, local: list[int], masked_sets: object) -> list[int]:
        """The survivors whose M, signed by them for this round, names me (and me): the server
        gives an owner the shares of only some partners, and then a holder outside them, which
        its view never tells apart, would help rebuild its b (the review's attack C, §1)."""
        sets = masked_sets if isinstance(masked_sets, dict) else {}
        named = [self.me]
        for j in local:
            entry = sets.get(j)
            if j == self.me or not isinstance(entry, dict):
                continue
            members = entry.get("with")
            try:  # j signed its M sorted, ids of 8 bytes: any other list fails the signature
                signed = masked_with_message(self.round_id, j, members) if type(members) is list else b""
            except (TypeError, ValueError, OverflowError):
                continue
            if self.me in members and verify(self._keys[j][2], entry.get("sig"), signed):
                named.append(j)
        return sorted(named)
