"""Secure aggregation on the ring (docs/design/sparse-secure-aggregation.md): each owner derives
every neighbourhood from the round and cohort, and refuses one the server names otherwise; the
ring's numbers (k, t, F) are signed in every advert; its threshold is at least t + F; and a holder
reveals its share of an owner's self mask only where that owner's signed M names it (fix (i)).
Each defence has a test here that fails without it; the review's attack C is replayed end to end."""
from __future__ import annotations

import dataclasses
import math
import secrets

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedsd.errors import ConfigError
from fedsd.secure.distributed_step import secure_round
from fedsd.secure.identity import Identity, Roster
from fedsd.secure.ring import graph_parameters, neighbourhoods, ring_order, sparse_threshold
from fedsd.secure.secagg import SecAggClient
from fedsd.secure.secagg_primitives import (NONCE, SELF_SEED_BYTES, ProtocolError, _advert, _dealing_message, _derive,
                                            _info, _public, _raw, combine_secret, commit_root, commitments, expand_mask,
                                            graph_tag, masked_with_message, pack_dealing, pairwise_sign, seed_digest,
                                            self_mask_key, split_secret)
from fedsd.secure.secagg_server import RoundAbandoned, SecAggServer
from fedsd.settings.federation import FedConfig
from fedsd.simulation.secure_federation import secure_graph
from tests.secure.test_roster_neighbourhoods_and_silence import Colluder

D = 64


def federation(n: int):
    identities = [Identity() for _ in range(n)]
    return identities, Roster.of({f"owner-{k}": i.public for k, i in enumerate(identities)})


def clients_of(rid, identities, roster, t, f, skip=()):
    return {i.id: SecAggClient(i.id, rid, min_cohort=t, max_colluders=f, identity=i, roster=roster)
            for i in identities if i.id not in skip}


# -- the ring's numbers and neighbourhoods -------------------------------------------------------
def test_a_neighbourhood_not_from_the_rings_derivation_is_refused_before_anything_is_drawn():
    """The server names an owner a neighbourhood of the right size, its own members in it, other
    than the one every owner derives (the attack on server-chosen neighbourhoods): refused at
    advertise, before any key is made."""
    rid, (identities, roster) = b"ring-1", federation(40)
    cohort = sorted(i.id for i in identities)
    k, t, f = 8, 3, 1
    threshold = sparse_threshold(k, f, t)
    graph = {"k": k, "honest": t, "colluders": f}
    hood = neighbourhoods(rid, cohort, k)
    me = cohort[0]
    client = clients_of(rid, identities, roster, t, f)[me]
    chosen = sorted([me] + [j for j in cohort if j not in hood[me]][:k])  # the server's pick
    with pytest.raises(ProtocolError, match="not this client's neighbourhood on the round's ring"):
        client.advertise(cohort, chosen, threshold, graph=graph)
    assert client.stage == 1 and client._c is None  # nothing drawn
    fresh = clients_of(rid, identities, roster, t, f)[me]
    assert fresh.advertise(cohort, hood[me], threshold, graph=graph)["sig"]  # the derived one is taken


def test_the_rings_threshold_is_at_least_t_plus_f_and_its_numbers_at_least_the_owners():
    """t_s ≥ t + F (the review's fix (ii)): at k = 16, F = 2, t = 12 a threshold of 13 passes every
    other bound (above two thirds of 17 and above (17 + 2) / 2, at most 17 − 2), and is refused. A
    ring planned for fewer colluders or honest inputs than the owner's own is refused too."""
    rid, (identities, roster) = b"ring-2", federation(60)
    cohort = sorted(i.id for i in identities)
    k, t, f = 16, 12, 2
    me = cohort[5]
    hood = neighbourhoods(rid, cohort, k)[me]
    assert sparse_threshold(k, f, t) == 14
    client = clients_of(rid, identities, roster, t, f)[me]
    with pytest.raises(ProtocolError, match="below the 14 a ring of k = 16 needs"):
        client.advertise(cohort, hood, 13, graph={"k": k, "honest": t, "colluders": f})
    for honest, colluders in ((t - 1, f), (t, f - 1)):
        client = clients_of(rid, identities, roster, t, f)[me]
        with pytest.raises(ProtocolError, match="this owner requires at least"):
            client.advertise(cohort, hood, 16, graph={"k": k, "honest": honest, "colluders": colluders})
    for bad in ({"k": 15, "honest": t, "colluders": f}, {"k": 60, "honest": t, "colluders": f}, {"k": k},
                {"k": k, "honest": True, "colluders": f}, "ring"):
        client = clients_of(rid, identities, roster, t, f)[me]
        with pytest.raises(ProtocolError, match="graph"):
            client.advertise(cohort, hood, 14, graph=bad)


def test_an_owner_refuses_a_neighbour_that_signed_other_ring_numbers():
    """Two owners told two plans (here t = 3 and t = 4, the same k and threshold, each valid for
    both) would each go on with its own story: the ring's numbers are signed in every advert, so
    the first refuses the second's keys at share-keys, naming it."""
    rid, (identities, roster) = b"ring-3", federation(40)
    cohort = sorted(i.id for i in identities)
    k, f = 8, 1
    threshold = max(sparse_threshold(k, f, 3), sparse_threshold(k, f, 4))
    hood = neighbourhoods(rid, cohort, k)
    a = cohort[0]
    b = next(j for j in hood[a] if j != a)
    clients = clients_of(rid, identities, roster, 3, f)
    keys = {j: clients[j].advertise(cohort, hood[j], threshold, graph={"k": k, "honest": 4 if j == b else 3,
                                                                       "colluders": f}) for j in hood[a]}
    with pytest.raises(ProtocolError, match=f"not signed by it for this round, cohort, threshold, graph.*culprit: {b}"):
        clients[a].share_keys(keys)
    assert graph_tag(k, 3, f) != graph_tag(k, 4, f)


def test_a_ring_round_survives_the_dropouts_its_threshold_tolerates_and_sums_exactly():
    """At the graph's limit: k + 1 − t_s owners next to one another on the ring drop after sharing
    their keys (every neighbourhood that holds them all keeps exactly t_s survivors), and the sum
    is the survivors' exactly; one more next to them and the round is refused before any unmasking."""
    n, t, f = 60, 3, 1
    graph = graph_parameters(n, f, t, 0.1)
    assert not graph.complete
    identities, _ = federation(n)
    rid = b"ring-4"
    # secure_round names the round's clients 0..n-1 by their identities' ids: the ring is over those ids
    ids = [i.id for i in identities]
    order = ring_order(rid, ids, graph.k)
    tolerated = graph.k + 1 - graph.threshold
    rng = np.random.default_rng(4)
    xs = {k: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for k in range(n)}
    by_id = {i.id: k for k, i in enumerate(identities)}
    for drop, ok in ((tolerated, True), (tolerated + 1, False)):
        dropped = frozenset(by_id[order[p]] for p in range(10, 10 + drop))
        run = lambda: secure_round(rid, {k: (lambda v=v: v) for k, v in xs.items()}, D, min_cohort=t,  # noqa: E731
                                   degree=graph.k, drop_before_masking=dropped, max_colluders=f,
                                   identities=dict(enumerate(identities)))
        if ok:
            total, cost = run()
            assert np.array_equal(total, sum(v for k, v in xs.items() if k not in dropped))
            assert cost["survivors"] == n - drop
        else:
            with pytest.raises((ProtocolError, RoundAbandoned)):
                run()


# -- a member spoiling ring rounds unnamed (the second review's findings) -------------------------
class Member(Colluder):
    """A member that deals one consistent, signed dealing to any list of holders."""

    def deal_many(self, holders: list[int], keys: dict, threshold: int) -> dict:
        holders = sorted(holders)
        b = secrets.token_bytes(SELF_SEED_BYTES)
        both = split_secret(b + self.s.private_bytes_raw(), threshold, holders)
        shares, commits = {}, {}
        for h in holders:
            nonce = secrets.token_bytes(NONCE)
            shares[h] = nonce + AESGCM(self._enc(keys[h], h)).encrypt(nonce, both[h], _info(self.rid, "share",
                                                                                             self.me, h))
            commits[h] = commitments(self.rid, self.me, h, both[h])
        digest = seed_digest(self.rid, self.me, b)
        root = commit_root(self.rid, self.me, b"".join(commits[h] for h in holders))
        return {"shares": shares, "commits": commits, "digest": digest, "dealing": self.identity.sign(
            _dealing_message(self.rid, self.me, holders, threshold, digest, _raw(self.s.public_key()), root))}


def member_round(rid: bytes, deal_to_all: bool = False, masked_with_itself: bool = False, advert=None,
                 holders=None):
    """A ring of 40 (k = 8, t = 3, F = 1) with one member; the honest server. `advert`: what the
    member does to its advert (given it and the honest adverts); `holders`: whom it deals to (given
    its neighbourhood). Returns (the sum, the sum of the honest owners the server kept, the server,
    the member's id)."""
    n, k, t, f = 40, 8, 3, 1
    threshold = sparse_threshold(k, f, t)
    identities, roster = federation(n)
    cohort = sorted(i.id for i in identities)
    server = SecAggServer(rid, cohort, D, threshold=threshold, graph={"k": k, "honest": t, "colluders": f},
                          signers={i.id: i.public for i in identities})  # as identify gives a deployed server
    x = cohort[7]
    member = Member(next(i for i in identities if i.id == x), rid)
    clients = clients_of(rid, identities, roster, t, f, skip={x})
    keys = {i: c.advertise(**server.setup(i)) for i, c in clients.items()}
    keys[x] = member.advertise(cohort, threshold, graph_tag(k, t, f))
    if advert is not None:  # signed again by the member where it changes its keys
        keys[x] = advert(keys[x], keys, server.neighbours[x], lambda e: {**e, "sig": member.identity.sign(_advert(
            rid, x, cohort, threshold, e["c"], e["s"], e["v"], b"", graph_tag(k, t, f)))})
    server.collect_keys(keys)
    clients = {i: c for i, c in clients.items() if i in server.keys}
    dealt = {i: c.share_keys(server.keys_for(i)) for i, c in clients.items()}
    if x in server.keys:
        to = cohort if deal_to_all else holders(server.neighbours[x]) if holders else server.neighbours[x]
        dealt[x] = member.deal_many(to, server.keys, min(threshold, len(to)))
        if len(to) < threshold:  # signed with the round's threshold, which the holders check
            d = dealt[x]
            root = commit_root(rid, x, b"".join(d["commits"][h] for h in sorted(to)))
            d["dealing"] = member.identity.sign(_dealing_message(rid, x, sorted(to), threshold, d["digest"],
                                                                 _raw(member.s.public_key()), root))
    server.collect_shares(dealt)
    rng = np.random.default_rng(5)
    xs = {i: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for i in cohort}
    masked = {i: c.masked_input(*server.shares_for(i).values(), xs[i]) for i, c in clients.items()}
    sets = {i: c.masked_set() for i, c in clients.items()}
    masked[x] = xs[x]  # whatever it likes
    if masked_with_itself:
        sets[x] = {"with": [x], "sig": member.identity.sign(masked_with_message(rid, x, [x]))}
    server.collect_masked(masked, sets)
    signatures = server.route_confirmations({i: c.confirm(**server.unmask_request(i)) for i, c in clients.items()})
    answers = {i: c.unmask(signatures[i], server.masked_sets_for(i)) for i, c in clients.items()}
    return server.finish(answers), sum(xs[i] for i in clients if i in server.masked), server, x


def test_a_member_dealing_outside_its_neighbourhood_is_named_and_left_out_before_anyone_pays():
    """MEDIUM (a second review): a member signed a dealing to the whole cohort; the server relayed
    it, every owner outside its neighbourhood refused at masked-input naming no one, after the
    member's neighbours had paid, and the round was abandoned unnamed, every round. Now the server
    leaves such a dealing out and names its dealer; every owner goes on and the sum is theirs."""
    total, honest, server, member = member_round(b"ring-f1", deal_to_all=True)
    assert "outside its neighbourhood" in server.culprits[member]
    assert member not in server.masked and np.array_equal(total, honest)


@pytest.mark.parametrize("spoil,named", [
    (lambda mine, keys, hood, sign: {**mine, "sig": bytes(64)}, "not signed by it for this round"),
    (lambda mine, keys, hood, sign: sign({**mine, "s": bytes(32)}), "not a usable X25519 public key"),
    (lambda mine, keys, hood, sign: sign({**mine, "c": next(keys[j] for j in hood if keys.get(j) not in (None, mine))
                                          ["c"]}), "another client"),
])
def test_a_members_advert_its_neighbours_would_refuse_is_left_out_and_named_before_anyone_deals(spoil, named):
    """HIGH (a third review): on a ring only a member's k neighbours check its advert; a bad one (a
    signature that does not verify, a low-order key, a neighbour's key copied) made them refuse at
    share-keys, the owners beyond them then lacked shares, and the round was abandoned after 27 of
    39 owners had paid, naming no one. Now the server checks every advert as the neighbours will:
    the member is left out and named (a copied key: both adverts, since no one can tell which is
    the copy), no owner refuses, and the sum is the others' exactly."""
    total, honest, server, member = member_round(b"ring-advert", advert=spoil)
    assert named in server.culprits[member] and member not in server.keys
    assert np.array_equal(total, honest) and len(server.masked) >= len(server.cohort) - 2


def test_a_member_that_gives_honest_owners_identity_keys_as_its_round_keys_is_named_alone():
    """HIGH (a fourth review): identity keys are public, and about half are usable X25519 keys; a
    member that advertised two honest neighbours' identity keys as its c and s had all three left
    out as copies of one another, every round, and with two neighbours gone from one neighbourhood
    the round was abandoned after 30 of 39 owners paid. An identity key given as a round key is its
    sender's fault alone: the member is named, every honest owner is summed."""
    def with_their_identity_keys(mine, keys, hood, sign):
        # neighbours' first, then the cohort's (8 neighbours hold two usable ones but 96 % of the time)
        theirs = [keys[j]["v"] for j in sorted(keys, key=lambda j: j not in hood) if keys[j] is not mine]
        usable = [v for v in theirs if v[31] < 0x80][:2]  # canonical as X25519 keys: about half of them
        return sign({**mine, "c": usable[0], "s": usable[1]})

    total, honest, server, member = member_round(b"ring-identity", advert=with_their_identity_keys)
    assert set(server.culprits) == {member} and "identity key" in server.culprits[member]
    assert np.array_equal(total, honest) and len(server.masked) == len(server.cohort) - 1


def test_a_member_dealing_to_fewer_than_its_neighbours_is_named_and_left_out_before_anyone_pays():
    """HIGH (a third review): a member signed a dealing to itself and one neighbour, with the round's
    threshold; the holders could not tell, every owner paid, and the member's b could not be rebuilt:
    abandoned, naming no one, every round. Now the server leaves out a dealing to other holders than
    the dealer's neighbours that advertised, naming its dealer, before anyone pays."""
    total, honest, server, member = member_round(b"ring-short", holders=lambda hood: sorted(hood)[:2])
    assert "other holders than its neighbours" in server.culprits[member] and member not in server.masked
    assert np.array_equal(total, honest)


def test_a_member_whose_signed_masked_set_is_not_what_it_was_sent_counts_as_dropped_and_is_named():
    """HIGH (a second review): a member that signs M naming only itself (or none) leaves no holder
    that reveals its b; the server counted it a survivor and abandoned every ring round after every
    owner paid, naming no one. Now the server checks each M against the shares it relayed: the
    member is named and counted as dropped (its pairwise masks removed through its s), and the sum
    is the honest owners' exactly."""
    total, honest, server, member = member_round(b"ring-f2", masked_with_itself=True)
    assert "signed set" in server.culprits[member] and member not in server.masked
    assert np.array_equal(total, honest)


# -- the review's attack C -------------------------------------------------------------------------
def attack_c(defended: bool = True):
    """The review's k = 16 solution (design §7), end to end against the real SecAggClient: n = 100,
    F = 5, t = 7, t_s = 12; members X at ring positions {−1, 2, 3, 4, 5} around K = {0, 1}; K is
    given the shares of only the partners P = {−7, −5, 6, 7, 8} besides X and K, so it masks with
    K ∪ P ∪ X; K and P are shown a view where everyone survived, every other owner one where P
    dropped; members sign both. The server then asks for K's self masks and P's keys. Returns
    (x_0 + x_1, what the server computed of it or None, the b shares it got of each of K)."""
    n, t, f, k = 100, 7, 5, 16
    threshold = sparse_threshold(k, f, t)
    rid, (identities, roster) = b"attack-c", federation(n)
    cohort = sorted(i.id for i in identities)
    order, hood = ring_order(rid, cohort, k), neighbourhoods(rid, cohort, k)

    def at(p: int) -> int:
        return order[(50 + p) % n]
    members = {at(p) for p in (-1, 2, 3, 4, 5)}
    targets, partners = [at(0), at(1)], {at(p) for p in (-7, -5, 6, 7, 8)}
    evil = {i.id: Colluder(i, rid) for i in identities if i.id in members}
    clients = clients_of(rid, identities, roster, t, f, skip=members)
    graph = {"k": k, "honest": t, "colluders": f}
    keys = {j: c.advertise(cohort, hood[j], threshold, graph=graph) for j, c in clients.items()}
    keys.update({j: c.advertise(cohort, threshold, graph_tag(k, t, f)) for j, c in evil.items()})
    dealt = {j: c.share_keys({h: keys[h] for h in hood[j]}) for j, c in clients.items()}
    for j, d in dealt.items():
        for c in evil.values():
            if c.me in d["shares"]:
                c.open(j, keys[j], d["shares"][c.me])
    rng = np.random.default_rng(7)
    xs = {j: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for j in clients}
    y, sets = {}, {}
    for i, client in clients.items():
        senders = [j for j in hood[i] if i not in targets or j in set(targets) | partners | members]
        cts, blobs = {}, {}
        for j in senders:
            if j in evil:
                cts[j], blobs[j] = evil[j].deal(i, keys[i], threshold)
            else:
                cts[j] = dealt[j]["shares"][i]
                blobs[j] = pack_dealing(dealt[j]["digest"], dealt[j]["dealing"], sorted(dealt[j]["shares"]),
                                        dealt[j]["commits"])
        y[i], sets[i] = client.masked_input(cts, blobs, xs[i]), client.masked_set()
    everyone = (cohort, [])
    partial = ([j for j in cohort if j not in partners], sorted(partners))
    view = {i: everyone if i in targets or i in partners else partial for i in clients}
    signed = {i: c.confirm(*view[i]) for i, c in clients.items()}
    answers = {}
    for h, client in clients.items():
        confirmations = {j: signed[j] for j in hood[h] if j in clients and view[j] == view[h] and j != h}
        confirmations.update({c.me: c.sign_view(*view[h]) for c in evil.values() if c.me in hood[h]})
        if not defended:
            client.degree = 0  # the defence off: reveal for every survivor, M or not
        try:
            answers[h] = client.unmask(confirmations, {j: sets[j] for j in hood[h] if j in sets})
        except ProtocolError:
            continue  # too few of its neighbours signed its view: it reveals nothing
    b_shares = {}
    for target in targets:
        b_shares[target] = {h: a["b"][target] for h, a in answers.items() if target in a["b"]}
        b_shares[target].update({c.me: c.opened[target][0] for c in evil.values() if target in c.opened})
    truth = xs[targets[0]] + xs[targets[1]]
    if any(len(s) < threshold for s in b_shares.values()):
        return truth, None, b_shares
    x = y[targets[0]] + y[targets[1]]
    for target in targets:
        x = x - expand_mask(self_mask_key(combine_secret(b_shares[target], hood[target], threshold)), D)
        for p in partners:
            s_shares = {h: a["s"][p] for h, a in answers.items() if p in a["s"]}
            s_shares.update({c.me: c.opened[p][1] for c in evil.values() if p in c.opened})
            private = X25519PrivateKey.from_private_bytes(combine_secret(s_shares, hood[p], threshold))
            pair = _derive(private.exchange(_public(keys[target]["s"], "s")),
                           _info(rid, "mask", min(p, target), max(p, target)))
            x = x - expand_mask(pair, D) if pairwise_sign(target, p) > 0 else x + expand_mask(pair, D)
        for c in evil.values():
            mask = expand_mask(c.pair(keys[target], target), D)
            x = x - mask if pairwise_sign(target, c.me) > 0 else x + mask
    return truth, x, b_shares


def test_the_reviews_attack_c_leaves_the_server_short_of_the_targets_self_masks():
    """CRITICAL, the review's attack on the first draft (design §7, finding 1): two views and
    shares relayed selectively gave the server x_0 + x_1, a sum of 2 honest inputs against the
    owners' t = 7. Each owner now signs M, the neighbours it masked with, and a holder reveals its
    share of b only where M names it: the holders that signed the other view are not in K's M,
    and the server gets 7 of the 12 shares of each target's self mask. With the defence off
    (`attack_c(defended=False)`) the same script recovers x_0 + x_1 exactly."""
    truth, recovered, b_shares = attack_c()
    assert recovered is None and all(len(s) == 7 for s in b_shares.values()), {k: len(s) for k, s in b_shares.items()}
    truth, recovered, b_shares = attack_c(defended=False)  # the script is live: without M, 12 shares each
    assert all(len(s) == 12 for s in b_shares.values()) and np.array_equal(recovered, truth)


def test_F_members_silent_after_masking_beside_the_dropouts_the_plan_expects_do_not_abandon_the_round():
    """Liveness against members (the second review's third finding): F members send their masked
    inputs and then fall silent, in one neighbourhood with as many honest dropouts as the plan's
    dropout rate makes plausible there (more than 2^-20 / n likely). `graph_parameters` sizes k for
    both, so the round sums exactly; sized for random dropouts alone (k = 12 here), the same round is
    abandoned after every owner paid."""
    from scipy.stats import hypergeom

    n, f, t, dropout = 40, 1, 3, 0.1
    graph = graph_parameters(n, f, t, dropout)
    tail = hypergeom(n - 1, math.ceil(dropout * n), graph.k)
    plausible = max(d for d in range(graph.k + 1) if tail.sf(d - 1) > 2.0 ** -20 / n)
    identities, _ = federation(n)
    rid = b"ring-silent"
    ids = [i.id for i in identities]
    order, by_id = ring_order(rid, ids, graph.k), {i.id: k for k, i in enumerate(identities)}
    dropped = frozenset(by_id[order[p]] for p in range(5, 5 + plausible))
    silent = frozenset(by_id[order[p]] for p in range(5 + plausible, 5 + plausible + f))
    rng = np.random.default_rng(9)
    xs = {k: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for k in range(n)}
    total, cost = secure_round(rid, {k: (lambda v=v: v) for k, v in xs.items()}, D, min_cohort=t, degree=graph.k,
                               drop_before_masking=dropped, max_colluders=f, identities=dict(enumerate(identities)),
                               silent_after_masking=silent)
    assert np.array_equal(total, sum(v for k, v in xs.items() if k not in dropped))  # the silent ones' inputs too
    assert cost["survivors"] == n - plausible


# -- a simulation's graph ------------------------------------------------------------------------
def test_a_simulation_picks_the_ring_above_its_size_and_refuses_what_fits_no_graph():
    """--secagg-graph auto: the complete graph at 40 clients, the ring at 1,000 (k from n, t, F, δ);
    a ring that cannot fit (t + F above what 128 neighbours allow), or the complete graph above
    128 clients, is refused before any work, naming the settings."""
    base = FedConfig(secure_aggregation=True, noise="distributed", num_clients=40, honest_clients=10)
    assert secure_graph(base) is None
    graph = secure_graph(dataclasses.replace(base, num_clients=1000))
    assert (graph.k, graph.threshold) == (42, 29)
    assert secure_graph(dataclasses.replace(base, num_clients=100, secagg_graph="ring")).k + 1 < 100
    with pytest.raises(ConfigError, match="--clients 1000: with --honest-clients 1000.*--secure-sum plain"):
        secure_graph(dataclasses.replace(base, num_clients=1000, honest_clients=0))
    with pytest.raises(ConfigError, match="--clients 200: on the complete graph"):
        secure_graph(dataclasses.replace(base, num_clients=200, secagg_graph="complete"))
    with pytest.raises(ConfigError, match="--secagg-dropout 0.5"):
        secure_graph(dataclasses.replace(base, num_clients=1000, secagg_dropout=0.5))
    with pytest.raises(ConfigError, match="--secagg-max-colluders 600"):
        secure_graph(dataclasses.replace(base, num_clients=1000, secagg_max_colluders=600))


@pytest.mark.slow  # starts two worker processes
def test_a_round_whose_clients_run_in_two_worker_processes_sums_as_one_process_does():
    """fedsd.secure.client_groups: the clients spread over two processes (cut from the ring's order,
    their vectors masked in shared memory) give the exact sum, with dropouts before masking and a
    member silent after it; and a client's refusal in a worker reaches the caller as it would here."""
    from fedsd.secure.client_groups import Workers

    n, f, t = 70, 1, 3
    graph = graph_parameters(n, f, t, 0.05)
    identities, _ = federation(n)
    rng = np.random.default_rng(11)
    xs = {k: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for k in range(n)}
    workers = Workers(2)
    try:
        total, cost = secure_round(b"ring-workers", {k: (lambda v=v: v) for k, v in xs.items()}, D, min_cohort=t,
                                   degree=graph.k, max_colluders=f, identities=dict(enumerate(identities)),
                                   drop_before_masking=frozenset({3}), silent_after_masking=frozenset({40}),
                                   workers=workers)
        assert np.array_equal(total, sum(v for k, v in xs.items() if k != 3)) and cost["survivors"] == n - 1
        assert len(workers.processes) == 2 and all(p.is_alive() for p in workers.processes)
        with pytest.raises(ProtocolError, match="below the 71 this owner requires"):
            secure_round(b"ring-workers-2", {k: (lambda v=v: v) for k, v in xs.items()}, D, min_cohort=71,
                         identities=dict(enumerate(identities)), workers=workers)
    finally:
        workers.close()
    assert not workers.processes


def test_an_owner_derives_only_its_own_neighbourhood_of_a_huge_cohort_the_server_names():
    """LOW (a third review): an owner without a roster took any cohort the server named and built
    every member's neighbourhood to check its own, O(n·k), kept in a cache: 200,000 ids and k = 126
    cost 5 s and 230 MiB a refused advert. It derives its own alone: a cohort of 100,000 costs a
    few MiB, refused or not."""
    import tracemalloc

    from fedsd.secure.ring import _neighbourhoods, _ring_order

    cohort, k = list(range(1, 100_001)), 126
    client = SecAggClient(1, b"ring-huge", min_cohort=2, max_colluders=0)
    graph = {"k": k, "honest": 2, "colluders": 0}
    _neighbourhoods.cache_clear()
    _ring_order.cache_clear()
    tracemalloc.start()
    with pytest.raises(ProtocolError, match="not this client's neighbourhood"):
        client.advertise(cohort, list(range(1, k + 2)), sparse_threshold(k, 0, 2), graph=graph)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 40 * 2 ** 20, f"{peak / 2 ** 20:.0f} MiB"
