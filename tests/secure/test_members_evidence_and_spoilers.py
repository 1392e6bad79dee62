"""Review of 46b3566 playing the attacker. Each test failed while its attack worked, and passes
since the fix (the docstring says what the attack did)."""
import json
import os
import time
from types import SimpleNamespace

from flwr.app import MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto


# -- 1. a member's metrics record ends the run -----------------------------------------------------
def test_a_members_nan_partition_id_does_not_end_the_run():
    """A masked reply's metrics record with partition-id = NaN (a float: `reported` accepts it, and
    it survives Flower's serialisation) reaches SecureRounds._reports after the round's sum was
    applied: int(nan) raises ValueError (inf: OverflowError), which one_round does not catch: the
    run ends, after every honest owner was charged for the round."""
    from fedsd.app.server.secure_rounds import SecureRounds
    from fedsd.app.server.stage_exchange import reported

    reply = recorddict_from_proto(recorddict_to_proto(RecordDict({"metrics": MetricRecord(
        {"partition-id": float("nan"), "skipped": 0, "epsilon": float("inf")})})))
    assert reported(reply) is None  # fixed: a record with a value that is not finite leaves that client out
    claimed = recorddict_from_proto(recorddict_to_proto(RecordDict({"metrics": MetricRecord(
        {"partition-id": 0, "skipped": 0, "epsilon": 1e9})})))
    rounds = SecureRounds.__new__(SecureRounds)
    rounds.side = SimpleNamespace(strategy=SimpleNamespace(round_clients={}, client_epsilon={}),
                                  cfg=SimpleNamespace(epsilon=3.0))
    rounds._reports(1, [claimed], [12345])  # keyed by the protocol id, never the partition id a member claims
    # and a member's ε goes into the run's result only within [0, the run's ε] (server_app: max(client_epsilon))
    assert rounds.side.strategy.client_epsilon == {12345: 3.0}


# -- 2. evidence that costs an owner hours to check ----------------------------------------------------
def _costly_evidence(t: int, extra: int):
    """Evidence signed by a real roster member (one of the F colluders) for an earlier round of this
    run: a dealing over t + extra invented holder ids with threshold t, one 16-byte share each, all
    committed and signed. verify_blame checks it with 1 + extra Shamir combinations of t points,
    each O(t^2) pure-Python GF(2^128) products: ~2 s at t = 300, ~25 s at t = 1000, and a 4 MiB
    evidence string holds ~13,000 shares."""
    from Crypto.Protocol.SecretSharing import Shamir

    from fedsd.app import secure_sum
    from fedsd.secure import secagg_primitives
    from fedsd.secure.identity import Identity, Roster

    colluder, honest = Identity(), Identity()
    roster = Roster.of({"colluder": colluder.public, "honest": honest.public})
    rid = secure_sum.round_id(7, "exp", 1)
    holders = list(range(1000, 1000 + t + extra))
    shares = {h: os.urandom(16) for h in holders}  # any bytes: consistent or not, the cost is paid
    commits = {h: secagg_primitives._commitment(rid, colluder.id, h, "b", share) +
               secagg_primitives._commitment(rid, colluder.id, h, "s", share) for h, share in shares.items()}
    root = secagg_primitives.commit_root(rid, colluder.id, b"".join(commits[h] for h in holders))
    item = {"round": 1, "round_id": rid.hex(), "dealer": colluder.id, "part": "b", "threshold": t, "holders": holders,
            "dealing": colluder.sign(secagg_primitives._dealing_message(rid, colluder.id, holders, t, bytes(32),
                                                                        bytes(32), root)).hex(),
            "seed_digest": bytes(32).hex(), "s_public": bytes(32).hex(),
            "shares": {str(h): v.hex() for h, v in shares.items()},
            "commits": {str(h): v.hex() for h, v in commits.items()}}
    del Shamir
    return item, roster


def test_evidence_from_a_colluding_member_is_cheap_to_check():
    from fedsd.app.client.secure_owner import _checked_evidence

    item, roster = _costly_evidence(t=250, extra=1)
    evidence = json.dumps([item])
    print(f"evidence: {len(evidence)} characters, {len(item['shares'])} shares (the limit is {1 << 22})")
    started = time.perf_counter()
    _checked_evidence(evidence, (None, 7, "exp", 2), roster, {})
    took = time.perf_counter() - started
    print(f"one owner's advertise spent {took:.2f} s checking it")
    # holders outside the roster, t above the roster's size: nothing to combine
    assert took < 0.5, took


# -- 3. a spoiler that is never named ------------------------------------------------------------
def test_a_spoiler_dealing_a_consistent_sharing_of_another_secret_is_named(monkeypatch):
    """The spoiler deals shares of its self mask that lie on one polynomial, of another secret than
    the one it masked with: every check passes, the sum is noise (refused by the bound, every
    honest owner charged), and blame() names nobody, round after round: the 'one spoiled round
    per member' of docs/algorithms.md holds only for a spoiler that picks random shares."""
    from fedsd.secure import secagg_primitives
    from tests.app.server.test_member_reports import _spoiled_round

    real = secagg_primitives.split_secret  # the round abandoned before any sum (it asserts so), the spoiler named there
    server, _, _, spoiler, _ = _spoiled_round(monkeypatch, deal=lambda s, t, h: real(os.urandom(len(s)), t, h))
    assert spoiler in server.evidence  # failed before the fix: nobody named


def test_an_honest_dealer_cannot_be_framed_by_resplitting_its_signed_dealing():
    """A review playing the attacker moved one byte of an honest dealer's signed seed digest into
    its s key: the dealing signs the two side by side, so the signature still verified while the
    honest shares 'rebuilt another secret', and every owner would have barred the dealer. Each is
    32 bytes now."""
    import numpy as np

    from fedsd.secure import secagg, secagg_primitives, secagg_server
    from fedsd.secure.identity import Identity, Roster
    from fedsd.secure.secagg_primitives import verify_blame

    rid, n = b"honest-round", 5
    identities = [Identity() for _ in range(n)]
    roster = Roster.of({f"c{k}": i.public for k, i in enumerate(identities)})
    clients = {i.id: secagg.SecAggClient(i.id, rid, identity=i, roster=roster) for i in identities}
    xs = {i: np.random.default_rng(1).integers(0, 2 ** 30, 64, dtype=np.uint64) for i in clients}
    server = secagg_server.SecAggServer(rid, list(clients), 64)
    server.collect_keys({i: c.advertise(**server.setup(i)) for i, c in clients.items()})
    server.collect_shares({i: c.share_keys(server.keys_for(i)) for i, c in clients.items()})
    server.collect_masked({i: c.masked_input(*server.shares_for(i).values(), xs[i]) for i, c in clients.items()})
    signatures = server.route_confirmations({i: c.confirm(**server.unmask_request(i)) for i, c in clients.items()})
    answers = {i: c.unmask(signatures[i]) for i, c in clients.items()}
    server.finish(answers)
    dealer = sorted(clients)[0]
    good = server._good_shares(dealer, "b", secagg_server._index(answers))
    chosen = {h: good[h] for h in sorted(good)[:server.threshold]}
    digest, s_public = server.dealings[dealer][1], bytes(server.keys[dealer]["s"])
    evidence = {"round_id": rid.hex(), "dealer": dealer, "part": "b", "threshold": server.threshold,
                "holders": server.holders[dealer], "dealing": server.dealings[dealer][0].hex(),
                "shares": {str(h): v.hex() for h, v in chosen.items()},
                "commits": {str(h): server.commits[dealer][h].hex() for h in server.holders[dealer]}}
    framed = dict(evidence, seed_digest=digest[:-1].hex(), s_public=(digest[-1:] + s_public).hex())
    assert not verify_blame(framed, roster.key(dealer))
    # the evidence is well formed: the same shares with a made-up seed digest do rebuild "another secret"
    # once the dealing is re-signed over it, which only the dealer's key does
    dealing = secagg_primitives._dealing_message(rid, dealer, server.holders[dealer], server.threshold, bytes(32),
                                                 s_public, secagg_primitives.commit_root(
                                                     rid, dealer, b"".join(server.commits[dealer][h]
                                                                          for h in server.holders[dealer])))
    signer = next(i for i in identities if i.id == dealer)
    resigned = dict(evidence, dealing=signer.sign(dealing).hex(), seed_digest=bytes(32).hex(), s_public=s_public.hex())
    assert verify_blame(resigned, roster.key(dealer))
    assert not verify_blame(dict(evidence, seed_digest=digest.hex(), s_public=s_public.hex()), roster.key(dealer))
