"""The multi-round protocol (fedsd.secure.secagg_runs, fedsd.secure.secagg_runs_server), in memory,
with a harness that plays the server's every choice. Each attack test names the defence it
checks (docs/design/multi-round-secure-aggregation.md, §7 and §13, by number); each fails with
that defence taken out."""
import hashlib

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedsd.secure.identity import Identity, Roster
from fedsd.secure.secagg_primitives import (ProtocolError, _derive, _info, _public, combine_secret, expand_mask,
                                            lowest_threshold, pairwise_sign, round_digest, round_tag, run_tag,
                                            self_mask_key)
from fedsd.secure.secagg_runs import BATCH, Counters, RunMember
from fedsd.secure.secagg_runs_server import RunServer
from fedsd.secure.secagg_server import RoundAbandoned

D = 64
DIGEST = round_digest(b"settings", [np.arange(4, dtype=np.float32)])


class Federation:
    """n owners and an honest server, with every message in reach of a test that bends it."""

    def __init__(self, n: int = 7, t: int = 2, f: int = 0, threshold: int | None = None, each_t: dict | None = None):
        keys = [Identity() for _ in range(n)]
        self.roster = Roster.of({f"owner{k}": key.public for k, key in enumerate(keys)})
        self.tau = run_tag(b"run-1|exp-1|round-0")
        self.members = {k.id: RunMember(k, self.roster, self.tau, (each_t or {}).get(i, t), f)
                        for i, k in enumerate(keys)}
        self.ids = sorted(self.members)
        self.threshold = threshold or lowest_threshold(n, f)
        self.server = RunServer(self.tau, self.ids, self.threshold)
        self.rng = np.random.default_rng(0)
        self.messages = {i: 0 for i in self.ids}  # requests each owner answered after the setup

    def set_up(self, batch: int = 1, deliver_to=None) -> None:
        for m in self.members.values():
            m.setup(self.ids, self.threshold)
        self.deal(batch, deliver_to)

    def deal(self, batch: int, deliver_to=None) -> None:
        """Every member deals `batch`; each holder (of `deliver_to(dealer)`, else all) checks and acknowledges."""
        channels = {i: m.channel_key(batch) for i, m in self.members.items()}
        for dealer, m in self.members.items():
            for holder, delivery in self.server.keep_dealing(dealer, m.deal(batch, channels)).items():
                if deliver_to is None or holder in deliver_to(dealer):
                    ack = self.members[holder].deliver(dealer, batch, delivery)
                    self.server.keep_ack(dealer, batch, holder, ack)

    def inputs(self) -> dict[int, np.ndarray]:
        return {i: self.rng.integers(0, 2 ** 40, D, dtype=np.uint64) for i in self.ids}

    def masked(self, r: int, cohort: list[int], xs: dict, digest: dict | None = None, senders=None) -> dict[int, dict]:
        """E1 to `senders` (all the cohort unless given): each owner's y and receipt."""
        out = {}
        for i in cohort if senders is None else senders:
            m = self.members[i]
            m.admit(r, cohort, (digest or {}).get(i, DIGEST), self.server.acks_for(r, cohort))
            out[i] = m.mask(r, xs[i])
            self.messages[i] += 1
        return out

    @staticmethod
    def receipts(sent: dict[int, dict], digest: bytes = DIGEST, needed: dict | None = None) -> dict[int, dict]:
        return {i: {"sig": s["receipt"], "digest": digest, "needed": (needed or {}).get(i, 2),
                    "y_hash": hashlib.sha256(s["y"].tobytes()).digest()} for i, s in sent.items()}

    def round(self, r: int, xs: dict, drop=(), silent=()) -> np.ndarray:
        """One round: E1 from the cohort less `drop`; the fast unmask (E2) when nobody dropped, else
        the view (E2') and its unmask (E3); `silent` holders do not answer the unmask."""
        survivors = [i for i in self.ids if i not in drop]
        sent = self.masked(r, self.ids, xs, senders=survivors)  # the dropped ones never answer E1
        receipts = self.receipts(sent, needed={i: self.members[i].needed for i in sent})
        holders = [h for h in self.ids if h not in silent]
        if not drop:
            answers = {h: self.members[h].unmask(r, self.ids, receipts) for h in holders}
        else:
            signatures = {h: self.members[h].view(r, survivors, sorted(drop), receipts) for h in holders}
            answers = {h: self.members[h].unmask_view(r, signatures) for h in holders}
        for h in holders:
            self.messages[h] += 1 + bool(drop)
        return self.server.finish(r, {i: s["y"] for i, s in sent.items()}, sorted(drop), answers)


def _sum(xs, members):
    total = np.zeros(D, dtype=np.uint64)
    for i in members:
        total += xs[i]
    return total


def test_a_run_sums_every_round_in_two_exchanges_and_survives_a_dropout_and_a_rejoin():
    """Set up once; rounds 1-3 sum exactly; round 2 loses one owner (three exchanges, the dropped
    one's key rebuilt), and that owner rejoins round 3 with nothing to redo (§7 tests 7 and 14)."""
    fed = Federation()
    fed.set_up()
    gone = fed.ids[3]
    for r, drop in ((1, ()), (2, (gone,)), (3, ())):
        xs = fed.inputs()
        before = dict(fed.messages)
        total = fed.round(r, xs, drop=drop)
        assert np.array_equal(total, _sum(xs, [i for i in fed.ids if i not in drop]))
        steps = {i: fed.messages[i] - before[i] for i in fed.ids}
        # the dropped owner, still a holder, signs the view and answers it: no input, two requests
        assert steps == {i: (2 if not drop else (2 if i == gone else 3)) for i in fed.ids}


def test_silent_holders_up_to_the_slack_are_survived_and_one_more_abandons():
    fed = Federation(n=7, f=1)  # T = 5 of 7: two holders may be silent
    fed.set_up()
    xs = fed.inputs()
    assert np.array_equal(fed.round(1, xs, silent=fed.ids[:2]), _sum(xs, fed.ids))
    with pytest.raises(RoundAbandoned, match="below the threshold"):
        fed.round(2, fed.inputs(), silent=fed.ids[:3])


def test_round_material_replayed_in_a_later_round_is_refused():
    """§7 test 1: round r's E1, E2 and shares presented in round r+1, or in r again."""
    fed = Federation()
    fed.set_up()
    xs = fed.inputs()
    sent = fed.masked(1, fed.ids, xs)
    receipts = fed.receipts(sent)
    answers = {h: fed.members[h].unmask(1, fed.ids, receipts) for h in fed.ids}
    first = fed.ids[0]
    with pytest.raises(ProtocolError, match="answered or viewed"):
        fed.members[first].unmask(1, fed.ids, receipts)  # the same request again
    fed.members[first].admit(1, fed.ids, DIGEST, fed.server.acks_for(1, fed.ids))  # E1 again: its reply as it was
    assert np.array_equal(fed.members[first].mask(1, xs[first] + np.uint64(1))["y"], sent[first]["y"])
    fed.masked(2, fed.ids, xs)
    with pytest.raises(ProtocolError, match="no receipt"):  # round 1's receipts as round 2's
        fed.members[first].unmask(2, fed.ids, receipts)
    with pytest.raises(ProtocolError, match="behind round 2"):
        fed.members[first].admit(1, fed.ids, DIGEST, fed.server.acks_for(1, fed.ids))
    rid2 = round_tag(fed.tau, 2)
    replayed = {h: {"b": {j: a["b"][j] for j in a["b"]}, "s": {}} for h, a in answers.items()}
    with pytest.raises(RoundAbandoned, match="good shares"):  # round 1's shares fail round 2's commitments
        fed.server.finish(2, {i: np.zeros(D, dtype=np.uint64) for i in fed.ids}, [], replayed)
    assert rid2 != round_tag(fed.tau, 1)


def test_a_second_masked_input_for_one_round_is_refused_and_a_lost_reply_is_resent_as_it_was():
    """§7 test 2: y − y' would be x − x' with no unmask at all. A resend is the same bytes."""
    fed = Federation()
    fed.set_up()
    m = fed.members[fed.ids[0]]
    acks = fed.server.acks_for(1, fed.ids)
    m.admit(1, fed.ids, DIGEST, acks)
    first = m.mask(1, np.ones(D, dtype=np.uint64))
    again = m.mask(1, np.full(D, 7, dtype=np.uint64))  # another vector: the reply as it was
    assert np.array_equal(first["y"], again["y"]) and first["receipt"] == again["receipt"]
    restarted = RunMember(m.identity, fed.roster, fed.tau, counters=m.counters)  # same record, a new process
    restarted.setup(fed.ids, fed.threshold)
    with pytest.raises(ProtocolError, match="masked, answered or viewed"):
        restarted.admit(1, fed.ids, DIGEST, acks)


def _claimed_dropped(fed, target, fast_holders, view_holders):
    xs = fed.inputs()
    sent = fed.masked(1, fed.ids, xs)
    receipts = fed.receipts(sent)
    fast = {}
    for h in fast_holders:
        fast[h] = fed.members[h].unmask(1, fed.ids, receipts)
    others = [i for i in fed.ids if i != target]
    signed = {}
    for h in view_holders:
        try:
            signed[h] = fed.members[h].view(1, others, [target], receipts)
        except ProtocolError:
            pass
    s_shares = {}
    for h in signed:
        try:
            s_shares[h] = fed.members[h].unmask_view(1, signed)["s"][target]
        except ProtocolError:
            pass
    b_shares = {h: a["b"][target] for h, a in fast.items()}
    return b_shares, s_shares, signed


def test_a_submitter_claimed_dropped_loses_its_pairwise_or_its_self_mask_never_both():
    """§7 tests 3 and 5: the server takes the target's y, then opens the fast path with some
    holders and a view naming the target dropped with the others. A holder that answered fast
    signs no view, the target signs no view dropping itself, and 2T > N + F: one kind stays below T."""
    for split in range(1, 7):
        fed = Federation(n=7)
        fed.set_up()
        target = fed.ids[0]
        fast, view = fed.ids[:split], fed.ids[split:]
        b_shares, s_shares, signed = _claimed_dropped(fed, target, fast, view + fast)
        assert set(signed) <= set(view) - {target}
        assert len(b_shares) < fed.threshold or len(s_shares) < fed.threshold
    fed = Federation(n=7)
    fed.set_up()
    sent = fed.masked(1, fed.ids, fed.inputs())
    with pytest.raises(ProtocolError, match="named dropped in a round it sent its input for"):
        fed.members[fed.ids[0]].view(1, fed.ids[1:], fed.ids[:1], fed.receipts(sent))


def test_dropped_in_one_round_survived_in_another_unmasks_neither():
    """§7 test 4: the server collects the target's s of round 1 (dropped there) and its b of round 2
    (survived): each masks its own round only; neither input comes out."""
    fed = Federation()
    fed.set_up()
    target = fed.ids[2]
    xs1 = fed.inputs()
    others = [i for i in fed.ids if i != target]
    sent1 = fed.masked(1, fed.ids, xs1)  # the target sends its input, then the server calls it dropped
    receipts1 = fed.receipts(sent1)
    survivors_receipts = {i: receipts1[i] for i in others}
    signed = {h: fed.members[h].view(1, others, [target], survivors_receipts) for h in others}  # target refuses
    s_target = {h: fed.members[h].unmask_view(1, signed)["s"][target] for h in others}
    xs2 = fed.inputs()
    sent2 = fed.masked(2, fed.ids, xs2)
    answers2 = {h: fed.members[h].unmask(2, fed.ids, fed.receipts(sent2)) for h in fed.ids}
    s1 = X25519PrivateKey.from_private_bytes(combine_secret(s_target, fed.ids, fed.threshold))
    b2 = combine_secret({h: a["b"][target] for h, a in answers2.items()}, fed.ids, fed.threshold)
    for r, y, x in ((1, sent1[target]["y"], xs1[target]), (2, sent2[target]["y"], xs2[target])):
        guess = y - expand_mask(self_mask_key(b2), D)  # the self mask of round 2, tried on both
        for j in others:  # and round 1's pairwise masks, from the rebuilt key
            public = _public(fed.server._entry(j, 1)["s_public"], "s")
            mask = expand_mask(_derive(s1.exchange(public), _info(round_tag(fed.tau, 1), "mask",
                                                                  min(j, target), max(j, target))), D)
            guess = guess - mask if pairwise_sign(target, j) > 0 else guess + mask
        assert not np.array_equal(guess, x)
    assert fed.members[target].counters.submitted == 2


def test_a_view_meets_the_strictest_survivors_t():
    """§13 test 15 (the review's finding 1): N = 10, T = 7, F = 1; the target asks t = 8 (9 inputs
    with f), the others t = 5. The server opens a view of 7 survivors, the target among them, with
    the 3 it never asked as dropped. Every holder sees the target's receipt (needed 9) and refuses."""
    fed = Federation(n=10, t=5, f=1, threshold=7, each_t={0: 8})
    fed.set_up()
    target = next(m for m in fed.members.values() if m.min_cohort == 8)
    others = [i for i in fed.ids if i != target.me]
    survivors = sorted([target.me] + others[:6])
    dropped = others[6:]
    xs = fed.inputs()
    sent = fed.masked(1, fed.ids, xs, senders=survivors)
    receipts = fed.receipts(sent, needed={i: fed.members[i].needed for i in sent})
    for h in fed.ids:
        with pytest.raises(ProtocolError, match="below the 9"):
            fed.members[h].view(1, survivors, dropped, receipts)


def test_receipts_under_other_models_or_cohorts_are_not_unmasked():
    """§7 test 11, §13 test 18: owners sent different models sign different round digests; a
    holder shown them together refuses, and a receipt for another cohort does not verify."""
    fed = Federation()
    fed.set_up()
    xs = fed.inputs()
    odd = fed.ids[1]
    other = round_digest(b"settings", [np.zeros(4, dtype=np.float32)])
    sent = fed.masked(1, fed.ids, xs, digest={odd: other})
    receipts = fed.receipts(sent)
    receipts[odd]["digest"] = other
    with pytest.raises(ProtocolError, match="different settings or models"):
        fed.members[fed.ids[0]].unmask(1, fed.ids, receipts)
    with pytest.raises(ProtocolError, match="no receipt"):
        fed.members[fed.ids[0]].unmask(1, fed.ids[:-1], fed.receipts(sent))


def test_a_view_counts_receipts_never_list_length():
    """§7 test 12: survivors without receipts (they sent nothing) do not count."""
    fed = Federation()
    fed.set_up()
    xs = fed.inputs()
    few = fed.ids[:2]
    sent = fed.masked(1, fed.ids, xs, senders=few)
    with pytest.raises(ProtocolError, match="no receipt"):
        fed.members[fed.ids[3]].view(1, fed.ids[:-1], fed.ids[-1:], fed.receipts(sent))


def test_an_owner_is_charged_only_for_cohorts_whose_shares_are_held():
    """§13 test 17 (finding 3): a member whose batch fewer than T + f holders acknowledged (the
    server withheld it, or the dealer sent bad ciphertexts) seats no round: E1 is refused before
    the charge, naming it."""
    fed = Federation(n=7, f=1)
    spoiler = None

    def holders_of(dealer):
        return fed.ids if dealer != spoiler else fed.ids[:fed.threshold]  # T acks, not T + f
    spoiler = sorted(fed.members)[4]
    fed.set_up(deliver_to=holders_of)
    m = fed.members[fed.ids[0]]
    with pytest.raises(ProtocolError, match=f"{fed.threshold} holders acknowledged .*culprit: {spoiler}"):
        m.admit(1, fed.ids, DIGEST, fed.server.acks_for(1, fed.ids))
    assert m.counters.submitted == 0
    forged = fed.server.acks_for(1, fed.ids)
    forged[spoiler][fed.ids[-1]] = forged[spoiler][fed.ids[0]]  # one holder's ack passed off as another's
    with pytest.raises(ProtocolError, match="holders acknowledged"):
        m.admit(1, fed.ids, DIGEST, forged)


def test_bad_batch_shares_are_refused_on_delivery_and_a_second_dealing_is_equivocation():
    """§7 tests 10 and 13: a share unlike its commitment is refused on delivery (no ack); a second,
    different batch from one dealer is refused and the first kept."""
    fed = Federation()
    for m in fed.members.values():
        m.setup(fed.ids, fed.threshold)
    channels = {i: m.channel_key(1) for i, m in fed.members.items()}
    dealer, holder = fed.ids[0], fed.ids[1]
    deliveries = fed.server.keep_dealing(dealer, fed.members[dealer].deal(1, channels))
    bent = dict(deliveries[holder], to=dict(deliveries[holder]["to"]))
    bent["to"]["ciphertext"] = bent["to"]["ciphertext"][:-1] + bytes([bent["to"]["ciphertext"][-1] ^ 1])
    with pytest.raises(ProtocolError, match="not for this run, batch and holder"):
        fed.members[holder].deliver(dealer, 1, bent)
    fed.members[holder].deliver(dealer, 1, deliveries[holder])
    # the same dealer dealing batch 1 again (a second process with its key), for another story
    twin = RunMember(fed.members[dealer].identity, fed.roster, fed.tau)
    twin.setup(fed.ids, fed.threshold)
    twin._channel[1] = fed.members[dealer]._channel[1]
    second = RunServer(fed.tau, fed.ids, fed.threshold).keep_dealing(dealer, twin.deal(1, channels))
    with pytest.raises(ProtocolError, match="equivocation"):
        fed.members[holder].deliver(dealer, 1, second[holder])


def test_a_masked_input_after_its_round_was_opened_is_refused():
    """§13 test 19 (finding 5): an owner that viewed or answered round r (as a holder) sends no
    input for r after: its s_r may be out."""
    fed = Federation()
    fed.set_up()
    late, xs = fed.ids[0], fed.inputs()
    others = fed.ids[1:]
    sent = fed.masked(1, fed.ids, xs, senders=others)
    fed.members[late].view(1, others, [late], fed.receipts(sent))
    with pytest.raises(ProtocolError, match="masked, answered or viewed"):
        fed.members[late].admit(1, fed.ids, DIGEST, fed.server.acks_for(1, fed.ids))


def test_a_holder_signs_one_view_a_round_and_answers_no_round_behind():
    """R1 and R4: one view of a round, no fast answer after it, and nothing of a round once a later
    one was asked about."""
    fed = Federation()
    fed.set_up()
    xs = fed.inputs()
    h = fed.members[fed.ids[0]]
    receipts = fed.receipts(fed.masked(1, fed.ids, xs, senders=fed.ids[:-2]))
    h.view(1, fed.ids[:-2], fed.ids[-2:], receipts)
    with pytest.raises(ProtocolError, match="another view"):
        h.view(1, fed.ids[:-3], fed.ids[-3:], receipts)
    with pytest.raises(ProtocolError, match="answered or viewed"):
        h.unmask(1, fed.ids[:-2], receipts)
    h.admit(2, fed.ids, DIGEST, fed.server.acks_for(2, fed.ids))
    with pytest.raises(ProtocolError, match="behind round 2"):
        h.unmask_view(1, {})


def _sits_out(fed: Federation, stranger: RunMember) -> None:
    """A member with its record's counters but none of its secrets: it masks nothing in round 1 and
    cannot be made to deal batch 1 again."""
    stranger.setup(fed.ids, fed.threshold)
    with pytest.raises(ProtocolError, match="holds no secrets for round 1"):
        stranger.admit(1, fed.ids, DIGEST, fed.server.acks_for(1, fed.ids))
    channels = {i: fed.members[i].channel_key(1) for i in fed.ids}
    channels[stranger.me] = stranger.channel_key(1)
    with pytest.raises(ProtocolError, match="dealt already"):
        stranger.deal(1, channels)


def test_a_restarted_owner_without_its_secrets_sits_rounds_out_and_never_deals_twice():
    """§7 test 9 in memory: the record (counters) survives, the secrets do not: the owner sits the
    batch out, cannot be made to deal it again, and masks nothing twice."""
    fed = Federation()
    fed.set_up()
    m = fed.members[fed.ids[0]]
    restarted = RunMember(m.identity, fed.roster, fed.tau, counters=m.counters)
    _sits_out(fed, restarted)
    assert m.counters.dealt == BATCH


def _kept_through(member: RunMember, wrap_key: bytes, key_now: bytes | None = None) -> RunMember:
    """The member as a restarted service has it: its counters from the record, its state unsealed."""
    again = RunMember(member.identity, member.roster, member.tau, member.min_cohort, member.max_colluders,
                      counters=Counters(**vars(member.counters)))
    again.unseal(member.sealed(wrap_key), key_now or wrap_key)
    return again


def test_a_restarted_owner_goes_on_from_its_sealed_state_and_answers_its_rounds_once():
    """§7 test 8 in memory: a service restarted between E1 and E2 (and after E2) answers round 1's
    unmask once from its kept shares, and masks round 2 from its kept secrets."""
    fed, key = Federation(), bytes(range(32))
    fed.set_up()
    xs = fed.inputs()
    sent = fed.masked(1, fed.ids, xs)
    fed.members = {i: _kept_through(m, key) for i, m in fed.members.items()}
    receipts = fed.receipts(sent)
    answers = {h: fed.members[h].unmask(1, fed.ids, receipts) for h in fed.ids}
    assert np.array_equal(fed.server.finish(1, {i: s["y"] for i, s in sent.items()}, [], answers), _sum(xs, fed.ids))
    fed.members = {i: _kept_through(m, key) for i, m in fed.members.items()}
    with pytest.raises(ProtocolError, match="answered or viewed"):
        fed.members[fed.ids[0]].unmask(1, fed.ids, receipts)
    xs2 = fed.inputs()
    assert np.array_equal(fed.round(2, xs2), _sum(xs2, fed.ids))


def test_a_folder_copied_without_its_record_holds_no_usable_secret():
    """§13 test 16 (the review's finding 2): what a member keeps opens only under its owner's wrap
    key, which lives in the record outside the state folder; a copy (a clone with a record of its
    own) cannot unseal it, deals nothing again, and masks nothing."""
    fed, key = Federation(), bytes(range(32))
    fed.set_up()
    m = fed.members[fed.ids[0]]
    blob = m.sealed(key)
    assert b"holders" not in blob and all(b not in blob for b, _ in m._dealt.values())
    clone = RunMember(m.identity, fed.roster, fed.tau, counters=Counters(dealt=m.counters.dealt))
    with pytest.raises(ProtocolError, match="does not open under this owner's wrap key"):
        clone.unseal(blob, bytes(32))
    _sits_out(fed, clone)


def test_the_record_keeps_a_runs_counters_outside_the_folder_and_never_lowers_them(tmp_path):
    """A folder restored behind its record takes the record's counters (its older secrets are then
    never used nor revealed); the wrap key is made once, 0600, in the record folder."""
    from fedsd.files.state_folder import state_folder
    from fedsd.privacy.owner_record import Records

    records, state = Records.open(tmp_path / "records"), state_folder(tmp_path / "state")
    key = records.wrap_key(state)
    assert records.wrap_key(state) == key and len(key) == 32
    assert not any(p.name.startswith("wrap-") for p in (tmp_path / "state").iterdir())
    assert all(p.stat().st_mode & 0o077 == 0 for p in (tmp_path / "records").glob("wrap-*"))
    with records.run_counters(state, "run|exp", {}) as c:
        c.update(submitted=3, answered=3, dealt=8, seen=3, viewed=[2, "ab"])
    with records.run_counters(state, "run|exp", {"submitted": 1, "dealt": 8}) as c:  # a folder from round 1
        assert (c["submitted"], c["answered"], c["viewed"]) == (3, 3, [2, "ab"])
        c.update(submitted=1)  # lowered in the block: the record keeps the highest
    with records.run_counters(state, "run|exp", {}) as c:
        assert c["submitted"] == 3
    with records.run_counters(state, "other|exp", {}) as c:
        assert c["submitted"] == 0


# -- found by a review playing the server with F members against this protocol ----------------------
def test_a_receipt_resplit_by_the_server_does_not_verify():
    """The server moved each receipt's round digest into its y digest (digest=b"", y_hash=digest‖y):
    with fields of any length every signature still verified and owners sent different models were
    opened together. Each field is 32 bytes now."""
    fed = Federation()
    fed.set_up()
    other = round_digest(b"settings", [np.zeros(4, dtype=np.float32)])
    digests = {i: (DIGEST if i == fed.ids[0] else other) for i in fed.ids}
    sent = fed.masked(1, fed.ids, fed.inputs(), digest=digests)
    honest = {i: dict(e, digest=digests[i]) for i, e in fed.receipts(sent).items()}
    split = {i: dict(e, digest=b"", y_hash=e["digest"] + e["y_hash"]) for i, e in honest.items()}
    for receipts in (honest, split):
        with pytest.raises(ProtocolError, match="different settings or models|no receipt"):
            fed.members[fed.ids[1]].unmask(1, fed.ids, receipts)


def test_a_run_that_f_silent_members_could_stop_is_refused_at_setup():
    """E1 seats a member once T + f holders acknowledged its shares: with T + 2f above N, f members
    withholding their acknowledgements kept every owner out of every round (N = 10, f = 2, T = 7)."""
    fed = Federation(n=10, f=2, threshold=7)
    with pytest.raises(ProtocolError, match=r"threshold 7 \+ twice 2 .* above the 10 holders"):
        fed.set_up()
    fed = Federation(n=13, f=2)  # T = 9: 9 + 4 ≤ 13
    fed.set_up(deliver_to=lambda dealer: fed.ids[:-2])  # two members never acknowledge anything
    xs = fed.inputs()
    assert np.array_equal(fed.round(1, xs, drop=fed.ids[-2:], silent=fed.ids[-2:]), _sum(xs, fed.ids[:-2]))


def test_a_dealer_giving_holders_two_entries_for_one_round_is_never_seated():
    """A colluding dealer gave half the holders another signed s key for round 1 under the one root
    they acknowledged; every owner was charged and the round's sum came out wrong, no one named. The
    root now covers the entries: the other half's acknowledgements are of no root, and E1 refuses."""
    from fedsd.secure.secagg_primitives import _dealing_message, _raw

    fed = Federation(n=7)
    colluder = fed.ids[-1]
    for m in fed.members.values():
        m.setup(fed.ids, fed.threshold)
    channels = {i: m.channel_key(1) for i, m in fed.members.items()}
    for dealer, m in fed.members.items():
        for k, (holder, delivery) in enumerate(fed.server.keep_dealing(dealer, m.deal(1, channels)).items()):
            if dealer == colluder and k % 2:
                other = _raw(X25519PrivateKey.generate().public_key())
                entry = dict(delivery["entries"][1], s_public=other, sig=m.identity.sign(_dealing_message(
                    round_tag(fed.tau, 1), colluder, fed.ids, fed.threshold, delivery["entries"][1]["digest"], other)))
                delivery = dict(delivery, entries={**delivery["entries"], 1: entry})
            try:
                fed.server.keep_ack(dealer, 1, holder, fed.members[holder].deliver(dealer, 1, delivery))
            except ProtocolError as e:
                assert "not signed by it" in str(e) and dealer == colluder
    honest = fed.ids[0]
    with pytest.raises(ProtocolError, match=f"holders acknowledged the shares of .*culprit: {colluder}"):
        fed.members[honest].admit(1, fed.ids, DIGEST, fed.server.acks_for(1, fed.ids))
    assert fed.members[honest].counters.submitted == 0


def test_hostile_fields_are_refused_as_protocol_errors_and_a_batch_has_one_channel_key():
    fed = Federation(n=5)
    fed.set_up()
    me, dealer = fed.members[fed.ids[0]], fed.ids[1]
    channels = {i: m.channel_key(2) for i, m in fed.members.items()}
    good = fed.server.keep_dealing(dealer, fed.members[dealer].deal(2, channels))[me.me]
    for call in (lambda: me.deal(3, {**channels, "x": {}}),
                 lambda: me.deliver(dealer, 2, dict(good, list_hashes={**good["list_hashes"], "x": b""})),
                 lambda: me.deliver(dealer, 2, dict(good, entries={**good["entries"], "x": {}})),
                 lambda: me.deliver([dealer], 2, good), lambda: me.mask([1], np.zeros(3, np.uint64)),
                 lambda: me.channel_key("1")):
        with pytest.raises(ProtocolError):
            call()
    xs = fed.inputs()
    sent = fed.masked(1, fed.ids, xs)
    answers = {h: fed.members[h].unmask(1, fed.ids, fed.receipts(sent)) for h in fed.ids}
    answers[fed.ids[-1]] = {"b": []}  # a member's malformed answer: set aside and named
    assert np.array_equal(fed.server.finish(1, {i: s["y"] for i, s in sent.items()}, [], answers), _sum(xs, fed.ids))
    assert "not a map" in fed.server.culprits[fed.ids[-1]]


def test_a_batchs_channel_key_is_erased_once_the_next_batch_is_delivered():
    """The server keeps every ciphertext it routed: with batch 1's channel key kept, a holder's
    answered rounds would decrypt again from the server's copy."""
    fed = Federation(n=5)
    fed.set_up()
    h = fed.members[fed.ids[0]]
    assert 1 in h._channel
    fed.deal(2)
    assert 1 not in h._channel and 2 in h._channel


def test_what_a_member_keeps_of_a_batch_is_gone_once_the_next_batch_plays():
    """A member's kept state does not grow with the run: a batch's dealing, roots, entries and
    acknowledgements go once a round of the next batch is admitted."""
    fed = Federation(n=5)
    fed.set_up()
    for r in range(1, BATCH + 2):
        if r == BATCH + 1:
            fed.deal(2)
        xs = fed.inputs()
        assert np.array_equal(fed.round(r, xs), _sum(xs, fed.ids))
    m = fed.members[fed.ids[0]]
    assert set(m._sent) == {2} and {b for _, b in m._roots} == {2} and min(r for _, r in m._entries) == BATCH + 1


def test_an_in_process_run_started_mid_simulation_counts_its_rounds_from_there():
    """A simulation resumed at round 20 sets up its run there: its secrets are dealt one batch ahead of
    its own first round, not refused as 20 rounds ahead."""
    from fedsd.secure.distributed_step import run_roster
    from fedsd.secure.secagg_runs_server import InProcessRun

    run = InProcessRun(*run_roster(range(3)), min_cohort=3)
    xs = {k: np.full(D, k + 1, dtype=np.uint64) for k in range(3)}
    for r in (20, 21):
        total, _ = run.round(r, {k: (lambda v=v: v) for k, v in xs.items()}, D)
        assert np.array_equal(total, np.full(D, 6, dtype=np.uint64))


def test_a_holder_gone_for_good_sits_the_next_batch_out_and_the_others_go_on():
    """A batch is dealt to the holders there (this owner and at least T + f of them), not to every
    holder: one gone for good would otherwise stop the run at its next batch. Fewer is refused."""
    fed = Federation(n=7)
    fed.set_up()
    gone, here = fed.ids[-1], fed.ids[:-1]
    channels = {i: fed.members[i].channel_key(2) for i in here}
    for m in fed.members.values():
        m.counters.seen = BATCH  # the run is at round 8, batch 1's last
    few = {i: channels[i] for i in here[:fed.threshold - 1]}
    with pytest.raises(ProtocolError, match="at least 5 \\+ 0 of the run's holders"):
        fed.members[here[0]].deal(2, few)
    for dealer in here:
        for holder, delivery in fed.server.keep_dealing(dealer, fed.members[dealer].deal(2, channels)).items():
            fed.server.keep_ack(dealer, 2, holder, fed.members[holder].deliver(dealer, 2, delivery))
    assert gone not in fed.server.keep_dealing(here[0], fed.members[here[0]].deal(2, channels))
    r, xs = BATCH + 1, fed.inputs()
    sent = fed.masked(r, here, xs)
    receipts = fed.receipts(sent)
    answers = {h: fed.members[h].unmask(r, here, receipts) for h in here}
    total = fed.server.finish(r, {i: s["y"] for i, s in sent.items()}, [], answers)
    assert np.array_equal(total, sum((xs[i] for i in here[1:]), xs[here[0]]))


# -- found by a review playing the server against the subset dealing and setup's start ----------------
def test_a_server_raising_the_round_at_setup_erases_what_only_earlier_rounds_could_use():
    """Setup's `start` raised `seen` and kept everything: a server repeating setup, channel key and deal
    without a round piled up 248 dealt rounds' secrets (0.6 MB sealed, re-sealed every message)."""
    fed = Federation(n=7, f=1)
    fed.set_up()
    target = fed.members[fed.ids[0]]
    for k in range(1, 10):
        for m in fed.members.values():
            m.setup(fed.ids, fed.threshold, k * BATCH + 1)
        target.deal(k + 1, {i: fed.members[i].channel_key(k + 1) for i in fed.ids})
    assert sorted(target._dealt) == list(range(9 * BATCH + 1, 10 * BATCH + 1))  # batch 10's rounds alone
    assert sorted(target._sent) == [10] and sorted(target._channel) == [10]
    assert len(target.sealed(b"k" * 32)) < 40_000


@pytest.mark.parametrize("start", [True, 0, -5, "9", 9.0, None, 1 << 31 + 1, 10 ** 30])
def test_a_hostile_start_at_setup_is_refused_and_changes_nothing(start):
    fed = Federation(n=7, f=1)
    m = fed.members[fed.ids[0]]
    with pytest.raises(ProtocolError, match="setup: the round is a positive integer"):
        m.setup(fed.ids, fed.threshold, start)
    assert m.counters.seen == 0 and not m.holders
