"""Distributed noise in a deployment: the owners' data services' handlers in this
process, with real state folders and ledgers (tests.app.client.test_secure_aggregation's `owners`), driven
by the server's SecureRounds. A round's decoded sum is the sum of what each service kept
(secagg-keep-inputs) and moves the global model through the server's optimizer; a masked reply
carries nothing beside its vector that depends on the owner's data; each owner's ledger charges
the Skellam mechanism as an independent accountant does; every bad input is refused before
anything is drawn, the ledger's bytes unchanged."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from fedsd.app.client import secure_stages as service
from fedsd.app.client.secure_owner import StageRefused
from fedsd.secure import distributed_noise as dn
from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig, client_config
from fedsd.privacy.accounting import RDP_ORDERS, SKELLAM, PrivacyFilter
from fedsd.app.records import model_to_record, record_to_model
from tests.app.client.test_secure_aggregation import (EXPERIMENT, IDS, masked_message, owners, stage,  # noqa: F401
                                           state_files, up_to_shares)

EPSILON, ROUNDS, BATCH, RECORDS = 2.0, 2, 50, 300
Q = BATCH / RECORDS


def _settings():
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", batch_size=BATCH, subset=RECORDS, threads=1, epsilon=EPSILON)
    fed = FedConfig(num_clients=3, rounds=ROUNDS, client_data="own", secure_aggregation=True, noise="distributed",
                     sample_rate=Q, honest_clients=3)
    return cfg, fed


@pytest.fixture
def federation(owners):
    """The three owners under a distributed-noise run: the run's settings, the server's side
    (its resolved config, the plan and its optimizer) and a SecureRounds over their handlers."""
    from fedsd.app.server.secure_plans import distributed_plan

    contexts, flat, arrays, tmp_path = owners
    for context in contexts.values():  # no roster here (tests/deployment/test_secure_aggregation_deploy.py has one)
        context.node_config["secagg-trust"] = "honest-but-curious"
    cfg, fed = _settings()
    flat = {**flat, "noise": "distributed", "secure-aggregation": True, "sample-rate": Q, "epsilon": EPSILON,
            "honest-clients": 3}
    return server_side(contexts, flat, arrays, tmp_path, cfg, fed, distributed_plan=distributed_plan)


def server_side(contexts, flat, arrays, tmp_path, cfg, fed, **more) -> SimpleNamespace:
    """The server's SecureRounds over the owners' handlers, each owner's masked reply kept as sent."""
    from fedsd.app.server.secure_rounds import SecureRounds
    from tests.secure.test_roster_keys_shares_and_bounds import _Grid

    server_cfg = client_config(cfg, FedConfig(num_clients=3, rounds=ROUNDS))
    replies = {}

    def tamper(kind, node, reply):
        if kind == "query.secagg_masked":
            replies[node] = reply
        return reply

    side = SimpleNamespace(strategy=SimpleNamespace(settings=flat, round_clients={}, client_epsilon={}),
                           cfg=server_cfg, num_classes=10)
    launch = SimpleNamespace(fed=fed, experiment_id=EXPERIMENT, round=0, out=tmp_path)
    rounds = SecureRounds(_Grid(contexts, tamper), side, launch)
    return SimpleNamespace(contexts=contexts, flat=flat, arrays=arrays, tmp_path=tmp_path, rounds=rounds,
                           plan=rounds.noise, replies=replies, cfg=server_cfg, fed=fed, **more)


def kept_inputs(tmp_path, server_round):
    return [np.load(tmp_path / f"state-{k}" / "secagg" / f"7-{EXPERIMENT}-{server_round}-{IDS[k]}.npy")
            for k in range(3)]


def fewer_records(tmp_path, k: int, n: int) -> None:
    """Owner k keeps only its first n training records (another data size than the others')."""
    path = tmp_path / "data" / f"client-{k}" / "data.npz"
    data = dict(np.load(path))
    data["x_train"], data["y_train"] = data["x_train"][:n], data["y_train"][:n]
    np.savez(path, **data)


@pytest.mark.slow  # three owners' rounds (real data, real ledgers)
def test_a_round_sums_the_kept_contributions_and_the_server_steps_on_the_decoded_sum(federation, monkeypatch):
    from fedsd.secure.distributed_step import ServerOptimizer
    from fedsd.models.networks import model_for
    from fedsd.training.loop import DPTrainer

    f = federation
    fewer_records(f.tmp_path, 2, 40)  # owner 2 holds 40 records, the others 100
    rows = []
    real = DPTrainer.train_on_batch

    def spy(self, x, y, objective, callbacks=(), update=True, weight=None):
        rows.append((len(y), int(weight.sum()) if weight is not None else len(y)))
        return real(self, x, y, objective, callbacks, update, weight)

    monkeypatch.setattr(DPTrainer, "train_on_batch", spy)
    moved = f.rounds.one_round(1, f.arrays)
    record = f.rounds.records[0]
    assert record["abandoned"] is None and sorted(record["survivors"]) == list(IDS), record
    total = np.load(f.tmp_path / "secagg-sum-1.npy")
    kept = kept_inputs(f.tmp_path, 1)
    assert total.dtype == np.uint64 and len(total) == f.plan.dim
    assert np.array_equal(total, kept[0] + kept[1] + kept[2])  # exact, modulo 2^64
    decoded = dn.decode(total, f.plan)
    assert np.allclose(decoded, sum(dn.decode(k, f.plan) for k in kept), rtol=0, atol=1e-9)
    # The server's step: ServerOptimizer on the decoded sum over the plan's expected batch.
    start = record_to_model(f.arrays)["student"]
    expected = ServerOptimizer(model_for(f.cfg, 10), f.cfg.lr, f.cfg.momentum).step(start, decoded, f.plan)
    got = record_to_model(moved)["student"]
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    first = [k for k, v in start.items() if v.is_floating_point()][0]
    step = (got[first] - start[first]).double().ravel()
    assert torch.allclose(step, torch.from_numpy(-f.cfg.lr * decoded[:step.numel()] / BATCH), atol=1e-6)
    assert float(step.abs().max()) > 0
    # The noise is the plan's: the sum's std about z·Δ2/γ a coordinate, over a clipped signal of norm ≤ C·b.
    noise_std = f.plan.noise_multiplier * f.plan.l2 / f.plan.scale
    assert 0.8 < decoded.std() / noise_std < 1.3, (decoded.std(), noise_std)
    # Each owner's per-sample work covered the plan's padded bound, whatever its batch.
    from fedsd.secure import sum_bound

    pad = math.ceil(sum_bound.poisson_tail(f.plan.expected_batch, sum_bound.TAIL))
    assert [r[0] for r in rows] == [pad] * 3, rows
    assert len({r[1] for r in rows}) > 1 or rows[2][1] < 40, rows  # batches of different sizes, the same work
    print("padded rows", pad, "batches drawn", [r[1] for r in rows], "decoded std", decoded.std(), "planned",
          noise_std, "z", f.plan.noise_multiplier)
    # Each owner's ledger: one Skellam step at the plan's z_e and q.
    for k in range(3):
        entries = PrivacyFilter.from_state_dict(
            __import__("json").loads(next((f.tmp_path / f"state-{k}").glob("ledger-*.json")).read_text()),
            3.0, 1e-5).entries
        assert [(e["mechanism"], e["noise_multiplier"], e["sample_rate"], e["steps"]) for e in entries] == \
            [(SKELLAM, f.plan.gaussian_equivalent(), Q, 1)]
    # Every field beside the masked vector is the same for owners of 100 and 40 records.
    replies = [f.replies[n] for n in IDS]
    assert {tuple(sorted(r.keys())) for r in replies} == {("metrics", "secagg")}
    assert all(set(r["secagg"].keys()) == {"masked"} for r in replies)
    masked = [r["secagg"]["masked"] for r in replies]
    assert {(a.dtype, tuple(a.shape)) for a in masked} == {(masked[0].dtype, tuple(masked[0].shape))}
    metrics = [dict(r["metrics"]) for r in replies]
    assert metrics[0] == metrics[1] == metrics[2] == {"epsilon": f.plan.epsilon(1, 1e-5)}, metrics
    # The run's record keeps each summed client's ε by its protocol id (a reply names no partition).
    strategy = f.rounds.side.strategy
    assert strategy.client_epsilon == {i: f.plan.epsilon(1, 1e-5) for i in IDS}, strategy.client_epsilon
    assert sorted(strategy.round_clients[1]) == sorted(IDS)
    # A second round: momentum carried by the server's optimizer, the ledgers at two entries.
    f.rounds.one_round(2, moved)
    assert f.rounds.records[1]["abandoned"] is None
    assert np.array_equal(np.load(f.tmp_path / "secagg-sum-2.npy"), sum(kept_inputs(f.tmp_path, 2)))


def test_the_ledgers_skellam_charge_matches_dp_accountings_rdp_accountant():
    """The owner's ledger charges a Skellam step as the subsampled Gaussian at the plan's z_e at
    the integer orders where Skellam's bound holds (none elsewhere): dp_accounting's RDP
    accountant, at those orders, gives the same ε; and at every such order the charge is at
    least the subsampled Skellam's own RDP, the binomial sum over Agarwal et al.'s bound."""
    from dp_accounting import dp_event, rdp

    plan = dn.calibrate(2.0, 1e-5, 0.1, Q, 50.0, 400, honest=3, dim=7_850)
    z_e, delta, steps = plan.gaussian_equivalent(), 1e-5, 400
    ours = PrivacyFilter(math.inf, delta).epsilon([(z_e, Q, steps, SKELLAM)])
    orders = [a for a in RDP_ORDERS if float(a).is_integer() and 2 <= a <= 256]
    accountant = rdp.RdpAccountant(orders=orders)
    accountant.compose(dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(z_e)), steps)
    theirs = accountant.get_epsilon(delta)
    assert abs(ours - theirs) <= 1e-6 * theirs, (ours, theirs)
    assert ours >= plan.epsilon(steps, delta) - 1e-9  # a subset of the plan's orders: never less
    print("ledger ε", ours, "dp_accounting ε", theirs, "plan ε (orders 2..256)", plan.epsilon(steps, delta))
    from fedsd.privacy.accounting import entry_rdp

    charge = entry_rdp(z_e, Q, 1, SKELLAM)
    for i, a in enumerate(RDP_ORDERS):
        if a not in orders:
            assert charge[i] == math.inf
            continue
        a = int(a)
        terms = [math.comb(a, k) * (1 - Q) ** (a - k) * Q ** k *
                 math.exp((k - 1) * (dn.skellam_rdp(k, plan.l2, plan.l1, plan.variance) if k >= 2 else 0.0))
                 for k in range(a + 1)]
        skellam = math.log(sum(terms)) / (a - 1)
        assert skellam <= charge[i] * (1 + 1e-9), (a, skellam, charge[i])
    # A Gaussian entry is charged as before; a ledger with a Skellam entry names both mechanisms.
    ledger = PrivacyFilter(3.0, delta)
    ledger.spend(1.0, 0.01, 10)
    assert ledger.state_dict()["mechanism"] == "subsampled-gaussian"
    ledger.spend(z_e, Q, 1, mechanism=SKELLAM)
    saved = ledger.state_dict()
    assert saved["mechanism"] == "subsampled-gaussian+skellam"
    assert PrivacyFilter.from_state_dict(saved, 3.0, delta).epsilon() == ledger.epsilon()


def privacy_files(tmp_path) -> dict:
    """The owners' state files but the prepared-data cache and the pinned task, which reading
    the data writes, and the empty lock files (nothing of the privacy state): ledgers, experiment
    states, kept inputs."""
    return {p: b for p, b in state_files(tmp_path).items() if "data-cache" not in p.parts and p.name != "task.json"
            and p.suffix != ".lock"}  # (a lock file is empty: its name is all it holds)


def _refused_at_masked(f, change_flat=None, change_node=None, drop_share=False):
    contexts, node = f.contexts, IDS[0]
    if change_node:
        for c in contexts.values():
            c.node_config.update(change_node)
    from fedsd.secure import distributed_noise as noise

    flat = {**f.flat, **noise.to_settings(f.plan, ROUNDS)}
    flat = change_flat(flat) if change_flat else flat
    base, server = up_to_shares(contexts, 1, flat)  # every owner given the same (bad) settings
    shares = server.shares_for(node)
    if drop_share:  # the server tells this owner of two survivors of the share stage, below its t of 3
        other = next(j for j in shares["ciphertexts"] if j != node)
        shares = {k: {j: v for j, v in m.items() if j != other} for k, m in shares.items()}
    return lambda: service.masked_reply(masked_message(base, flat, f.arrays, shares), contexts[node])


def _plan(**changes):
    def change(flat):
        for field, how in changes.items():
            key = dn.PLAN_PREFIX + field
            flat[key] = how(flat[key])
        return flat
    return change


BAD = {
    "less noise than the owner's own": (dict(change_flat=_plan(**{"noise-multiplier": lambda z: z * 0.99})),
                                       "below this client's own"),
    "another q": (dict(change_flat=_plan(**{"sample-rate": lambda q: q * 1.01})), "sample_rate"),
    "another clip": (dict(change_flat=_plan(clip=lambda c: c * 2)), "clip"),
    "another length": (dict(change_flat=_plan(dim=lambda d: d + 1)), "dim"),
    "another number of rounds": (dict(change_flat=_plan(rounds=lambda r: r + 1)), "the plan's length"),
    "more than one local step": (dict(change_flat=lambda flat: {**flat, "local-epochs": 2}), "local-epochs"),
    "a plan over the lifetime budget": (dict(change_node={"max-epsilon": 1.0}), "this client allows at most"),
    "survivors below the owner's t": (dict(drop_share=True), "below the threshold"),
    "no roster and no trust in the server": (dict(change_node={"secagg-trust": "roster"}), "without secagg-roster"),
}


@pytest.mark.parametrize("case", sorted(BAD) + ["a cohort below the owner's t", "without secure aggregation"])
def test_a_bad_input_is_refused_before_anything_is_drawn(federation, monkeypatch, case):
    from fedsd.app.client import handler as local
    from fedsd.training.loop import DPTrainer

    f = federation
    monkeypatch.setattr(DPTrainer, "clipped_sum", lambda *a, **k: pytest.fail("drew a batch"))
    monkeypatch.setattr(local.SecretStream, "fresh", staticmethod(lambda: pytest.fail("drew a secret key")))
    if case == "a cohort below the owner's t":
        base = {"experiment-id": EXPERIMENT, "server-round": 1}
        attempt = lambda: service.advertise_reply(stage(base, cohort=list(IDS[:2]), neighbours=list(IDS[:2]),
                                                        threshold=2), f.contexts[IDS[0]])
        before, why = privacy_files(f.tmp_path), "below the 3 this owner requires"
    elif case == "without secure aggregation":  # a plain train message under noise=distributed
        content = RecordDict({"arrays": f.arrays, "config": ConfigRecord({**f.flat, "server-round": 1})})
        before = privacy_files(f.tmp_path)
        reply = local.train_reply(content, f.contexts[IDS[0]])
        assert "arrays" not in reply and "only inside a secure sum" in reply["refusal"]["reason"]
        assert privacy_files(f.tmp_path) == before
        return
    else:  # refused at the masked stage, or already at stage 0 (where the plan and the budget are tried first)
        kwargs, why = BAD[case]
        before = privacy_files(f.tmp_path)
        try:
            attempt = _refused_at_masked(f, **kwargs)
            before = privacy_files(f.tmp_path)  # the rounds joined at stage 0, before the masked stage's
        except StageRefused as refused:  # at stage 0: nothing joined, nothing written
            def attempt(refused=refused):
                raise refused
    with pytest.raises(StageRefused, match=why):
        attempt()
    assert privacy_files(f.tmp_path) == before  # the ledgers and every privacy file byte for byte
    assert not list(f.tmp_path.glob("state-*/ledger-*.json"))


def test_the_server_refuses_a_run_that_cannot_be_distributed_before_any_round():
    from fedsd.app.server.secure_plans import distributed_plan
    from fedsd.errors import ConfigError

    cfg, fed = _settings()
    cfg = client_config(cfg, FedConfig(num_clients=3, rounds=ROUNDS))
    for change, why in ((dict(local_epochs=2), "local-epochs"), (dict(sample_rate=0.0), "sample-rate"),
                        (dict(client_data="partition"), "client-data=partition: noise=distributed in a deployment"),
                        (dict(privacy_unit="client"), "privacy-unit=client trains each client's update without")):
        with pytest.raises(ConfigError, match=why):
            distributed_plan(cfg, FedConfig(**{**fed.__dict__, **change}), 10)
    plan, _ = distributed_plan(cfg, fed, 10)
    assert plan.sample_rate == Q and plan.expected_batch == BATCH and plan.honest == 3
    assert plan.epsilon(ROUNDS, cfg.delta) <= EPSILON
    assert dn.from_settings(dict(dn.to_settings(plan, ROUNDS))) == (plan, ROUNDS)
    with pytest.raises(ConfigError, match="noise-plan-dim"):
        dn.from_settings({**dn.to_settings(plan, ROUNDS), dn.PLAN_PREFIX + "dim": 1.5})


@pytest.mark.slow  # three owners' masked inputs (real data, real ledgers)
def test_a_service_killed_after_its_masked_input_leaves_the_round_abandoned_and_nothing_applied(federation):
    """Three owners, threshold 3: one killed after its masked input cannot be unmasked around
    (its self mask needs its shares of the others), so the round is abandoned before anything is
    unmasked and the model stays. With a fourth owner the round would complete without it, its
    survivors' shares still at least each owner's t (which each owner checks at the unmask)."""
    from tests.app.client.test_secure_aggregation import ServicesGrid

    f = federation

    class Killed(ServicesGrid):
        """IDS[2] gone after its masked input; a service's refusal an error reply, as Flower sends it."""

        def send_and_receive(self, messages, *, timeout=None):
            from flwr.app import Error, Message

            if messages and messages[0].metadata.message_type in ("query.secagg_confirm", "query.secagg_unmask"):
                self.gone.add(IDS[2])
            replies = []
            for m in messages:
                try:
                    replies += super().send_and_receive([m], timeout=timeout)
                except StageRefused as e:
                    replies.append(Message(Error(code=0, reason=str(e)), reply_to=m))
            return replies

    f.rounds.grid.inner = Killed(f.contexts)
    after = f.rounds.one_round(1, f.arrays)
    record = f.rounds.records[0]
    assert record["abandoned"] and "below the threshold" in record["abandoned"], record
    assert all("2 neighbours signed" in why for why in record["stages"]["unmask"]["failed"].values())
    assert all(np.array_equal(after[k].numpy(), f.arrays[k].numpy()) for k in f.arrays)
    assert not (f.tmp_path / "secagg-sum-1.npy").exists()


@pytest.mark.slow  # three owners' rounds (real data, real ledgers)
def test_a_sum_with_fewer_shares_than_the_plans_t_is_refused_and_nothing_applied(federation, monkeypatch):
    """The server's plan counts on t = 4 honest shares, above each owner's own t of 3: each owner
    refuses it (the others' shares, sized by the plan's t, would be below what its t counts on),
    and the round is abandoned, nothing applied. The server's own checks: it refuses a t above its
    three owners before round 1 (skipped here, to play a server that goes on), and a sum of three
    shares under the plan's t = 4, nothing applied."""
    from fedsd.app.server import secure_rounds
    from fedsd.app.server.secure_rounds import SecureRounds
    from fedsd.errors import ConfigError

    f = federation
    fed = FedConfig(**{**f.fed.__dict__, "honest_clients": 4})
    side = f.rounds.side
    launch = SimpleNamespace(fed=fed, experiment_id=EXPERIMENT, round=0, out=f.tmp_path)
    with pytest.raises(ConfigError, match="num-clients=3 - t 4"):
        SecureRounds(f.rounds.grid, side, launch)
    monkeypatch.setattr(secure_rounds, "round_graph", lambda fed, n: None)  # a server that goes on all the same
    rounds = SecureRounds(f.rounds.grid, side, launch)
    assert rounds.noise.honest == 4 and rounds.noise.noise_multiplier == f.plan.noise_multiplier  # z: not t's
    with pytest.raises(StageRefused, match="above this owner's own 3"):  # this grid passes it on as raised
        rounds.one_round(1, f.arrays)
    assert not (f.tmp_path / "secagg-sum-1.npy").exists()
    assert not list(f.tmp_path.glob("state-*/ledger-*.json"))  # refused before anything is charged
    from fedsd.secure.secagg_server import RoundAbandoned

    server = SimpleNamespace(culprits={})
    with pytest.raises(RoundAbandoned, match="below the plan's t = 4"):
        rounds._step(f.arrays, np.zeros(rounds.noise.dim, dtype=np.uint64), 3, server, 1)


class _Killed(Exception):
    """The server process stopped in the middle of a round (the SuperLink or the ServerApp killed)."""


def _server(launch, server_cfg, sums: dict, kill_at: int | None = None):
    """The server of a distributed-noise run as the ServerApp puts it together (its strategy and
    round book, a resumed launch's restored), each round's decoded sum the fixed `sums[round]` in
    place of the owners' (SecureRounds.one_round's protocol), stopped at round `kill_at`."""
    from fedsd.app.server.rounds import RoundBook
    from fedsd.app.server.secure_rounds import SecureRounds
    from fedsd.app.server.strategy import RecordingStrategy, base_strategy

    launch.out.mkdir(exist_ok=True)  # as the ServerApp makes it (fresh_out_dir)
    strategy = RecordingStrategy(base_strategy(launch.fed), launch.fed, round_offset=launch.round)
    book = RoundBook(strategy, None, None, rounds_total=launch.fed.rounds, start_round=launch.round, out=launch.out,
                     settings=launch.settings, experiment_id=launch.experiment_id, progress=False, description="")
    if launch.resumed:
        strategy.load_state_dict(launch.strategy)
        book.load_state_dict(launch.book)
    side = SimpleNamespace(cfg=server_cfg, num_classes=10, strategy=strategy, book=book)
    rounds = SecureRounds(SimpleNamespace(), side, launch)

    def one_round(server_round, arrays):
        if server_round == kill_at:
            raise _Killed
        return rounds._step(arrays, sums[server_round], 3, SimpleNamespace(culprits={}), server_round)[0]

    rounds.one_round = one_round
    return rounds


def test_a_resumed_run_steps_with_the_server_optimizers_momentum_as_an_uninterrupted_one(tmp_path):
    """Under noise=distributed the server's SGD carries momentum from round to round. A run
    killed after round 2's checkpoint and resumed from it gives, with the same decoded sums,
    the global model of an uninterrupted run bit for bit: the checkpoint holds the optimizer's
    momentum buffers and the resumed run goes on from them (it restarted momentum before)."""
    from fedsd.app.server import checkpoint
    from fedsd.app.server.secure_plans import distributed_plan
    from fedsd.training.loop import initial_model

    cfg, fed = _settings()
    fed = FedConfig(**{**fed.__dict__, "rounds": 4})
    server_cfg = client_config(cfg, FedConfig(num_clients=3, rounds=4))
    assert server_cfg.momentum > 0
    plan, _ = distributed_plan(server_cfg, fed, 10)
    rng = np.random.default_rng(0)
    sums = {r: np.rint(rng.normal(0, math.sqrt(plan.variance), plan.dim)).astype(np.int64).view(np.uint64)
            for r in range(1, 5)}
    start = model_to_record(initial_model(server_cfg, 10))

    whole = _server(checkpoint.start(cfg, fed, tmp_path / "whole"), server_cfg, sums).run(start)
    with pytest.raises(_Killed):
        _server(checkpoint.start(cfg, fed, tmp_path / "killed"), server_cfg, sums, kill_at=3).run(start)
    resume = FedConfig(**{**fed.__dict__, "resume_dir": str(tmp_path / "killed")})
    launch = checkpoint.start(cfg, resume, None)
    assert launch.round == 2 and launch.optimizer is not None
    resumed = _server(launch, server_cfg, sums).run(model_to_record(launch.model))
    moved = [k for k in whole if not np.array_equal(whole[k].numpy(), start[k].numpy())]
    assert moved and all(np.array_equal(resumed[k].numpy(), whole[k].numpy()) for k in whole), \
        [k for k in whole if not np.array_equal(resumed[k].numpy(), whole[k].numpy())]


@pytest.mark.slow  # three owners' masked inputs (real data, real ledgers)
def test_an_owners_draw_rate_is_set_from_public_numbers_never_from_the_records_it_holds(federation, monkeypatch):
    """A review of the padding to q × secagg-max-records: owner_rate took the owner's own record
    count, so each record moved the rate the others were drawn at (19, 20, 21 records: 0.489,
    0.465, 0.442), and ε 5.25-5.62 was spent where 3.72 was charged. The rate is now set from the
    owner's own max-records K, else the run's M, which can only lower it: owners of 100, 60 and 61
    records draw at one rate. With K an owner's step is padded to q × K rows; data above its K is
    refused before the charge, the reason naming no count."""
    from fedsd.app.client.step_padding import owner_rate, padded_rows
    from fedsd.secure import distributed_step
    from fedsd.training.loop import DPTrainer

    f = federation
    fewer_records(f.tmp_path, 1, 60)
    fewer_records(f.tmp_path, 2, 61)
    f.flat["secagg-max-records"] = 10_000  # the server's M
    rates, rows, real, real_batch = [], [], distributed_step.contribution, DPTrainer.train_on_batch

    def spy(*args, **kwargs):
        rates.append(kwargs["draw_rate"])
        return real(*args, **kwargs)

    def batch(self, x, y, *args, **kwargs):
        rows.append(len(y))
        return real_batch(self, x, y, *args, **kwargs)

    monkeypatch.setattr(distributed_step, "contribution", spy)
    monkeypatch.setattr(DPTrainer, "train_on_batch", batch)
    moved = f.rounds.one_round(1, f.arrays)
    pad = padded_rows(f.plan, 4 * 28 * 28)  # no owner set K: the federation's E
    assert rows == [pad] * 3
    assert rates == [owner_rate(f.plan, 10_000, pad)] * 3 and rates[0] < Q  # one rate for 100, 60 and 61 records
    assert owner_rate(f.plan, 100, pad) == Q  # (the owner's own count gave q)
    for k in range(3):
        f.contexts[IDS[k]].node_config["max-records"] = 200
    rates.clear(), rows.clear()
    moved = f.rounds.one_round(2, moved)
    own_pad = padded_rows(f.plan, 4 * 28 * 28, 200)
    assert own_pad < pad and rows == [own_pad] * 3 and rates == [owner_rate(f.plan, 200, own_pad)] * 3
    assert len(ledger_entries(f.tmp_path, 0)) == 2
    # data above the owner's own K: refused (at advertise, and again at the masked stage before its charge)
    from fedsd.app.client.step_padding import records_bound

    side = SimpleNamespace(node=SimpleNamespace(max_records=80), fed=SimpleNamespace(secagg_max_records=10_000))
    with pytest.raises(StageRefused) as refused:
        records_bound(side, 100)
    assert str(refused.value) == ("secure aggregation refused: this owner's max-records does not fit its data (its "
                                  "owner's log says how)")
    assert records_bound(side, 80) == 80 and records_bound(SimpleNamespace(node=SimpleNamespace(max_records=0),
                                                                           fed=side.fed), 10**6) == 10_000


def ledger_entries(tmp_path, k: int) -> list:
    import json

    return PrivacyFilter.from_state_dict(json.loads(next((tmp_path / f"state-{k}").glob("ledger-*.json")).read_text()),
                                         3.0, 1e-5).entries
