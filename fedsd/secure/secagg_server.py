"""The server's side of SecAgg+ (the protocol and its stages: fedsd.secure.secagg): `SecAggServer`,
the coordinator of one round, which routes the clients' messages, checks every share it is given
against its dealer's commitment, rebuilds the survivors' self masks and the dropped clients'
keys, and has the sum; `RoundAbandoned`, what it raises when too few clients went on or their
shares did not rebuild one secret.
"""
from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedsd.secure.identity import verify
from fedsd.secure.ring import neighbourhoods
from fedsd.secure.secagg_primitives import (SEED_BYTES, SELF_SEED_BYTES, ProtocolError, _advert, _commitment,
                                            _dealing_message, _derive, _info, _public, _rebuilt_mismatch, add_mask,
                                            cohort_digest, combine_secret, commit_root, graph_tag, masked_with_message,
                                            minimum_threshold, pack_dealing, pairwise_sign, self_mask_key)


class RoundAbandoned(Exception):
    """Too few clients went on for the round to be unmasked, or their shares did not rebuild
    one secret; nothing was revealed or applied. `culprits`: client id → what it did."""

    def __init__(self, message: str, culprits: dict | None = None):
        super().__init__(message)
        self.culprits = dict(culprits or {})


class SecAggServer:
    """The coordinator of one round: it routes the clients' messages and unmasks the sum. The
    neighbourhood graph is the complete graph, or with `graph` ({"k", "honest", "colluders"},
    sent to every client and signed in its advert) the round's ring (fedsd.secure.ring: each
    member's k nearest on an order every owner derives), its threshold `threshold` (at least
    fedsd.secure.ring.sparse_threshold). `culprits` names, by id, each client that sent a share
    other than the one its dealer committed to."""

    def __init__(self, round_id: bytes, cohort: list[int], length: int, threshold: int | None = None,
                 graph: dict | None = None, signers: dict[int, bytes] | None = None):
        self.round_id, self.cohort, self.length, self.graph = round_id, sorted(cohort), length, graph
        self.signers = dict(signers or {})  # client → the signing key its adverts must carry (identify's, checked)
        self.context = b""  # the digest of the round's settings every advert signs (the deployed round's)
        self._cohort = cohort_digest(self.cohort)  # what every advert signs of the cohort
        if graph is None:
            self.neighbours = {c: self.cohort for c in self.cohort}
            size = len(self.cohort)
        else:
            self.neighbours, size = neighbourhoods(round_id, self.cohort, graph["k"]), graph["k"] + 1
        self.threshold = threshold if threshold is not None else minimum_threshold(size)
        self.masked_sets: dict[int, dict] = {}  # on a ring: survivor → its signed M (SecAggClient.masked_set)
        self.keys: dict[int, dict] = {}
        self.inbox: dict[int, dict[int, bytes]] = {}
        self.commits: dict[int, dict[int, bytes]] = {}  # dealer → holder → signed commitment
        self.masked: dict[int, np.ndarray] = {}
        self.holders: dict[int, list[int]] = {}  # who holds shares of each client's secrets
        self.dealings: dict[int, tuple[bytes, bytes]] = {}  # dealer → its signed dealing, its b's digest
        self.packed: dict[int, bytes] = {}  # dealer → its dealing as its holders are given it (pack_dealing)
        self.evidence: dict[int, dict] = {}  # dealer → proof that its shares rebuild another secret
        self.culprits: dict[int, str] = {}
        self.bytes_in = self.bytes_out = 0

    def setup(self, client: int) -> dict:
        out = {"cohort": self.cohort, "neighbours": self.neighbours[client], "threshold": self.threshold}
        return out if self.graph is None else {**out, "graph": self.graph}

    def collect_keys(self, keys: dict[int, dict]) -> None:
        """The cohort's adverts, each checked as its neighbours will (`_advert_fault`); one that would
        fail is left out and its sender named, before anyone deals: on a ring only its neighbours would
        refuse it, and the owners beyond them would pay for a round their refusals then abandon (a
        review had a member spoil rounds so, unnamed). An identity key (public: any advert's, any the
        round's clients identified with) given as a round key is its sender's fault alone; a round key
        in two adverts, which a member sees only after the round's adverts are in, leaves both out."""
        probe = X25519PrivateKey.generate()  # one agreement with each key: a low-order one agrees on no secret
        checked = {}
        for client, entry in keys.items():
            fault = self._advert_fault(client, entry, probe)
            if fault:
                self.culprits[client] = fault
            else:
                checked[client] = entry
        identities = {bytes(e["v"]) for e in checked.values()} | {bytes(v) for v in self.signers.values()}
        self.keys, owners = {}, {}
        for client, entry in checked.items():
            c, s = bytes(entry["c"]), bytes(entry["s"])
            if c == s or c in identities or s in identities:  # a review's member excluded honest owners so
                self.culprits[client] = "advertised an identity key, or one key twice, as a round key"
                continue
            self.keys[client] = entry
            for key in (c, s, bytes(entry["v"])):
                owners.setdefault(key, []).append(client)
        for shared in (clients for clients in owners.values() if len(clients) > 1):
            for client in shared:
                self.keys.pop(client, None)
                self.culprits.setdefault(client, "advertised a key another client of the round advertised too "
                                                 "(one of them copied it: both left out)")
        self.bytes_in += 160 * len(keys)
        self._enough(len(self.keys), "advertised keys")

    def _advert_fault(self, client: int, entry: object, probe: X25519PrivateKey) -> str:
        """Why `client`'s advert would be refused by its neighbours ("" if it would not): its keys
        canonical and agreeing on a secret, its signing key the one it identified with, its signature
        over this round, cohort, threshold, graph and settings."""
        if client not in self.neighbours or not isinstance(entry, dict) or not all(
                isinstance(entry.get(f), bytes) for f in ("c", "s", "v", "sig")) or len(entry["v"]) != 32:
            return "an advert without its keys and signature"
        try:
            for part in "cs":
                probe.exchange(_public(entry[part], f"its {part} key"))
        except (ProtocolError, ValueError):
            return "an advert with a key that is not a usable X25519 public key"
        if client in self.signers and self.signers[client] != entry["v"]:
            return "an advert signed with another key than the one it identified with"
        tag = graph_tag(self.graph["k"], self.graph["honest"], self.graph["colluders"]) if self.graph else b""
        if not verify(entry["v"], entry["sig"], _advert(self.round_id, client, self._cohort, self.threshold,
                                                        entry["c"], entry["s"], entry["v"], self.context, tag)):
            return "an advert not signed by it for this round, cohort, threshold, graph and settings"
        return ""

    def keys_for(self, client: int) -> dict[int, dict]:
        out = {j: self.keys[j] for j in self.neighbours[client] if j in self.keys}
        self.bytes_out += 160 * len(out)
        return out

    def collect_shares(self, shares: dict[int, dict[str, dict[int, bytes]]]) -> None:
        """Each dealer's {"shares": holder → ciphertext, "commits": holder → its 64 bytes of
        commitments, "dealing": its signature of them (`commit_root`), "digest": b's digest}."""
        self.inbox, shares = {}, dict(shares)
        for sender, dealt in list(shares.items()):
            if sender not in self.keys:  # left out at collect_keys (named there): its dealing is not relayed
                del shares[sender]
                continue
            holders = sorted(dealt["shares"])
            pairs, digest = dealt.get("commits"), dealt.get("digest")
            if not self._signed(sender, holders, pairs, digest, dealt.get("dealing")):
                # without it, shares of another secret could not be laid at its door: left out
                self.culprits[sender] = "a dealing (its holders, t and commitments) it did not sign"
                del shares[sender]
                continue
            if not set(holders) <= set(self.neighbours.get(sender, ())):
                # shares for owners outside its neighbourhood, which each would refuse after its
                # neighbours had paid (a review's member spoiled rounds so, unnamed): left out
                self.culprits[sender] = "dealt shares to owners outside its neighbourhood"
                del shares[sender]
                continue
            if holders != sorted(j for j in self.neighbours[sender] if j in self.keys):
                # shares for fewer than its neighbours that advertised: its b could not be rebuilt
                # after every owner paid (a review's member abandoned rounds so, unnamed): left out
                self.culprits[sender] = "dealt shares to other holders than its neighbours that advertised"
                del shares[sender]
                continue
            self.holders[sender] = holders
            self.commits[sender] = dict(pairs)
            self.dealings[sender] = (dealt["dealing"], digest)
            self.packed[sender] = pack_dealing(digest, dealt["dealing"], holders, pairs)
            self.bytes_in += 64 * len(holders) + 96
            for receiver, ciphertext in dealt["shares"].items():
                self.inbox.setdefault(receiver, {})[sender] = ciphertext
                self.bytes_in += len(ciphertext)
        self._enough(len(shares), "shared their keys")

    def _signed(self, sender: int, holders: list[int], pairs: object, digest: object, dealing: object) -> bool:
        """Whether a dealing is whole (a commitment pair for each holder, b's digest) and signed by
        its dealer over its holders, t, the digest, its advertised s key and its commitments."""
        key = self.keys.get(sender, {})
        s_key = key.get("s", b"")
        if not isinstance(pairs, dict) or sorted(pairs) != holders or not all(
                isinstance(p, bytes) and len(p) == 64 for p in pairs.values()):
            return False
        if not isinstance(digest, bytes) or len(digest) != 32 or not isinstance(s_key, bytes) or len(s_key) != 32:
            return False
        root = commit_root(self.round_id, sender, b"".join(pairs[h] for h in holders))
        return verify(key.get("v", b""), bytes(dealing or b""),
                      _dealing_message(self.round_id, sender, holders, self.threshold, digest, s_key, root))

    def shares_for(self, client: int) -> dict[str, dict[int, bytes]]:
        """The ciphertexts addressed to `client`, and each dealer's signed dealing (`pack_dealing`)."""
        out = self.inbox.get(client, {})
        commits = {j: self.packed.get(j, b"") for j in out}
        self.bytes_out += sum(len(c) for c in out.values()) + sum(len(c) for c in commits.values())
        return {"ciphertexts": out, "commits": commits}

    def collect_masked(self, masked: dict[int, np.ndarray], masked_sets: dict[int, dict] | None = None) -> None:
        """The survivors' masked vectors and, on a ring, each one's signed M. A survivor whose M is
        not, signed by it, exactly the dealers whose shares reached it is named and counted as
        dropped: otherwise no holder would reveal its b, and one member could abandon every round
        after the owners paid (a review found it)."""
        self.masked = {c: np.asarray(v, dtype=np.uint64) for c, v in masked.items()
                       if c in self.inbox and c in self.holders}
        self.masked_sets = {c: m for c, m in (masked_sets or {}).items() if c in self.masked}
        if self.graph is not None:
            for c in list(self.masked):
                if not self._masked_with_holds(c, self.masked_sets.get(c)):
                    self.culprits[c] = "a masked input without its signed set of the neighbours it masked with"
                    del self.masked[c]
                    self.masked_sets.pop(c, None)
        self.bytes_in += 8 * self.length * len(self.masked) + sum(
            8 * len(m.get("with", ())) + 64 for m in self.masked_sets.values())
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

    def _masked_with_holds(self, client: int, entry: object) -> bool:
        """Whether `entry` is `client`'s signature of M, the dealers whose shares it was sent."""
        expected = sorted(self.inbox.get(client, {}))
        return isinstance(entry, dict) and entry.get("with") == expected and verify(
            self.keys.get(client, {}).get("v", b""), entry.get("sig"),
            masked_with_message(self.round_id, client, expected))

    def masked_sets_for(self, client: int) -> dict[int, dict]:
        """On a ring, its neighbours' signed M, for `client`'s unmask (empty on the complete graph)."""
        out = {j: self.masked_sets[j] for j in self.neighbours[client] if j in self.masked_sets and j != client}
        self.bytes_out += sum(8 * len(m.get("with", ())) + 64 for m in out.values())
        return out

    def _secret(self, dealer: int, part: str, index: dict) -> bytes:
        """One client's b or s from the shares its holders sent, each checked against the
        dealer's commitment (a holder that sent another share is named, and its share set
        aside, as is a share from a holder the dealer did not deal to). Fewer than t good shares
        abandon the round. The secret rebuilt is checked against the dealer's signed dealing (b's
        digest, s's public key): another one is the dealer's doing, recorded with its evidence
        (`_blame`), and `finish` abandons the round."""
        good = self._good_shares(dealer, part, index)
        self._enough(len(good), f"sent a good share of client {dealer}'s {'self mask' if part == 'b' else 'key'}")
        chosen = {h: good[h] for h in sorted(good)[:self.threshold]}
        secret = combine_secret(chosen, self.holders[dealer], self.threshold)
        committed = self.dealings[dealer][1] if part == "b" else bytes(self.keys[dealer]["s"])
        if _rebuilt_mismatch(part, secret, self.round_id, dealer, committed):
            self._blame(dealer, part, chosen)
        return secret

    def _good_shares(self, dealer: int, part: str, index: dict) -> dict[int, bytes]:
        """The shares of `dealer`'s b or s its holders sent (the unmask answers' `_index`) that match
        its commitments; a holder that sent another share, or one it was not dealt, is named."""
        good, dealt_to = {}, set(self.holders.get(dealer, ()))
        sent = index[part].get(dealer, {})
        for holder, share in sent.items():
            if holder not in dealt_to:  # a commitment the dealer made outside the holders it listed
                self.culprits[holder] = f"sent a share of client {dealer}'s {part} it was not dealt"
                continue
            commit = self.commits.get(dealer, {}).get(holder, b"")
            expected = commit[:32] if part == "b" else commit[32:64]
            if _commitment(self.round_id, dealer, holder, part, share) == expected:
                good[holder] = share
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
            "commits": {str(h): self.commits[dealer][h].hex() for h in self.holders[dealer]}}
        self.culprits[dealer] = (f"dealt shares of its {'self mask' if part == 'b' else 'key'} that rebuild a "
                                 f"secret other than the one it signed (checkable evidence in "
                                 f"secure-aggregation.json)")

    def finish(self, answers: dict[int, dict]) -> np.ndarray:
        """The sum of the survivors' vectors, from the unmask answers of at least t survivors."""
        self._enough(len(answers), "answered the unmask request")
        index = _index(answers)  # each dealer's shares found in O(k), not by reading every answer
        total = np.zeros(self.length, dtype=np.uint64)
        for vector in self.masked.values():
            total += vector
        for j in self.masked:  # self masks
            add_mask(total, self_mask_key(self._secret(j, "b", index)), -1)
        for d in sorted(set(self.holders) - set(self.masked)):  # pairwise masks a dropped client left
            if d not in index["s"]:
                continue
            private = X25519PrivateKey.from_private_bytes(self._secret(d, "s", index))
            for j in self.neighbours[d]:
                if j in self.masked and d in self.inbox.get(j, {}) and j != d:
                    pair = _derive(private.exchange(_public(self.keys[j]["s"], "s key")),
                                   _info(self.round_id, "mask", min(j, d), max(j, d)))
                    add_mask(total, pair, -pairwise_sign(j, d))
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


def _index(answers: dict[int, dict]) -> dict[str, dict[int, dict[int, bytes]]]:
    """Unmask answers by part and dealer: part → dealer → holder → share."""
    index: dict[str, dict[int, dict[int, bytes]]] = {"b": {}, "s": {}}
    for holder, answer in answers.items():
        for part in ("b", "s"):
            for dealer, share in answer.get(part, {}).items():
                index[part].setdefault(dealer, {})[holder] = share
    return index
