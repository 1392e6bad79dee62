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
from fedsd.secure.secagg_primitives import (SEED_BYTES, SELF_SEED_BYTES, _commitment, _dealing_message, _derive, _info,
                                            _public, _rebuilt_mismatch, combine_secret, expand_mask, minimum_threshold,
                                            pairwise_sign, self_mask_key)


class RoundAbandoned(Exception):
    """Too few clients went on for the round to be unmasked, or their shares did not rebuild
    one secret; nothing was revealed or applied. `culprits`: client id → what it did."""

    def __init__(self, message: str, culprits: dict | None = None):
        super().__init__(message)
        self.culprits = dict(culprits or {})


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
            s_key = key.get("s", b"")
            if not isinstance(digest, bytes) or len(digest) != 32 or not isinstance(s_key, bytes) or \
                    len(s_key) != 32 or not verify(
                    key.get("v", b""), bytes(dealt.get("dealing") or b""),
                    _dealing_message(self.round_id, sender, holders, self.threshold, digest, s_key)):
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
