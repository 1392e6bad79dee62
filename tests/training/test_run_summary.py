"""What a deployed distributed-noise run says at its end: one DP-SGD step a round (not "1 local
epoch(s)"), the σ of the summed noise and the t it counts on (not "σ = -"), and its owners by their
roster names (not their protocol ids)."""
from fedsd.training.summary import run_summary

OWNERS = {"4611686018427387905": "owner-a", "123": "owner-b", "9": "node 9223372036854775817"}


def deployed(**more) -> dict:
    """A deployed run's result.json as the ServerApp writes it under noise=distributed: each owner
    reports its ε only (no σ), and the rounds name owners by protocol id."""
    rounds = [dict(round=r, trained=[4611686018427387905, 123], client_epsilon={"4611686018427387905": 0.4 * r,
                                                                              "123": 0.4 * r},
                   refused={"9": "secure aggregation refused: budget"}, rejected={}, missed=[], skipped=[])
              for r in (1, 2)]
    return dict(dataset="fmnist", method="dpsgd", test_accuracy=0.7, wall_seconds=30.0, epsilon_target=2.0, delta=1e-5,
                epsilon_spent=0.8, num_clients=3, rounds=rounds,
                noise_multiplier={"4611686018427387905": None, "123": None},
                config=dict(batch_size=256, lr=2.0, momentum=0.9, epochs=1),
                federation=dict(rounds=2, local_epochs=1, local_steps=0, noise="distributed", privacy_unit="record",
                                secure_aggregation=True, honest_clients=0, num_clients=3), **more)


def test_a_distributed_run_says_one_step_a_round_and_the_sums_sigma():
    plan = dict(noise_multiplier=1.234, clip=0.1, sample_rate=0.01, expected_batch=256.0, honest=2, dim=1000)
    text = run_summary(deployed(noise=plan, client_names=OWNERS), "/tmp/run")
    assert "local epoch" not in text and "σ = -" not in text
    assert ("σ = 1.234 (of the sum: each client adds a Skellam share, any t = 2 of them carry it all; over the clip), "
            "2 rounds of one DP-SGD step (B the federation's)") in text
    assert "0.800–0.800 across the 2 clients that trained, if at least 2 of the 3 clients are honest" in text
    plain = run_summary(deployed(), "/tmp/run")  # a result of an earlier fedsd, without the plan: σ said in words
    assert "σ = - (distributed noise: σ is that of the sum of the clients' shares, over the clip" in plain


def test_owners_are_listed_by_their_roster_names_where_a_roster_is_in_use():
    text = run_summary(deployed(client_names=OWNERS), "/tmp/run")
    assert "  clients        owner-b, owner-a trained (by roster name, else node id" in text
    assert "  not trained    node 9223372036854775817 in rounds 1–2: refused: secure aggregation refused: budget" \
        in text
    assert "4611686018427387905" not in text and "client 123" not in text
    assert "client 9 in rounds 1–2" in run_summary(deployed(), "/tmp/run")  # no names: as before
