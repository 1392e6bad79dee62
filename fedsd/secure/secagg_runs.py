"""Multi-round secure aggregation, an owner's side (`RunMember`): the keys, holders and threshold
set up once a run, every round's secrets dealt ahead in batches, and a steady round of two
exchanges, masked input and unmask (docs/design/multi-round-secure-aggregation.md, its section 13
the specification). The server's side is fedsd.secure.secagg_runs_server.

Bonawitz et al. (CCS 2017) with a PKI, their rounds done once a run where they can be, as Ma et al.'s
Flamingo (S&P 2023) does, with its "each client is either dropped or survived in a round":

  setup (Bonawitz round 0, once a run): `setup` checks the holders H (every member of the run)
     and the threshold T against the owner's t and f, as `check_threshold` does for one round.
  channel keys (`channel_key`): one X25519 key a batch of rounds, signed; the shares of a batch
     travel encrypted under keys HKDF derives from two members' keys of that batch.
  dealing (Bonawitz round 1, for a batch of B rounds at once: `deal`): for every round r of the
     batch a fresh self-mask seed b_r and mask key pair s_r (from the operating system), each
     Shamir-shared T-of-N to H, with per-holder signed commitments under one signed root, and one
     signed dealing entry a round (`_dealing_message` of that round: H, T, b's digest, s's public half).
  delivery (`deliver`): a holder opens its shares, checks each against its commitment, and
     acknowledges the batch's root with its signature; nobody is seated in a round until T + f
     holders acknowledged its batch.
  E1 masked input (Bonawitz round 2; Flamingo's report: `admit`, then `mask`): the cohort C_r,
     every member's dealing entry for r and the acknowledgements of its batch are checked before
     anything is charged; `admit` raises the owner's `submitted` counter, `mask` returns y and a
     signed receipt binding the round, the cohort, the round's digest (settings, model, plan), the
     owner's t + f and SHA-256(y). A lost reply is answered again with the same bytes.
  E2 unmask (`unmask`; Bonawitz round 4 when nobody dropped, round 3 being the receipts): a holder
     reveals its share of b_r for every member of C_r once every member's receipt is shown, over
     one cohort and digest, and the cohort reaches the largest t + f any receipt names.
  E2' view and E3 unmask, when someone dropped (`view`, `unmask_view`: Bonawitz rounds 3 and 4):
     the holders sign one view (survivors S with receipts, dropped D = C_r \\ S), and once enough
     signed it, reveal b_r of S and s_r of D: never both for one member, never a second answer.

Nothing revealed is run-long: a dropped member loses s_r, which masks round r alone, so it
rejoins the next round with nothing to do. Its counters (`Counters`: the last round it masked,
answered, viewed and dealt) are only ever raised; the owner's service keeps them in its record
outside the state folder (fedsd.privacy.owner_record), so that a restored folder masks and reveals
no round twice. Here they live in memory.

Primitives from `cryptography` (X25519, Ed25519, HKDF-SHA256, AES-GCM, AES-256-CTR) and Shamir from
fedsd.secure.shamir, as the per-round protocol's (fedsd.secure.secagg).
"""
from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedsd.secure.identity import Identity, Roster, verify
from fedsd.secure.secagg_primitives import (NONCE, SELF_SEED_BYTES, SHARE_BYTES, ProtocolError, _agree,
                                            _commitment, _dealing_message, _derive, _ids, _info, _public, _raw,
                                            _view_message, batch_message, batch_root, channel_message,
                                            check_threshold, cohort_digest, commit_list_hash, entries_digest,
                                            expand_mask, held_message, pairwise_sign, receipt_message, round_tag,
                                            seed_digest, self_mask_key, split_secret)

BATCH = 8  # rounds dealt at once: a leaked folder with its key exposes at most these (design, section 13)
COMMIT = 64  # a round's two commitments (b, s) in a holder's list


def _number(value: object) -> bool:
    """A positive integer (a round, a batch or an id), not a bool: anything else from the server is
    refused before it is used as a key or sorted."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _by_number(value: object) -> bool:
    """A map whose keys are all integers (what `sorted` may compare)."""
    return isinstance(value, dict) and all(isinstance(k, int) and not isinstance(k, bool) for k in value)


def batch_of(round_number: int, size: int = BATCH) -> int:
    return (int(round_number) - 1) // size + 1


def rounds_of(batch: int, size: int = BATCH) -> range:
    return range((batch - 1) * size + 1, batch * size + 1)


@dataclass
class Counters:
    """What an owner keeps of a run, only ever raised: the last round it masked an input for, the
    last it answered an unmask for, the one view it signed last (round, digest), the last round it
    dealt, and the latest round it was asked about (a holder answers no round behind it)."""
    submitted: int = 0
    answered: int = 0
    viewed: tuple = (0, b"")
    dealt: int = 0
    seen: int = 0


@dataclass
class RunMember:
    """One owner in one run τ (`tau`: fedsd.secure.secagg_primitives.run_tag): its identity and
    roster, its t (`min_cohort`) and f (`max_colluders`), and its counters."""

    identity: Identity
    roster: Roster
    tau: bytes
    min_cohort: int = 2
    max_colluders: int = 0
    batch: int = BATCH
    counters: Counters = field(default_factory=Counters)
    holders: list[int] = field(default_factory=list)
    threshold: int = 0
    _channel: dict = field(default_factory=dict)  # batch → my X25519 channel key
    _dealt: dict = field(default_factory=dict)  # round → (b, s private key): mine, not yet used
    _sent: dict = field(default_factory=dict)  # batch → what I dealt (a lost reply is resent as it was)
    _held: dict = field(default_factory=dict)  # (dealer, round) → (b share, s share)
    _roots: dict = field(default_factory=dict)  # (dealer, batch) → the root I acknowledged
    _entries: dict = field(default_factory=dict)  # (dealer, round) → (b digest, s public), from its batch
    _held_by_enough: set = field(default_factory=set)  # (dealer, batch) that T + f holders acknowledged
    _masked: dict = field(default_factory=dict)  # round → (y, receipt): resent, never recomputed
    _admitted: tuple = ()  # (round, cohort, digest, partners' s public keys) between admit and mask
    _view: tuple = ()  # (round, survivors, dropped, statement, need)

    def __post_init__(self):
        self.me = self.identity.id
        if self.me not in self.roster:
            raise ProtocolError("this owner's own identity is not on its roster")

    @property
    def needed(self) -> int:
        """The fewest inputs this owner lets be summed: its t honest ones and its f of the server's."""
        return self.min_cohort + self.max_colluders

    def _need(self) -> int:
        return max(self.threshold, self.needed)

    def _key(self, member: int) -> bytes:
        return self.roster.key(member)

    # -- set up once a run ------------------------------------------------------------------
    def setup(self, holders: object, threshold: object, start: object = 1) -> None:
        """The run's holders (every member, this owner among them, all on its roster) and threshold,
        checked as a round's are (`check_threshold`); set once. `start`: the round the server is at
        (a run resumed from a checkpoint starts past its first batch): no earlier round is answered."""
        holders = _ids(holders, "holders")
        if not _number(start) or start > 1 << 31:
            raise ProtocolError("setup: the round is a positive integer, at most 2^31")
        if self.holders:
            if (holders, threshold) != (self.holders, self.threshold):
                raise ProtocolError("setup: this run's holders and threshold are set; another pair was sent")
            self._started(start)
            return
        if self.me not in holders:
            raise ProtocolError("setup: this owner is not among the run's holders")
        strangers = [j for j in holders if j not in self.roster]
        if strangers:
            raise ProtocolError(f"setup: {self.roster.name(strangers[0])} not on this owner's roster "
                                f"(culprit: {strangers[0]})")
        check_threshold(len(holders), threshold, self.min_cohort, self.max_colluders)
        if threshold + 2 * self.max_colluders > len(holders):
            # E1 seats a member once T + f holders acknowledged its shares: f silent members must
            # leave that many (a review playing the attacker stopped every round with f of them)
            raise ProtocolError(f"setup: threshold {threshold} + twice {self.max_colluders} of the server's is above "
                                f"the {len(holders)} holders: that many withholding their acknowledgements would "
                                f"keep every owner out of every round (this run needs more than 6f owners)")
        self.holders, self.threshold = holders, threshold
        self._started(start)

    def _started(self, start: object) -> None:
        """`seen` raised to the server's round; what only rounds before it could use, erased (a review
        piled up dealt batches by raising it without a round)."""
        if start > self.counters.seen:
            self.counters.seen, first = start, batch_of(start, self.batch)
            self._dealt = {r: v for r, v in self._dealt.items() if r >= start}
            self._held = {k: v for k, v in self._held.items() if k[1] >= start}
            self._channel = {b: k for b, k in self._channel.items() if b >= first}
            self._prune(first)

    def channel_key(self, batch: int) -> dict:
        """My channel key for `batch`, signed (one key a batch, made once)."""
        if not _number(batch) or batch > self._next_batch():
            raise ProtocolError(f"channel key: the batch is a positive integer, at most {self._next_batch()} (the "
                                f"rounds' secrets are dealt one batch ahead, never more)")
        if batch not in self._channel:
            self._channel[batch] = X25519PrivateKey.generate()
        key = _raw(self._channel[batch].public_key())
        return {"key": key, "sig": self.identity.sign(channel_message(self.tau, self.me, batch, key))}

    def _next_batch(self) -> int:
        """The furthest batch this member deals or keys for: the one after the latest round it saw."""
        return batch_of(max(self.counters.seen, 1), self.batch) + 1

    def _channel_public(self, member: int, batch: int, announced: object):
        entry = announced if isinstance(announced, dict) else {}
        key = _public(entry.get("key"), f"{self.roster.name(member)}'s channel key (culprit: {member})")
        if not verify(self._key(member), entry.get("sig"), channel_message(self.tau, member, batch, _raw(key))):
            raise ProtocolError(f"the channel key of {self.roster.name(member)} for batch {batch} is not signed by it "
                                f"for this run (culprit: {member})")
        return key

    def _link(self, member: int, batch: int, public) -> bytes:
        low, high = min(self.me, member), max(self.me, member)
        return _derive(_agree(self._channel[batch], public, f"{self.roster.name(member)}'s channel key "
                                                            f"(culprit: {member})"),
                       _info(self.tau, "enc", batch, low, high))

    # -- dealing a batch -----------------------------------------------------------------------
    def deal(self, batch: object, channels: object) -> dict:
        """Batch `batch`'s rounds dealt to the holders in `channels` (each one's signed channel key for
        it): this owner and at least T + f of the run's holders, so that a holder gone for good does not
        stop the run; one left out holds no share of the batch, as if it dropped. A batch is dealt
        once; asked again, the same reply."""
        if not self.holders:
            raise ProtocolError("deal: the run is not set up")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ProtocolError("deal: the batch is a positive integer")
        if batch in self._sent:
            return self._sent[batch]
        rounds = rounds_of(batch, self.batch)
        if rounds[0] <= self.counters.dealt:
            raise ProtocolError(f"deal: batch {batch} was dealt already (its secrets are gone: this owner sits "
                                f"those rounds out)")
        if not _by_number(channels) or not set(channels) <= set(self.holders) or self.me not in channels or \
                len(channels) < self.threshold + self.max_colluders:
            raise ProtocolError(f"deal: signed channel keys of this owner and at least {self.threshold} + "
                                f"{self.max_colluders} of the run's holders were expected")
        to = sorted(channels)
        publics = {h: self._channel_public(h, batch, channels[h]) for h in to}
        raws = [_raw(k) for k in publics.values()]
        if len(set(raws)) != len(raws):
            raise ProtocolError("deal: two holders gave the same channel key")
        mine = self.channel_key(batch)
        if raws[to.index(self.me)] != mine["key"]:
            raise ProtocolError("deal: this owner's own channel key came back changed")
        links = {h: self._link(h, batch, publics[h]) for h in to}
        sent = self._dealt_batch(batch, rounds, links)
        self.counters.dealt = rounds[-1]
        sent["channel"] = mine
        self._sent[batch] = sent
        return sent

    def _dealt_batch(self, batch: int, rounds: range, links: dict) -> dict:
        plain = {h: [] for h in links}
        commits = {h: [] for h in links}
        entries = {}
        for r in rounds:
            rid, b, s = round_tag(self.tau, r), secrets.token_bytes(SELF_SEED_BYTES), X25519PrivateKey.generate()
            self._dealt[r] = (b, s)
            b_shares = split_secret(b, self.threshold, self.holders)
            s_shares = split_secret(s.private_bytes_raw(), self.threshold, self.holders)
            for h in links:
                plain[h].append(b_shares[h] + s_shares[h])
                commits[h].append(_commitment(rid, self.me, h, "b", b_shares[h]) +
                                  _commitment(rid, self.me, h, "s", s_shares[h]))
            digest, public = seed_digest(rid, self.me, b), _raw(s.public_key())
            entries[r] = {"digest": digest, "s_public": public, "sig": self.identity.sign(
                _dealing_message(rid, self.me, self.holders, self.threshold, digest, public))}
        lists = {h: b"".join(commits[h]) for h in links}
        hashes = [commit_list_hash(self.tau, self.me, h, batch, lists[h]) for h in links]
        root = batch_root(self.tau, self.me, batch, hashes, entries_digest(
            self.tau, self.me, [(r, e["digest"], e["s_public"]) for r, e in entries.items()]))
        to = {}
        for h in links:
            nonce = secrets.token_bytes(NONCE)
            to[h] = {"ciphertext": nonce + AESGCM(links[h]).encrypt(nonce, b"".join(plain[h]),
                                                                    _info(self.tau, "batch", batch, self.me, h)),
                     "commits": lists[h]}
        return {"batch": batch, "root": root, "sig": self.identity.sign(batch_message(self.tau, self.me, batch, root)),
                "list_hashes": dict(zip(links, hashes)), "to": to, "entries": entries}

    def deliver(self, dealer: object, batch: object, dealing: object) -> bytes:
        """A dealer's batch as this holder receives it (the dealer's reply, with `to` narrowed to
        this holder's ciphertext and commitments): checked, kept, acknowledged with a signature of
        its root. A second, different dealing of one (dealer, batch) is refused, the first kept."""
        if not self.holders or not _number(dealer) or dealer not in self.holders or not isinstance(dealing, dict):
            raise ProtocolError("deliver: a dealing from one of this run's holders was expected")
        if not _number(batch) or batch not in self._channel:
            raise ProtocolError("deliver: a batch this owner gave a channel key for was expected")
        who = f"{self.roster.name(dealer)} (culprit: {dealer})"
        root, hashes = dealing.get("root"), dealing.get("list_hashes")
        entries = self._checked_entries(dealer, batch, dealing.get("entries"), who)
        if not _by_number(hashes) or not set(hashes) <= set(self.holders) or self.me not in hashes or not all(
                isinstance(v, bytes) and len(v) == 32 for v in hashes.values()) or not isinstance(root, bytes) \
                or batch_root(self.tau, dealer, batch, [hashes[h] for h in sorted(hashes)], entries_digest(
                    self.tau, dealer, [(r, d, p) for r, (d, p) in entries.items()])) != root \
                or not verify(self._key(dealer), dealing.get("sig"), batch_message(self.tau, dealer, batch, root)):
            raise ProtocolError(f"deliver: the batch of {who} is not signed by it for this run and batch")
        if (dealer, batch) in self._roots:
            if self._roots[(dealer, batch)] != root:
                raise ProtocolError(f"deliver: {who} dealt batch {batch} twice (equivocation); the first is kept")
            return self.identity.sign(held_message(self.tau, self.me, dealer, batch, root))
        shares = self._opened(dealer, batch, dealing, hashes[self.me], who)
        for old in [b for b in self._channel if b < batch]:  # batch β+1 delivered: β's key is done with (the
            del self._channel[old]  # server's copies of β's ciphertexts then open to no one)
        self._held.update({(dealer, r): pair for r, pair in shares.items()})
        self._entries.update({(dealer, r): e for r, e in entries.items()})
        self._roots[(dealer, batch)] = root
        return self.identity.sign(held_message(self.tau, self.me, dealer, batch, root))

    def _opened(self, dealer: int, batch: int, dealing: dict, list_hash: bytes, who: str) -> dict:
        rounds = rounds_of(batch, self.batch)
        mine = dealing.get("to") if isinstance(dealing.get("to"), dict) else {}
        ciphertext, commits = mine.get("ciphertext"), mine.get("commits")
        if not isinstance(commits, bytes) or len(commits) != COMMIT * len(rounds) or \
                commit_list_hash(self.tau, dealer, self.me, batch, commits) != list_hash:
            raise ProtocolError(f"deliver: the commitments from {who} are not the ones its root names")
        if not isinstance(ciphertext, bytes) or len(ciphertext) != NONCE + SHARE_BYTES * len(rounds) + 16:
            raise ProtocolError(f"deliver: the shares from {who} are malformed")
        link = self._link(dealer, batch, self._channel_public(dealer, batch, dealing.get("channel")))
        try:
            plain = AESGCM(link).decrypt(ciphertext[:NONCE], ciphertext[NONCE:],
                                         _info(self.tau, "batch", batch, dealer, self.me))
        except InvalidTag:
            raise ProtocolError(f"deliver: the shares from {who} are not for this run, batch and holder") from None
        shares = {}
        for k, r in enumerate(rounds):
            rid, pair = round_tag(self.tau, r), plain[k * SHARE_BYTES:(k + 1) * SHARE_BYTES]
            b, s = pair[:SELF_SEED_BYTES], pair[SELF_SEED_BYTES:]
            if commits[k * COMMIT:(k + 1) * COMMIT] != (_commitment(rid, dealer, self.me, "b", b) +
                                                       _commitment(rid, dealer, self.me, "s", s)):
                raise ProtocolError(f"deliver: a share from {who} (round {r}) is not the one it committed to")
            shares[r] = (b, s)
        return shares

    def _checked_entries(self, dealer: int, batch: int, entries: object, who: str) -> dict:
        rounds = rounds_of(batch, self.batch)
        if not _by_number(entries) or sorted(entries) != list(rounds):
            raise ProtocolError(f"deliver: {who} sent no dealing entry for every round of its batch")
        checked = {}
        for r in rounds:
            e = entries[r] if isinstance(entries[r], dict) else {}
            digest, public = e.get("digest"), e.get("s_public")
            _public(public, f"{who}'s s key of round {r}")
            if not isinstance(digest, bytes) or len(digest) != 32 or not verify(
                    self._key(dealer), e.get("sig"),
                    _dealing_message(round_tag(self.tau, r), dealer, self.holders, self.threshold, digest, public)):
                raise ProtocolError(f"deliver: the dealing entry of {who} for round {r} is not signed by it for "
                                    f"this run's holders and threshold")
            checked[r] = (digest, public)
        return checked

    # -- a round ---------------------------------------------------------------------------------
    def _round(self, r: object, stage: str) -> int:
        if not _number(r):
            raise ProtocolError(f"{stage}: the round is a positive integer")
        if r < self.counters.seen:
            raise ProtocolError(f"{stage}: round {r} is behind round {self.counters.seen}, which this owner was "
                                f"asked about already")
        return r

    def _cohort(self, cohort: object, stage: str) -> list[int]:
        cohort = _ids(cohort, stage)
        if not set(cohort) <= set(self.holders):
            raise ProtocolError(f"{stage}: a member outside this run's holders")
        return cohort

    def admit(self, r: object, cohort: object, digest: object, acks: object) -> None:
        """E1's checks, before anything is charged: round r ahead of every round this owner masked,
        answered or viewed; the cohort this run's, this owner in it, at least its t + f and T; every
        member's batch for r acknowledged by T + f holders over the root this owner holds; this
        owner's own secrets for r at hand. Passed, `submitted` is raised to r: one input a round."""
        r = self._round(r, "masked-input")
        if r in self._masked:
            return
        c = self.counters
        if r <= max(c.submitted, c.answered, c.viewed[0]):
            raise ProtocolError(f"masked-input: round {r} was masked, answered or viewed by this owner already")
        cohort = self._cohort(cohort, "masked-input")
        if self.me not in cohort or len(cohort) < self._need():
            raise ProtocolError(f"masked-input: a cohort of {len(cohort)} without this owner or below its "
                                f"{self.min_cohort} + {self.max_colluders} and the threshold {self.threshold}")
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise ProtocolError("masked-input: the round's digest is 32 bytes")
        if r not in self._dealt:
            raise ProtocolError(f"masked-input: this owner holds no secrets for round {r} (it sits the round out)")
        for j in cohort:
            self._acknowledged(j, r, acks.get(j) if isinstance(acks, dict) else None)
        b, s = self._dealt[r]
        partners = {}
        for j in cohort:
            public = _public(self._entries[(j, r)][1], f"{self.roster.name(j)}'s s key (culprit: {j})")
            if j != self.me:
                _agree(s, public, f"{self.roster.name(j)}'s s key of round {r} (culprit: {j})")
            partners[j] = public
        raws = [_raw(k) for k in partners.values()]
        if len(set(raws)) != len(raws):
            raise ProtocolError(f"masked-input: two members dealt the same s key for round {r}")
        c.seen = c.submitted = r
        self._admitted = (r, cohort, digest, partners, self._dealt.pop(r))
        for old in [k for k in self._dealt if k < r]:  # rounds sat out: their secrets are never used
            del self._dealt[old]
        self._prune(batch_of(r, self.batch))

    def _prune(self, batch: int) -> None:
        """What this member kept of batches before `batch` (dealt, delivered, acknowledged), gone:
        its rounds are behind, and a late message about them is refused by the counters and the
        erased channel key."""
        self._sent = {b: v for b, v in self._sent.items() if b >= batch}
        self._roots = {k: v for k, v in self._roots.items() if k[1] >= batch}
        self._held_by_enough = {k for k in self._held_by_enough if k[1] >= batch}
        first = rounds_of(batch, self.batch)[0]
        self._entries = {k: v for k, v in self._entries.items() if k[1] >= first}

    def _acknowledged(self, j: int, r: int, acks: object) -> None:
        who, batch = f"{self.roster.name(j)} (culprit: {j})", batch_of(r, self.batch)
        root = self._roots.get((j, batch))
        if root is None or (j, r) not in self._entries:
            raise ProtocolError(f"masked-input: this owner holds no shares of {who}'s round {r}")
        if (j, batch) in self._held_by_enough:  # checked once a batch: acknowledgements are never taken back
            return
        message = lambda h: held_message(self.tau, h, j, batch, root)  # noqa: E731
        held = sum(1 for h in self.holders if isinstance(acks, dict) and verify(self._key(h), acks.get(h), message(h)))
        if held < self.threshold + self.max_colluders:
            raise ProtocolError(f"masked-input: {held} holders acknowledged the shares of {who} for round {r}, below "
                                f"the threshold {self.threshold} and {self.max_colluders} of the server's")
        self._held_by_enough.add((j, batch))

    def mask(self, r: object, vector: np.ndarray) -> dict:
        """E1's answer for an admitted round r: y = x + PRG(b_r) + Σ ±PRG(p_jr) over the cohort, and
        the signed receipt. Asked again for r: the same bytes (fresh noise would give a difference)."""
        if not _number(r):
            raise ProtocolError("masked-input: the round is a positive integer")
        if r in self._masked:
            y, receipt = self._masked[r]
            return {"y": y.copy(), "receipt": receipt}
        if not self._admitted or self._admitted[0] != r:
            raise ProtocolError(f"masked-input: round {r} was not admitted")
        vector = np.asarray(vector)
        if vector.dtype != np.uint64 or vector.ndim != 1:
            raise ValueError("mask: the vector is one-dimensional uint64")
        _, cohort, digest, partners, (b, s) = self._admitted
        rid = round_tag(self.tau, r)
        y = vector + expand_mask(self_mask_key(b), len(vector))
        for j in cohort:
            if j != self.me:
                seed = _derive(_agree(s, partners[j], "s"), _info(rid, "mask", min(self.me, j), max(self.me, j)))
                y = y - expand_mask(seed, len(vector)) if pairwise_sign(self.me, j) < 0 else \
                    y + expand_mask(seed, len(vector))
        receipt = self.identity.sign(receipt_message(rid, self.me, cohort_digest(cohort), digest, self.needed,
                                                     hashlib.sha256(y.tobytes()).digest()))
        self._admitted = ()
        self._masked = {r: (y, receipt)}
        return {"y": y.copy(), "receipt": receipt}

    def sent(self, r: int) -> dict | None:
        """The masked input and receipt this member sent for round r, as it sent them (None: none)."""
        if r not in self._masked:
            return None
        y, receipt = self._masked[r]
        return {"y": y.copy(), "receipt": receipt}

    def _receipts(self, r: int, members: list[int], cohort_hash: bytes, receipts: object, stage: str) -> int:
        """Every member's receipt checked (signed by it over this round, cohort and one digest);
        the largest t + f they name. This owner's own must be the one it made."""
        if not isinstance(receipts, dict):
            raise ProtocolError(f"{stage}: a map of member to receipt was expected")
        rid, digests, most = round_tag(self.tau, r), set(), 0
        for j in members:
            e = receipts.get(j) if isinstance(receipts.get(j), dict) else {}
            needed, digest, y_hash = e.get("needed"), e.get("digest"), e.get("y_hash")
            if not isinstance(needed, int) or isinstance(needed, bool) or not 2 <= needed <= len(self.holders) or \
                    not isinstance(digest, bytes) or not isinstance(y_hash, bytes) or len(digest) != 32 or \
                    len(y_hash) != 32 or not verify(
                    self._key(j), e.get("sig"), receipt_message(rid, j, cohort_hash, digest, needed, y_hash)):
                raise ProtocolError(f"{stage}: no receipt of {self.roster.name(j)} for this round and cohort "
                                    f"(culprit: {j})")
            if j == self.me and (r not in self._masked or e.get("sig") != self._masked[r][1]):
                raise ProtocolError(f"{stage}: this owner's own receipt came back changed")
            digests.add(digest)
            most = max(most, needed)
        if len(digests) > 1:
            raise ProtocolError(f"{stage}: the receipts name different settings or models for one round")
        return max(most, self._need())

    def unmask(self, r: object, cohort: object, receipts: object) -> dict:
        """E2, when every member of the cohort sent its input: its receipts, one per member over
        this cohort and one digest; this holder's share of every member's b_r, once, and never
        after a view of r. The cohort must reach the largest t + f a receipt names."""
        r = self._round(r, "unmask")
        if r <= self.counters.answered or self.counters.viewed[0] >= r:
            raise ProtocolError(f"unmask: round {r} was answered or viewed by this owner already")
        cohort = self._cohort(cohort, "unmask")
        need = self._receipts(r, cohort, cohort_digest(cohort), receipts, "unmask")
        if len(cohort) < need:
            raise ProtocolError(f"unmask: {len(cohort)} inputs, below the {need} a member of them requires")
        self.counters.seen = self.counters.answered = r
        answer = {"b": {j: self._held[(j, r)][0] for j in cohort if (j, r) in self._held}, "s": {}}
        self._forget(r)
        return answer

    def view(self, r: object, survivors: object, dropped: object, receipts: object) -> bytes:
        """E2', when someone dropped: the round's survivors (each with its receipt over the cohort
        S ∪ D) and dropped members; this holder's signature of that one view. Never a second view
        for r, never after answering r, and never one naming this owner dropped after it sent its
        input."""
        r = self._round(r, "view")
        survivors, dropped = self._cohort(survivors, "view"), self._cohort(dropped, "view")
        if set(survivors) & set(dropped) or not dropped:
            raise ProtocolError("view: a member both survived and dropped, or no one dropped")
        statement = _view_message(round_tag(self.tau, r), survivors, dropped)
        said = hashlib.sha256(statement).digest()
        if r <= self.counters.answered or self.counters.viewed[0] > r or (
                self.counters.viewed[0] == r and self.counters.viewed[1] != said):
            raise ProtocolError(f"view: round {r} was answered, or another view of it signed, by this owner")
        if self.me in dropped and self.counters.submitted >= r:
            raise ProtocolError("view: this owner named dropped in a round it sent its input for")
        need = self._receipts(r, survivors, cohort_digest(survivors + dropped), receipts, "view")
        if len(survivors) < need:
            raise ProtocolError(f"view: {len(survivors)} survivors, below the {need} a survivor requires")
        self.counters.seen, self.counters.viewed = r, (r, said)
        self._view = (r, survivors, dropped, statement, need)
        return self.identity.sign(statement)

    def unmask_view(self, r: object, signatures: object) -> dict:
        """E3: the holders' signatures of the view this holder signed; once `need` holders signed it,
        its shares of b_r for the survivors and of s_r for the dropped: never both for one member."""
        r = self._round(r, "unmask")
        if not self._view or self._view[0] != r or r <= self.counters.answered:
            raise ProtocolError(f"unmask: no view of round {r} signed by this owner, or the round answered")
        _, survivors, dropped, statement, need = self._view
        signed = sum(1 for h in self.holders if isinstance(signatures, dict)
                     and verify(self._key(h), signatures.get(h), statement))
        if signed < need:
            raise ProtocolError(f"unmask: {signed} holders signed this round's view, below {need}")
        self.counters.seen = self.counters.answered = r
        answer = {"b": {j: self._held[(j, r)][0] for j in survivors if (j, r) in self._held},
                  "s": {j: self._held[(j, r)][1] for j in dropped if (j, r) in self._held}}
        self._forget(r)
        return answer

    def _forget(self, r: int) -> None:
        """Round r's shares (and any older) deleted once it is answered."""
        for key in [k for k in self._held if k[1] <= r]:
            del self._held[key]
        self._view = ()

    # -- kept between messages -----------------------------------------------------------------
    def sealed(self, wrap_key: bytes) -> bytes:
        """Everything this member keeps between messages (its secrets for future rounds, the shares
        it holds, its channel keys), sealed with AES-256-GCM under the owner's wrap key, which lives
        outside the state folder (fedsd.privacy.owner_record.Records.wrap_key): a copy of the folder
        without it holds no usable secret. The counters are kept apart, in the owner's record."""
        kept = dict(holders=self.holders, threshold=self.threshold,
                    channel={b: k.private_bytes_raw() for b, k in self._channel.items()},
                    dealt={r: (b, s.private_bytes_raw()) for r, (b, s) in self._dealt.items()},
                    sent=self._sent, held=self._held, roots=self._roots, entries=self._entries,
                    enough=sorted(self._held_by_enough), masked=self._masked, admitted=self._kept_admission())
        nonce = secrets.token_bytes(NONCE)
        return nonce + AESGCM(wrap_key).encrypt(nonce, json.dumps(encoded(kept)).encode(), _info(self.tau, "kept"))

    def unseal(self, blob: bytes, wrap_key: bytes) -> None:
        """What `sealed` kept, back in this member (its counters are the record's, set before).
        ProtocolError where the wrap key is not the one that sealed it (a copied or restored folder
        without its owner's record): the member then starts with nothing and sits out the rounds it
        dealt, which its counters forbid it to deal again."""
        try:
            kept = decoded(json.loads(AESGCM(wrap_key).decrypt(blob[:NONCE], blob[NONCE:], _info(self.tau, "kept"))))
        except (InvalidTag, ValueError):
            raise ProtocolError("this run's kept state does not open under this owner's wrap key (a state folder "
                                "copied without its record?); the owner sits out the rounds it dealt") from None
        self.holders, self.threshold = list(kept["holders"]), kept["threshold"]
        self._channel = {b: X25519PrivateKey.from_private_bytes(k) for b, k in kept["channel"].items()}
        self._dealt = {r: (b, X25519PrivateKey.from_private_bytes(s)) for r, (b, s) in kept["dealt"].items()}
        self._sent, self._held, self._roots, self._entries = kept["sent"], kept["held"], kept["roots"], kept["entries"]
        self._held_by_enough, self._masked = {tuple(e) for e in kept["enough"]}, kept["masked"]
        if kept["admitted"]:  # admitted, not yet masked: its secrets and partners' keys, for `mask`
            r, cohort, digest, partners, (b, s) = kept["admitted"]
            self._admitted = (r, list(cohort), digest, {j: _public(k, "s") for j, k in partners.items()},
                              (b, X25519PrivateKey.from_private_bytes(s)))

    def _kept_admission(self) -> tuple:
        if not self._admitted:
            return ()
        r, cohort, digest, partners, (b, s) = self._admitted
        return (r, cohort, digest, {j: _raw(k) for j, k in partners.items()}, (b, s.private_bytes_raw()))


def encoded(x):
    """JSON for what a member keeps and for a run's nested messages on the wire (a dealing, the
    acknowledgements, the receipts): bytes, int-keyed maps, tuples and uint64 arrays tagged (a plain
    encoding, not a cipher: `sealed` encrypts what is kept). `decoded` reverses it; on what the
    server sent it raises ValueError, TypeError, KeyError or RecursionError, which the service refuses."""
    if isinstance(x, (bytes, bytearray)):
        return {"b": bytes(x).hex()}
    if isinstance(x, np.ndarray):
        return {"u64": x.astype("<u8").tobytes().hex()}
    if isinstance(x, dict):
        return {"map": [[encoded(k), encoded(v)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        return {"list": [encoded(v) for v in x]}
    return x


def decoded(x):
    if not isinstance(x, dict):
        return x
    if "b" in x:
        return bytes.fromhex(x["b"])
    if "u64" in x:
        return np.frombuffer(bytes.fromhex(x["u64"]), dtype="<u8").copy()
    if "map" in x:
        return {decoded(k): decoded(v) for k, v in x["map"]}
    return tuple(decoded(v) for v in x["list"])
