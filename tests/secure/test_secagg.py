"""SecAgg+ in process (fedsd.secure.secagg): the server learns the sum only, survives dropouts up to
the threshold, and every client refuses what would reveal an input."""
import numpy as np
import pytest

from fedsd.secure.distributed_step import secure_round
from fedsd.secure.secagg import SecAggClient
from fedsd.secure.secagg_primitives import ProtocolError, expand_mask
from fedsd.secure.secagg_server import RoundAbandoned, SecAggServer

D = 2_000


def vectors(n: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {100 + k: rng.integers(0, 2 ** 40, D, dtype=np.uint64) for k in range(n)}


def run_to_masked(n: int, round_id: bytes = b"r", drop=()):
    xs = vectors(n)
    server = SecAggServer(round_id, list(xs), D)
    clients = {i: SecAggClient(i, round_id) for i in xs}
    server.collect_keys({i: c.advertise(**server.setup(i)) for i, c in clients.items()})
    server.collect_shares({i: clients[i].share_keys(server.keys_for(i)) for i in xs})
    masked = {i: clients[i].masked_input(*server.shares_for(i).values(), xs[i]) for i in xs if i not in drop}
    server.collect_masked(masked)
    return xs, server, clients, masked


def test_an_honest_sum_equals_the_plain_sum_and_the_server_sees_masked_vectors_only():
    xs, server, clients, masked = run_to_masked(6)
    for i, y in masked.items():
        # what reaches the server is far from the input in every coordinate: a uniform mask
        assert np.mean(y == xs[i]) < 0.01
        assert 0.45 < np.mean(y.view(np.int64) < 0) < 0.55  # top bit a fair coin
    tags = server.route_confirmations({i: clients[i].confirm(**server.unmask_request(i)) for i in masked})
    total = server.finish({i: clients[i].unmask(tags.get(i, {})) for i in masked})
    assert np.array_equal(total, sum(xs.values()))


@pytest.mark.parametrize("degree,dropped", [(0, {101, 105}), (4, {103})])
def test_dropouts_up_to_the_threshold_are_survived(degree, dropped):
    """A client that shared its keys and then sent nothing: its pairwise masks are removed
    through its shares, and the sum is the others' exactly (the complete graph and SecAgg+'s)."""
    xs = vectors(9)
    total, cost = secure_round(b"r2", {i: (lambda v=v: v) for i, v in xs.items()}, D, degree=degree,
                               drop_before_masking=frozenset(dropped))
    assert np.array_equal(total, sum(v for i, v in xs.items() if i not in dropped))
    assert cost["survivors"] == 9 - len(dropped)


def test_below_the_threshold_the_round_is_abandoned_before_any_unmasking():
    xs = vectors(6)
    with pytest.raises(RoundAbandoned, match="nothing was unmasked"):
        secure_round(b"r3", {i: (lambda v=v: v) for i, v in xs.items()}, D,
                     drop_before_masking=frozenset({100, 101, 102}))


def test_a_request_for_both_shares_of_one_client_is_refused():
    xs, server, clients, masked = run_to_masked(5)
    target = 103
    others = [i for i in masked if i != target]
    # the server claims the target dropped, to one client, to rebuild its pairwise key
    with pytest.raises(ProtocolError, match="both a survivor and dropped"):
        clients[100].confirm(survivors=sorted(masked), dropped=[target])
    # and a second request of the same client, after an honest first one, is refused too
    clients[101].confirm(**server.unmask_request(101))
    with pytest.raises(ProtocolError, match="answered already"):
        clients[101].confirm(survivors=others, dropped=[target])


def test_replayed_and_out_of_order_stages_are_refused():
    xs, server, clients, masked = run_to_masked(4)
    with pytest.raises(ProtocolError, match="answered already"):
        clients[100].advertise(**server.setup(100))
    with pytest.raises(ProtocolError, match="answered already"):
        clients[100].masked_input(*server.shares_for(100).values(), xs[100])
    fresh = SecAggClient(7, b"r")
    with pytest.raises(ProtocolError, match="before its turn"):
        fresh.confirm([7], [])


def test_a_share_for_another_round_is_refused():
    """Shares are bound to their round: the server cannot replay last round's ciphertexts."""
    xs = vectors(4)
    ids = list(xs)
    old_server = SecAggServer(b"round-1", ids, D)
    old = {i: SecAggClient(i, b"round-1") for i in ids}
    old_server.collect_keys({i: c.advertise(**old_server.setup(i)) for i, c in old.items()})
    old_server.collect_shares({i: old[i].share_keys(old_server.keys_for(i)) for i in ids})
    server = SecAggServer(b"round-2", ids, D)
    new = {i: SecAggClient(i, b"round-2") for i in ids}
    server.collect_keys({i: c.advertise(**server.setup(i)) for i, c in new.items()})
    server.collect_shares({i: new[i].share_keys(server.keys_for(i)) for i in ids})
    fresh, old_round = server.shares_for(100), old_server.shares_for(100)
    stale = {**fresh["ciphertexts"], 101: old_round["ciphertexts"][101]}
    with pytest.raises(ProtocolError, match="not for this round"):
        new[100].masked_input(stale, fresh["commits"], xs[100])


def test_a_cohort_below_the_owners_minimum_is_refused_before_any_key():
    client = SecAggClient(1, b"r", min_cohort=5)
    with pytest.raises(ProtocolError, match="below the 5 this owner requires"):
        client.advertise(cohort=[1, 2, 3, 4], neighbours=[1, 2, 3, 4], threshold=3)
    assert client._c is None


@pytest.mark.parametrize("threshold", [1, 2, 7])
def test_a_threshold_a_server_could_unmask_alone_is_refused(threshold):
    with pytest.raises(ProtocolError, match="threshold"):
        SecAggClient(1, b"r").advertise(cohort=list(range(1, 7)), neighbours=list(range(1, 7)), threshold=threshold)


def resigned(client, entry, **changes):
    """A client's stage-0 keys changed and signed again by that client (a fellow client that
    sends what it likes under its own signature)."""
    from fedsd.secure.secagg_primitives import _advert

    out = {**entry, **changes}
    out["sig"] = client.identity.sign(_advert(client.round_id, client.me, client.cohort, client.threshold,
                                              out["c"], out["s"], out["v"]))
    return out


def test_a_low_order_key_and_the_clients_own_keys_changed_are_refused():
    """A fellow client that advertises a low-order c or s key under its own signature is refused
    at stage 1, named, before anything is drawn (its s key used to fail only at stage 2)."""
    for which in ("c", "s"):
        xs = vectors(3)
        server = SecAggServer(b"r", list(xs), D)
        clients = {i: SecAggClient(i, b"r") for i in xs}
        server.collect_keys({i: c.advertise(**server.setup(i)) for i, c in clients.items()})
        keys = server.keys_for(100)
        evil = resigned(clients[101], keys[101], **{which: bytes(32)})
        with pytest.raises(ProtocolError, match=r"agrees on no secret \(culprit: 101\)|culprit: 101"):
            clients[100].share_keys({**keys, 101: evil})
        assert clients[100]._b == b""  # nothing drawn
    with pytest.raises(ProtocolError, match="own keys"):
        clients[101].share_keys({**server.keys_for(101), 101: keys[102]})


def test_masks_are_a_keystream_not_a_32_bit_seed():
    """Two seeds that agree on every 32-bit fold (Flower's XOR fold) give unrelated masks."""
    a = bytes(range(32))
    b = bytes(x ^ (0xFF if i in (0, 4) else 0) for i, x in enumerate(a))  # the same XOR of its 4-byte words
    fold = lambda s: np.bitwise_xor.reduce(np.frombuffer(s, dtype="<u4"))
    assert fold(a) == fold(b)
    assert np.mean(expand_mask(a, 1000) == expand_mask(b, 1000)) < 0.01


def test_distributed_noise_options_are_checked_before_any_work():
    from fedsd.settings.run import TrainConfig
    from fedsd.errors import ConfigError
    from fedsd.settings.federation import FedConfig
    from fedsd.simulation.secure_federation import check_options

    cfg = TrainConfig(dataset="fmnist")
    with pytest.raises(ConfigError, match="needs --secure-aggregation"):
        check_options(cfg, FedConfig(noise="distributed"))
    with pytest.raises(ConfigError, match="--local-epochs 2"):
        check_options(cfg, FedConfig(noise="distributed", secure_aggregation=True, local_epochs=2))
    with pytest.raises(ConfigError, match="--honest-clients 11"):
        check_options(cfg, FedConfig(noise="distributed", secure_aggregation=True, honest_clients=11))
    with pytest.raises(ConfigError, match="--method dpkd"):
        check_options(TrainConfig(dataset="fmnist", method="dpkd"),
                      FedConfig(noise="distributed", secure_aggregation=True))
