"""Multi-round secure aggregation, the server's side (`RunServer`; the owners' side and the
protocol's steps: fedsd.secure.secagg_runs): it keeps what the dealers sent for routing (every
holder's commitment list, the dealing entries, the holders' acknowledgements), says which path a
round takes, and rebuilds the sum: each survivor's self mask from T good shares of b_r, and for
each dropped member, its s_r, whose pairwise masks it then removes from the survivors' sum.
A share unlike its commitment is set aside and its holder named; T shares that rebuild another
secret than the dealer's entry abandon the round, naming the dealer.
"""
from __future__ import annotations

import hashlib
import secrets
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedsd.secure.secagg_primitives import (ProtocolError, _commitment, _derive, _info, _public, _rebuilt_mismatch,
                                            combine_secret, expand_mask, lowest_threshold, pairwise_sign, round_tag,
                                            run_tag, self_mask_key)
from fedsd.secure.secagg_runs import BATCH, COMMIT, RunMember, batch_of, rounds_of
from fedsd.secure.secagg_server import RoundAbandoned


class RunServer:
    """The server of one run τ with its holders and threshold."""

    def __init__(self, tau: bytes, holders: list[int], threshold: int, batch: int = BATCH):
        self.tau, self.holders, self.threshold, self.batch = tau, sorted(holders), threshold, batch
        self.dealings: dict[tuple, dict] = {}  # (dealer, batch) → the dealer's reply
        self.acks: dict[tuple, dict] = {}  # (dealer, batch) → holder → its signature of the root
        self.culprits: dict[int, str] = {}

    def keep_dealing(self, dealer: int, dealing: dict) -> dict[int, dict]:
        """A dealer's batch kept; what each holder it dealt to is sent of it. ProtocolError for a second
        dealing of one batch with another root: the first is kept, as its holders keep it."""
        batch = dealing["batch"]
        kept = self.dealings.get((dealer, batch))
        if kept is not None and kept["root"] != dealing["root"]:
            raise ProtocolError(f"batch {batch}: dealt twice with two roots")
        self.dealings[(dealer, batch)] = dealing
        return {h: {**{k: v for k, v in dealing.items() if k != "to"}, "to": dealing["to"][h]} for h in self.holders
                if h in dealing["to"]}

    def keep_ack(self, dealer: int, batch: int, holder: int, signature: bytes) -> None:
        self.acks.setdefault((dealer, batch), {})[holder] = signature

    def acks_for(self, r: int, cohort: list[int]) -> dict[int, dict]:
        """The acknowledgements each cohort member's round-r batch has."""
        return {j: dict(self.acks.get((j, batch_of(r, self.batch)), {})) for j in cohort}

    def _entry(self, dealer: int, r: int) -> dict:
        return self.dealings[(dealer, batch_of(r, self.batch))]["entries"][r]

    def _commit(self, dealer: int, holder: int, r: int, part: str) -> bytes:
        dealing = self.dealings[(dealer, batch_of(r, self.batch))]
        k = list(rounds_of(batch_of(r, self.batch), self.batch)).index(r)
        if holder not in dealing["to"]:  # dealt to the holders there at its dealing: this one held nothing
            return b""
        line = dealing["to"][holder]["commits"][k * COMMIT:(k + 1) * COMMIT]
        return line[:32] if part == "b" else line[32:]

    def _secret(self, r: int, dealer: int, part: str, answers: dict[int, dict]) -> bytes:
        rid, good = round_tag(self.tau, r), {}
        for holder, answer in answers.items():
            shares = answer.get(part) if isinstance(answer, dict) else None
            share = shares.get(dealer) if isinstance(shares, dict) else None
            if not isinstance(shares, dict) or not isinstance(share, (bytes, type(None))):
                self.culprits[holder] = "sent an answer that is not a map of member to share"
                continue
            if share is None:
                continue
            if holder in self.holders and _commitment(rid, dealer, holder, part, share) == \
                    self._commit(dealer, holder, r, part):
                good[holder] = share
            else:
                self.culprits[holder] = f"sent a share of member {dealer}'s {part} other than the one committed to"
        if len(good) < self.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(good)} good shares of member {dealer}'s "
                                 f"{'self mask' if part == 'b' else 'key'}, below the threshold {self.threshold}; "
                                 f"round {r} is abandoned and nothing was unmasked", self.culprits)
        chosen = {h: good[h] for h in sorted(good)[:self.threshold]}
        secret = combine_secret(chosen, self.holders, self.threshold)
        entry = self._entry(dealer, r)
        if _rebuilt_mismatch(part, secret, rid, dealer, entry["digest"] if part == "b" else entry["s_public"]):
            self.culprits[dealer] = "dealt shares that rebuild a secret other than the one it signed"
            raise RoundAbandoned(f"secure aggregation: member {dealer}'s shares rebuild another secret than it "
                                 f"signed; round {r} is abandoned and nothing was applied", self.culprits)
        return secret

    def finish(self, r: int, masked: dict[int, np.ndarray], dropped: list[int],
               answers: dict[int, dict]) -> np.ndarray:
        """Round r's sum over the members in `masked` (their y), given the holders' answers:
        b_r shares of every survivor, and s_r shares of each member in `dropped`."""
        rid, length = round_tag(self.tau, r), len(next(iter(masked.values())))
        total = np.zeros(length, dtype=np.uint64)
        for j, y in masked.items():
            total += y
            total -= expand_mask(self_mask_key(self._secret(r, j, "b", answers)), length)
        for d in dropped:
            private = X25519PrivateKey.from_private_bytes(self._secret(r, d, "s", answers))
            for j in masked:
                pair = _derive(private.exchange(_public(self._entry(j, r)["s_public"], "s key")),
                               _info(rid, "mask", min(j, d), max(j, d)))
                mask = expand_mask(pair, length)
                total = total - mask if pairwise_sign(j, d) > 0 else total + mask
        return total


class InProcessRun:
    """A multi-round run with every owner's side and the server's in one process, as a simulation
    runs them: set up once, each batch dealt and delivered when its first round comes (a deployment
    sends a top-up with an earlier round's E1), then each round is E1 and E2. Its rounds count from
    the first it is asked for (a simulation resumed at round r sets up a run of its own there). `identities`: client →
    fedsd.secure.identity.Identity, on one roster; t (`min_cohort`) and f as every owner's."""

    def __init__(self, identities: dict, roster, min_cohort: int = 2, max_colluders: int = 0, batch: int = BATCH):
        self.tau = run_tag(secrets.token_bytes(16))  # a process's run: nothing of another verifies in it
        self.members = {k: RunMember(identity, roster, self.tau, min_cohort, max_colluders, batch)
                        for k, identity in identities.items()}
        self.ids = sorted(m.me for m in self.members.values())
        n = len(self.ids)
        self.threshold = min(lowest_threshold(n, max_colluders), n - max_colluders)
        self.server = RunServer(self.tau, self.ids, self.threshold, batch)
        for m in self.members.values():
            m.setup(self.ids, self.threshold)
        self.dealt: set[int] = set()
        self.before = None  # the simulation's rounds before this run's first

    def _deal(self, batch: int) -> int:
        """Batch `batch` dealt by every member and delivered to every holder; its bytes."""
        channels = {m.me: m.channel_key(batch) for m in self.members.values()}
        by_id = {m.me: m for m in self.members.values()}
        sent = 0
        for m in self.members.values():
            for holder, delivery in self.server.keep_dealing(m.me, m.deal(batch, channels)).items():
                sent += len(delivery["to"]["ciphertext"]) + len(delivery["to"]["commits"])
                self.server.keep_ack(m.me, batch, holder, by_id[holder].deliver(m.me, batch, delivery))
        self.dealt.add(batch)
        return sent

    def round(self, r: int, vectors: dict, length: int, digest: bytes = bytes(32)) -> tuple[np.ndarray, dict]:
        """Round r (from 1): every client's vector (client → a function computing it, called at E1,
        as a service would) masked, the sum unmasked; the sum and the round's cost, as
        fedsd.secure.distributed_step.secure_round reports it."""
        started, computing = time.perf_counter(), 0.0
        self.before = r - 1 if self.before is None else self.before
        r -= self.before
        batch = batch_of(r, self.server.batch)
        dealt = 0 if batch in self.dealt else self._deal(batch)
        acks, sent, receipts = self.server.acks_for(r, self.ids), {}, {}
        for k, m in self.members.items():
            m.admit(r, self.ids, digest, acks)
            t = time.perf_counter()
            vector = vectors[k]()
            computing += time.perf_counter() - t
            sent[m.me] = m.mask(r, vector)
            receipts[m.me] = {"sig": sent[m.me]["receipt"], "digest": digest, "needed": m.needed,
                              "y_hash": hashlib.sha256(sent[m.me]["y"].tobytes()).digest()}
        answers = {m.me: m.unmask(r, self.ids, receipts) for m in self.members.values()}
        total = self.server.finish(r, {i: s["y"] for i, s in sent.items()}, [], answers)
        cost = dict(bytes_to_server=8 * length * len(sent) + dealt + 64 * len(sent) + 16 * len(self.ids) ** 2,
                    bytes_from_server=dealt + 128 * len(self.ids) ** 2,
                    protocol_seconds=time.perf_counter() - started - computing, survivors=len(sent))
        return total, cost
