"""Attacks on fedsd.secure.secagg / fedsd.secure.distributed_noise by a malicious server (the threat model of
the module: everything a client's service receives is chosen by the server), found by a review
that played the attacker. Each test failed on the code before its defence and passes with it;
the docstrings say what the attack did."""
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedsd.secure.secagg import SecAggClient
from fedsd.secure.secagg_primitives import (ProtocolError, _derive, _info, _public, combine_secret, expand_mask,
                                            minimum_threshold, pairwise_sign)

D = 1_000


def _server_strips(round_id, target, y, holders, b_shares, s_shares_of, keys):
    """What a server does with the answers: rebuild the target's self mask from b_shares, and
    every partner's s key from s_shares_of[a], then remove all masks from the target's y."""
    x = y - expand_mask(combine_secret(b_shares, holders[target], minimum_threshold(len(holders[target]))), D)
    for a, shares in s_shares_of.items():
        s_a = X25519PrivateKey.from_private_bytes(
            combine_secret(shares, holders[a], minimum_threshold(len(holders[a]))))
        pair = _derive(s_a.exchange(_public(keys[target]["s"], "s")),
                       _info(round_id, "mask", min(a, target), max(a, target)))
        mask = expand_mask(pair, D)
        x = x - mask if pairwise_sign(target, a) > 0 else x + mask
    return x


def irregular_graph_attack(n: int, min_cohort: int, complete_graph_per_client: bool):
    """n honest clients (no Sybil, no key substitution), every one with the owner's min_cohort.

    The server gives the target u a neighbourhood of min_cohort clients {u} ∪ A, every a in A the
    whole cohort, and every other client w the cohort without u (a symmetric graph, only not
    regular). At unmask it tells u and the a's the truth (everybody survived), and tells every w
    that the clients in A dropped. Each client's checks pass: no client is asked both shares of
    one client, every survivor list is above its threshold (> 2/3 of its neighbourhood).
    - b_u: from u and the a's (all of u's holders), u "survived";
    - s_a for every a in A: from the w's (n - min_cohort ≥ t_a = ⌊2n/3⌋ + 1 of a's n holders).
    Together they strip every mask from u's masked input: the server has u's vector.
    complete_graph_per_client: every client is told neighbours == cohort (a rule "complete graph
    only" would not help: the cohort itself is told per client)."""
    rid = b"attack-round"
    ids = list(range(1, n + 1))
    u, A = ids[0], ids[1:min_cohort]
    W = [w for w in ids if w != u and w not in A]
    hood = {u: [u] + A, **{a: ids for a in A}, **{w: [i for i in ids if i != u] for w in W}}
    rng = np.random.default_rng(1)
    xs = {i: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for i in ids}
    clients = {i: SecAggClient(i, rid, min_cohort=min_cohort) for i in ids}
    keys = {}
    for i in ids:
        cohort = hood[i] if complete_graph_per_client else ids
        keys[i] = clients[i].advertise(cohort=cohort, neighbours=hood[i],
                                       threshold=minimum_threshold(len(hood[i])))
    dealt = {i: clients[i].share_keys({j: keys[j] for j in hood[i]}) for i in ids}
    holders = {i: sorted(dealt[i]["shares"]) for i in ids}
    inbox = {i: {j: dealt[j]["shares"][i] for j in ids if i in dealt[j]["shares"] and j in hood[i]} for i in ids}
    commits = {i: {j: dealt[j]["commits"][i] for j in inbox[i]} for i in ids}
    y = {i: clients[i].masked_input(inbox[i], commits[i], xs[i]) for i in ids}
    answers = {}
    # the consistency stage: the two stories, every signature routed everywhere
    views = {i: ((sorted(set(ids) - set(A)), A) if i in W else (ids, [])) for i in ids}
    signatures = {i: clients[i].confirm(*views[i]) for i in ids}
    for i in ids:
        try:
            answers[i] = clients[i].unmask({j: signatures[j] for j in ids if j != i})
        except ProtocolError:
            pass
    if sum(1 for h in holders[u] if h in answers and u in answers[h]["b"]) < minimum_threshold(len(holders[u])):
        raise ProtocolError("too few shares of the target's self mask")
    b_shares = {h: answers[h]["b"][u] for h in holders[u] if u in answers[h]["b"]}
    s_shares = {a: {h: answers[h]["s"][a] for h in holders[a] if a in answers[h]["s"]} for a in A}
    return xs[u], _server_strips(rid, u, y[u], holders, b_shares, s_shares, keys)


@pytest.mark.parametrize("n,min_cohort,complete", [(9, 2, False), (18, 5, False), (18, 5, True), (33, 10, True)])
def test_inconsistent_survivor_sets_on_an_irregular_graph_unmask_no_vector(n, min_cohort, complete):
    """CRITICAL. Every client honest, every client-side check passes, and the server learns one
    client's vector (its quantised clipped sum plus a noise share of variance μ/t only)."""
    try:
        truth, recovered = irregular_graph_attack(n, min_cohort, complete)
    except ProtocolError:
        return  # a client refused: the attack is stopped
    assert not np.array_equal(recovered, truth), "the server unmasked an individual vector"


def test_a_neighbourhood_too_large_for_the_shamir_split_is_refused():
    """MEDIUM (availability). The cohort and neighbourhood sizes are unbounded; share_keys then
    splits two secrets t-of-k with pure-Python Shamir, O(k·t) GF(2^128) products: measured here
    0.8 s per secret at k = 100, 4 s at 200, 14 s at 400, so hours at k = 10^4, for a ~1 MB
    message of random public keys (which pass every key check). advertise must refuse a
    neighbourhood above a bound the owner sets (SecAgg+'s degree is O(log n))."""
    n = 100_000
    client = SecAggClient(1, b"r", min_cohort=5)
    with pytest.raises(ProtocolError):
        client.advertise(cohort=list(range(1, n + 1)), neighbours=list(range(1, n + 1)),
                         threshold=minimum_threshold(n))


# -- the client's contribution trusts the NoisePlan it is handed --------------------------------
def _tiny_trainer():
    import torch

    from fedsd.data import datasets as data_lib
    from fedsd.settings.run import TrainConfig
    from fedsd.settings.federation import FedConfig, client_config
    from fedsd.privacy.accounting import PrivacyPlan
    from fedsd.privacy.secret_random import SecretStream
    from fedsd.training.loop import DPTrainer, TrainState, initial_model

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", grad_sample_mode="hooks", epsilon=3.0, batch_size=8,
                      lr=1.0, momentum=0.0, seed=1, threads=1, clip=0.1)
    c = client_config(cfg, FedConfig(num_clients=1, rounds=1, local_epochs=1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    plan = PrivacyPlan(noise_multiplier=0.0, sample_rate=0.5, planned_steps=1, epsilon=3.0, delta=1e-5,
                       accountant="rdp")
    trainer = DPTrainer(c, data_lib.TensorData(x, y, x[:8], y[:8], 10), plan)
    state = TrainState(plan.history_before_training())
    state.secret = SecretStream(b"k" * 32)
    dim = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return trainer, state, initial_model(c, 10)["student"], dim


def test_contribution_refuses_a_plan_whose_clip_is_not_the_trainers():
    """HIGH (if the plan reaches the owner's service from the server, as "what every client and
    the server agree on"). γ = 2^20 / plan.clip while the trainer clips at its own C: a plan
    with clip C/1000 makes one record move the integer vector by 1000·2^20 while the noise and
    the accountant assume 2^20 (an effective z/1000, charged as z)."""
    import dataclasses

    from fedsd.secure import distributed_noise as dn
    from fedsd.secure.distributed_step import contribution

    trainer, state, start, dim = _tiny_trainer()
    plan = dn.NoisePlan(noise_multiplier=1.0, clip=trainer.cfg.clip, sample_rate=0.5, expected_batch=8.0,
                        honest=1, dim=dim)
    contribution(trainer, state, start, 1, plan)  # the consistent plan is fine
    with pytest.raises(ValueError):
        contribution(trainer, state, start, 1, dataclasses.replace(plan, clip=trainer.cfg.clip / 1000))


def test_contribution_refuses_a_plan_with_less_noise_than_the_clients_own():
    """LOW (a second review playing the attacker; if the plan comes from the server). A plan with
    z = 0 would send the clipped sum without noise; its ε (inf) would be charged only after the
    release. Refused before anything is drawn, the state untouched."""
    import dataclasses

    from fedsd.secure import distributed_noise as dn
    from fedsd.secure.distributed_step import contribution

    trainer, state, start, dim = _tiny_trainer()
    plan = dn.NoisePlan(noise_multiplier=1.0, clip=trainer.cfg.clip, sample_rate=trainer.plan.sample_rate,
                        expected_batch=8.0, honest=1, dim=dim)
    contribution(trainer, state, start, 1, plan, least_noise=1.0)
    for z in (0.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match="noise_multiplier"):
            contribution(trainer, state, start, 1, dataclasses.replace(plan, noise_multiplier=z), least_noise=1.0)


def test_contribution_charges_the_sample_rate_it_draws_at():
    """HIGH (same condition). The batch is drawn at the trainer's q, the round is charged at the
    plan's: a plan with q = 0.001 against a trainer at q = 0.5 under-charges ~500-fold in q."""

    from fedsd.secure import distributed_noise as dn
    from fedsd.secure.distributed_step import contribution

    trainer, state, start, dim = _tiny_trainer()
    plan = dn.NoisePlan(noise_multiplier=1.0, clip=trainer.cfg.clip, sample_rate=0.001, expected_batch=8.0,
                        honest=1, dim=dim)
    try:
        _, charged, _ = contribution(trainer, state, start, 1, plan)
    except ValueError:
        return  # refused: fine
    assert charged.history[-1][1] >= trainer.plan.sample_rate, charged.history[-1]


def test_dropouts_never_leave_fewer_than_t_honest_noise_shares_in_the_sum():
    """HIGH. Owner assumption: at least t = min_cohort = 5 of the 10 clients are honest (the
    others may be the server's). Each client adds Sk(μ/5). The server declares 3 honest clients
    dropped (or they really time out); survivors = 7 ≥ max(threshold 7, min_cohort 5), so every
    check passes and the sum is unmasked with 2 honest shares: once the 5 colluders' own
    vectors are subtracted, the noise is Sk(2μ/5), 40 % of the variance the accountant charges.
    (With the complete graph a client cannot tell honest survivors from colluding ones; it needs
    |survivors| ≥ t + f where f = cohort − t, i.e. no dropout at all when t < n, or a noise share
    of μ/(t − dropouts tolerated).)"""
    from fedsd.secure import distributed_noise as dn
    from fedsd.secure.distributed_step import secure_round
    from fedsd.secure.secagg_server import RoundAbandoned

    d, t = 4_000, 5
    plan = dn.NoisePlan(noise_multiplier=1.0, clip=0.1, sample_rate=0.1, expected_batch=10.0, honest=t, dim=d)
    ids = list(range(100, 110))
    colluders, honest = ids[:5], ids[5:]
    enc = {i: dn.encode(np.zeros(d), plan, dn.generator(bytes([i - 100]) * 16)) for i in ids}
    try:
        total, cost = secure_round(b"drop", {i: (lambda v=enc[i]: v) for i in ids}, d, min_cohort=t,
                                   drop_before_masking=frozenset(honest[:3]), max_colluders=len(colluders))
    except (RoundAbandoned, ProtocolError):
        return
    residual = total.copy()
    for c in colluders:
        residual -= enc[c]  # the server knows its own clients' contributions
    variance = residual.view(np.int64).astype(np.float64).var()
    assert variance >= 0.95 * plan.variance, (variance / plan.variance, cost["survivors"])


def test_a_second_encoding_of_a_public_key_is_refused():
    """LOW. X25519 ignores bit 255: the same point under two encodings would pass the check that
    no two clients advertise the same key. Only the canonical encoding is taken."""
    raw = X25519PrivateKey.generate().public_key().public_bytes_raw()
    _public(raw, "key")
    with pytest.raises(ProtocolError, match="canonical"):
        _public(raw[:31] + bytes([raw[31] | 0x80]), "key")
