"""A review of the authenticated secure aggregation (c941194, c5f6bb8) by a reviewer playing the
attacker: the server, and fellow members of the roster working with it. Each test FAILS while
its attack works (the docstring says what the attack does) and passes once it is refused."""
import os
import secrets

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedsd.app.client import secure_stages as service
from fedsd.app.client.secure_owner import StageRefused
from fedsd.secure.identity import Identity, Roster, RosterError, parse_public, public_line, read_roster, verify
from fedsd.secure.secagg import SecAggClient
from fedsd.secure.secagg_primitives import (NONCE, SELF_SEED_BYTES, SHARE_BYTES, ProtocolError, _advert, _commitment,
                                            _dealing_message, _derive, _info, _public, _raw, _view_message,
                                            combine_secret, commit_root, expand_mask, pack_dealing, pairwise_sign,
                                            self_mask_key)
from fedsd.secure.secagg_server import RoundAbandoned, SecAggServer
from tests.secure.test_roster_keys_shares_and_bounds import _round_to_unmask, members  # noqa: F401
from tests.app.client.test_secure_aggregation import EXPERIMENT, IDS, owners, stage  # noqa: F401

D = 500


class Colluder:
    """A roster member working with the server: the server holds its signing key and its round
    keys, and it follows no rule (it deals any share, signs any view, hands over what it holds)."""

    def __init__(self, identity: Identity, rid: bytes):
        self.identity, self.rid, self.me = identity, rid, identity.id
        self.c, self.s = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        self.opened: dict[int, tuple[bytes, bytes]] = {}  # dealer → (its b share, its s share) held here

    def advertise(self, cohort, threshold, graph: bytes = b"") -> dict:
        c, s, v = _raw(self.c.public_key()), _raw(self.s.public_key()), self.identity.public
        return {"c": c, "s": s, "v": v,
                "sig": self.identity.sign(_advert(self.rid, self.me, cohort, threshold, c, s, v, b"", graph))}

    def _enc(self, keys: dict, other: int) -> bytes:
        return _derive(self.c.exchange(_public(keys["c"], "c")),
                       _info(self.rid, "enc", min(self.me, other), max(self.me, other)))

    def deal(self, holder: int, keys: dict, threshold: int) -> tuple[bytes, bytes]:
        """Any share for `holder`, in a dealing to it alone that this member signs (its b digest made up)."""
        plain, nonce = secrets.token_bytes(SHARE_BYTES), secrets.token_bytes(NONCE)
        ciphertext = nonce + AESGCM(self._enc(keys, holder)).encrypt(nonce, plain,
                                                                     _info(self.rid, "share", self.me, holder))
        pair = _commitment(self.rid, self.me, holder, "b", plain[:SELF_SEED_BYTES]) + \
            _commitment(self.rid, self.me, holder, "s", plain[SELF_SEED_BYTES:])
        digest, s_public = bytes(32), _raw(self.s.public_key())
        dealing = self.identity.sign(_dealing_message(self.rid, self.me, [holder], threshold, digest, s_public,
                                                      commit_root(self.rid, self.me, pair)))
        return ciphertext, pack_dealing(digest, dealing, [holder], {holder: pair})

    def open(self, dealer: int, keys: dict, ciphertext: bytes) -> None:
        plain = AESGCM(self._enc(keys, dealer)).decrypt(ciphertext[:NONCE], ciphertext[NONCE:],
                                                        _info(self.rid, "share", dealer, self.me))
        self.opened[dealer] = (plain[:SELF_SEED_BYTES], plain[SELF_SEED_BYTES:])

    def pair(self, keys: dict, other: int) -> bytes:
        return _derive(self.s.exchange(_public(keys["s"], "s")),
                       _info(self.rid, "mask", min(self.me, other), max(self.me, other)))

    def sign_view(self, survivors, dropped) -> bytes:
        return self.identity.sign(_view_message(self.rid, sorted(survivors), sorted(dropped)))


# -- 1. neighbourhoods the server chooses -------------------------------------------------------
HONEST = ("i", "k1", "k2", "o1", "o2", "w1", "w2", "w3", "w4")
HOODS = {  # a symmetric graph; c1 and c2 (the server's members) neighbour everyone
    "i": ("k1", "k2", "o1", "o2"),
    "k1": ("i", "o1", "w1", "w2"), "k2": ("i", "o2", "w3", "w4"),
    "o1": ("i", "k1", "w1", "w2"), "o2": ("i", "k2", "w3", "w4"),
    "w1": ("k1", "o1", "w2"), "w2": ("k1", "o1", "w1"),
    "w3": ("k2", "o2", "w4"), "w4": ("k2", "o2", "w3"),
}


def sparse_graph_attack():
    """Returns (owner i's input, what the server computed of it); ProtocolError if refused."""
    rid = b"review-sparse-graph"
    t, f, honest_min = 5, 2, 3
    ids = {n: Identity() for n in HONEST + ("c1", "c2")}
    roster = Roster.of({n: i.public for n, i in ids.items()})
    me = {n: i.id for n, i in ids.items()}
    hood = {n: sorted(me[x] for x in (n, "c1", "c2") + HOODS[n]) for n in HONEST}
    cohort = sorted(me.values())
    clients = {n: SecAggClient(me[n], rid, min_cohort=honest_min, max_colluders=f, identity=ids[n], roster=roster)
               for n in HONEST}
    evil = {n: Colluder(ids[n], rid) for n in ("c1", "c2")}
    keys = {me[n]: clients[n].advertise(cohort, hood[n], t) for n in HONEST}  # stage 0: every check passes
    keys.update({me[n]: c.advertise(cohort, t) for n, c in evil.items()})
    dealt = {n: clients[n].share_keys({j: keys[j] for j in hood[n]}) for n in HONEST}  # stage 1
    for n in HONEST:
        for c in evil.values():
            c.open(me[n], keys[me[n]], dealt[n]["shares"][c.me])
    rng = np.random.default_rng(3)
    xs = {n: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for n in HONEST}
    name = {v: k for k, v in me.items()}
    y = {}
    for n in HONEST:  # stage 2: o1's and o2's shares are not delivered to i (i's are delivered to them)
        cts, commits = {}, {}
        for j in hood[n]:
            if n == "i" and name[j] in ("o1", "o2"):
                continue
            if name[j] in evil:
                cts[j], commits[j] = evil[name[j]].deal(me[n], keys[me[n]], 5)
            else:
                cts[j], commits[j] = dealt[name[j]]["shares"][me[n]], dealt[name[j]]["commits"][me[n]]
        y[n] = clients[n].masked_input(cts, commits, xs[n])
    # stage 3: two stories. i, k1, k2: everyone survived. The others: k1 and k2 dropped.
    story = {"i": (cohort, []), "k1": (cohort, []), "k2": (cohort, [])}
    other = ([j for j in cohort if j not in (me["k1"], me["k2"])], [me["k1"], me["k2"]])
    signed = {n: clients[n].confirm(*story.get(n, other)) for n in HONEST}
    answers = {}
    for n in ("i",) + HONEST[3:]:  # stage 4; k1 and k2 are never asked to unmask
        view = story.get(n, other)
        confirmations = {c.me: c.sign_view(*view) for c in evil.values()}
        confirmations.update({me[j]: signed[j] for j in HONEST if j != n and story.get(j, other) == view})
        answers[n] = clients[n].unmask(confirmations)
    # the server: i's self mask from i, c1, c2, o1, o2; k1's and k2's s keys from c1, c2 and the others
    b_i = combine_secret({me["i"]: answers["i"]["b"][me["i"]], me["o1"]: answers["o1"]["b"][me["i"]],
                          me["o2"]: answers["o2"]["b"][me["i"]],
                          **{c.me: c.opened[me["i"]][0] for c in evil.values()}}, hood["i"], t)
    x = y["i"] - expand_mask(self_mask_key(b_i), D)
    for k, helpers in (("k1", ("o1", "w1", "w2")), ("k2", ("o2", "w3", "w4"))):
        s_k = combine_secret({**{me[h]: answers[h]["s"][me[k]] for h in helpers},
                              **{c.me: c.opened[me[k]][1] for c in evil.values()}}, hood[k], t)
        pair = _derive(X25519PrivateKey.from_private_bytes(s_k).exchange(_public(keys[me["i"]]["s"], "s")),
                       _info(rid, "mask", min(me[k], me["i"]), max(me[k], me["i"])))
        x = x - expand_mask(pair, D) if pairwise_sign(me["i"], me[k]) > 0 else x + expand_mask(pair, D)
    for c in evil.values():
        mask = expand_mask(c.pair(keys[me["i"]], me["i"]), D)
        x = x - mask if pairwise_sign(me["i"], c.me) > 0 else x + mask
    return xs["i"], x


def test_neighbourhoods_the_server_chooses_unmask_one_owners_input_alone():
    """CRITICAL. 9 honest owners, each with secagg-min-clients = 3 and secagg-max-colluders = 2,
    and 2 members working with the server (c1, c2: F = 2, as every owner allows). The server
    sends each owner its own neighbourhood (nothing signs it, nothing checks it beyond its size):
    6 or 7 clients, each with c1 and c2, so that t = 5 passes every bound (> 2/3 of 7, and
    2·5 > 7 + 2). The target i neighbours k1, k2, o1, o2; o1's and o2's shares are not
    delivered to i. i, k1 and k2 are told that everyone survived (i unmasks: 5 of its 5
    partners signed); o1, o2 and w1..w4 are told that k1 and k2 dropped (each has 5 signatures
    of that view among its own neighbours). The server then has i's self mask (i, c1, c2, o1,
    o2) and k1's and k2's s keys (c1, c2 and three others each): i's input alone, exactly,
    against the owner's promise of a sum of at least 3 honest inputs. The counting that makes
    the complete graph safe (2t > k + F) holds in each neighbourhood, but the shares the server
    needs come from different neighbourhoods."""
    try:
        truth, recovered = sparse_graph_attack()
    except ProtocolError:
        return  # an owner refused: the attack is stopped
    assert not np.array_equal(recovered, truth), "the server unmasked owner i's input alone"


# -- 2. one round once per owner ---------------------------------------------------------------
def test_an_owner_joins_a_round_once_even_after_many_other_advertisements(members):
    """MEDIUM. _JOINED (in memory) forgot the oldest of 4096 rounds: a server that sent 4096
    cheap advertise messages for rounds it never runs (no training, no ledger) made the owner
    forget that it joined round 1, and the owner then joined round 1 again under the same round
    id: new keys signed by its roster key for that round, a second view signature for it. A
    restarted service forgot the same way. Now the last round joined for each run and experiment
    is kept in the owner's state folder: a round at or below it is refused, after any number of
    other rounds and after a restart."""
    m = members
    owner = m.contexts[IDS[0]]
    cohort = sorted(m.ids.values())
    first = {"experiment-id": EXPERIMENT, "server-round": 1}
    service.advertise_reply(stage(first, cohort=cohort, neighbours=cohort, threshold=3), owner)
    for r in range(2, 40):
        service.advertise_reply(stage({"experiment-id": EXPERIMENT, "server-round": r}, cohort=cohort,
                                      neighbours=cohort, threshold=3), owner)
    service._SESSIONS.clear()  # every session gone (evicted, or the service restarted)
    for r in (1, 39):
        with pytest.raises(StageRefused, match="advertised to this owner already"):
            service.advertise_reply(stage({"experiment-id": EXPERIMENT, "server-round": r}, cohort=cohort,
                                          neighbours=cohort, threshold=3), owner)
    service.advertise_reply(stage({"experiment-id": EXPERIMENT, "server-round": 40}, cohort=cohort,
                                  neighbours=cohort, threshold=3), owner)  # the next round is taken


# -- 3. the server's unmasking, fed by two members ------------------------------------------------
def test_a_share_from_a_holder_the_dealer_did_not_list_names_a_culprit_instead_of_crashing():
    """MEDIUM (availability; the honest owners have trained and been charged by then). A dealer
    lists its holders in its shares map but may commit to a share for a member it left out; that
    member answers the committed share at unmask. The share passes the commitment check, and
    combine_secret looks up a holder position that does not exist: a KeyError, which
    SecureRounds.one_round does not catch, ends the server's run (not a RoundAbandoned with a
    culprit)."""
    server, answers, xs = _round_to_unmask(5)
    dealer, outsider = sorted(answers)[0], sorted(answers)[-1]
    server.holders[dealer] = [h for h in server.holders[dealer] if h != outsider]  # as the dealer listed them
    try:
        server.finish(answers)
    except RoundAbandoned:
        pass  # refused and named: fine
    except KeyError as e:
        pytest.fail(f"the server's round ended in a KeyError ({e}), not a refusal naming the culprit")


# -- 4. the roster -------------------------------------------------------------------------------
def test_a_roster_key_anyone_can_sign_for_or_one_point_under_several_encodings_is_refused(tmp_path):
    """LOW. parse_public says a key is checked to be a point's encoding; it is not. The neutral
    point 01 00..00 (order 1) is accepted, and under it (R = that point, S = 0) verifies as a
    signature of every message: the server signs as that member without its key. The same
    point under two more encodings (sign bit set; y + p) is accepted as two more members, and
    32 bytes that are no point at all pass too."""
    p = 2 ** 255 - 19
    neutral = bytes([1]) + bytes(31)
    assert verify(neutral, neutral + bytes(32), b"any message at all")  # why such a key must be refused
    for raw in (neutral, bytes([1]) + bytes(30) + bytes([0x80]), (1 + p).to_bytes(32, "little"),
                bytes([2]) + bytes(31)):
        with pytest.raises(RosterError):
            parse_public(public_line(raw))
    good = Identity()
    path = tmp_path / "roster"
    path.write_text(f"alice {good.line()}\nbob {public_line(neutral)}\n")
    os.chmod(path, 0o644)
    with pytest.raises(RosterError):
        read_roster(path)


# -- 5. members that go silent after the honest owners were charged ------------------------------
def test_f_members_silent_at_unmask_cannot_abandon_a_round_the_honest_owners_paid_for():
    """MEDIUM. 6 honest owners with secagg-max-colluders = 3 (and secagg-min-clients = 3) and 3
    members; an honest server with its default threshold, ⌊2·9/3⌋ + 1 = 7, which every owner
    accepts (2·7 > 9 + 3). The members follow the protocol through the masked input, so every
    honest owner trains and is charged, and then do not answer the unmask stage: 6 answers,
    below 7, and the round is abandoned. The owners accepted a threshold that the F members they
    allow can always defeat after the ε is spent; an owner can refuse it at stage 0, before any
    cost (a threshold above its neighbours − F), the condition being n > 3F."""
    rid, f = b"review-silent-members", 3
    ids = [Identity() for _ in range(9)]
    roster = Roster.of({f"m{k}": i.public for k, i in enumerate(ids)})
    clients = {i.id: SecAggClient(i.id, rid, min_cohort=3, max_colluders=f, identity=i, roster=roster)
               for i in ids}
    members = sorted(clients)[:f]
    server = SecAggServer(rid, list(clients), D)  # the threshold an honest server picks
    try:
        server.collect_keys({i: c.advertise(**server.setup(i)) for i, c in clients.items()})
    except ProtocolError:
        return  # refused at stage 0, before anything is drawn or charged
    server.collect_shares({i: c.share_keys(server.keys_for(i)) for i, c in clients.items()})
    xs = {i: np.full(D, 1, dtype=np.uint64) for i in clients}
    server.collect_masked({i: c.masked_input(*server.shares_for(i).values(), xs[i]) for i, c in clients.items()})
    charged = [i for i in clients if i not in members]  # each of them trained for this masked input
    signatures = server.route_confirmations({i: c.confirm(**server.unmask_request(i)) for i, c in clients.items()})
    answers = {i: clients[i].unmask(signatures[i]) for i in charged}  # the members say nothing more
    try:
        server.finish(answers)
    except RoundAbandoned as e:
        pytest.fail(f"{len(charged)} honest owners were charged for a round that {f} members abandoned: {e}")


def test_f_members_silent_after_the_shares_cannot_abandon_a_round_the_honest_owners_paid_for():
    """A later review: 7 owners, each with t = 4 and F = 2, and the honest server's threshold 5,
    which every owner accepted (2·5 > 7 + 2, 5 ≤ 7 − 2). Two members deal their shares, then send
    no masked input: 5 survivors, and each honest owner goes on only with t + F = 6, so the round
    was abandoned after all five were charged, every round, nobody named. An owner now refuses at
    stage 0, before any cost, fewer than t + 2F neighbours."""
    rid, n, t, f = b"review-silent-after-shares", 7, 4, 2
    ids = [Identity() for _ in range(n)]
    roster = Roster.of({f"m{k}": i.public for k, i in enumerate(ids)})
    clients = {i.id: SecAggClient(i.id, rid, min_cohort=t, max_colluders=f, identity=i, roster=roster)
               for i in ids}
    members = sorted(clients)[:f]
    server = SecAggServer(rid, list(clients), D)
    try:
        server.collect_keys({i: c.advertise(**server.setup(i)) for i, c in clients.items()})
    except ProtocolError:
        return  # refused at stage 0, before anything is drawn or charged
    server.collect_shares({i: c.share_keys(server.keys_for(i)) for i, c in clients.items()})
    charged = [i for i in clients if i not in members]
    server.collect_masked({i: clients[i].masked_input(*server.shares_for(i).values(), np.full(D, 1, dtype=np.uint64))
                           for i in charged})  # each honest owner trained and was charged for this
    try:
        signatures = server.route_confirmations({i: clients[i].confirm(**server.unmask_request(i)) for i in charged})
        server.finish({i: clients[i].unmask(signatures[i]) for i in charged})
    except (ProtocolError, RoundAbandoned) as e:
        pytest.fail(f"{len(charged)} honest owners were charged for a round that {f} members abandoned: {e}")


# -- 6. the identify stage -----------------------------------------------------------------------
def test_a_member_that_tells_an_honest_owners_identity_does_not_take_its_place(monkeypatch):
    """LOW-MEDIUM (availability, and blame). The identify reply is an id and a public key, both
    public: a member's node that tells an honest owner's id and key first takes that owner's
    place in the cohort (the server's roster check passes), and the owner's own node is left
    out, its id named as "told one id". The impostor cannot sign the owner's keys, so every
    honest owner then refuses the round at stage 1, naming the honest owner as the culprit: one
    member stops every round and frames another. An identify reply signed by the identity key
    (over the round id and the node it answers for) would let the server refuse the impostor."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedsd.app.server.stage_exchange import Exchange, identify

    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 1)):  # as a ServerApp's process has them
        monkeypatch.setattr(TaskIdentity, name, value)

    from fedsd.secure.secagg_primitives import identify_message
    from fedsd.app import secure_sum as sums

    honest, other = Identity(), Identity()
    roster = Roster.of({"honest": honest.public, "other": other.public})
    impostor_node, honest_node, other_node = 11, 12, 13
    rid = sums.round_id(7, EXPERIMENT, 1)
    # what each node tells: the impostor replays the honest owner's id, key and signature
    signed = honest.sign(identify_message(rid, honest_node))
    told = {impostor_node: (honest, signed), honest_node: (honest, signed),
            other_node: (other, other.sign(identify_message(rid, other_node)))}

    class Grid:
        def send_and_receive(self, messages, *, timeout=None):
            return [Message(RecordDict({"secagg": ConfigRecord({
                "id": told[m.metadata.dst_node_id][0].id, "v": told[m.metadata.dst_node_id][0].public,
                "sig": told[m.metadata.dst_node_id][1], "authenticated": True})}), reply_to=m)
                for m in messages]  # the impostor's reply first

    exchange = Exchange(Grid(), 1, 10.0, [impostor_node, honest_node, other_node])
    identify(exchange, {"experiment-id": EXPERIMENT, "server-round": 1}, roster, rid)
    assert exchange.nodes.get(honest.id) == honest_node, "a member's node took an honest owner's place"
    assert exchange.nodes.get(other.id) == other_node
    assert str(honest.id) not in exchange.named, "the honest owner was named for the impostor's claim"
    assert f"node {impostor_node}" in exchange.named
