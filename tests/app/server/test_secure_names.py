"""A secure run names its clients as their operators know them: by roster name, else by the node
id `flwr supernode list` prints (unsigned 64 bits), never by the protocol id alone, which without a
roster is the node id's low 63 bits (2^63 less where the top bit is set); and its result keeps the
noise plan and those names for the summary (tests/training/test_run_summary.py)."""
from types import SimpleNamespace

from fedsd.app import secure_sum
from fedsd.app.server import strategy
from fedsd.app.server.secure_rounds import SecureRounds
from fedsd.app.server.stage_exchange import Exchange
from fedsd.secure.identity import Identity, Member, Roster

HIGH_NODE = (1 << 63) + 12345  # a SuperLink's node id with its top bit set


def test_a_client_is_named_by_its_roster_name_else_by_its_node_id_as_flower_prints_it():
    exchange = Exchange(None, 1, 1.0, [HIGH_NODE, 7])
    client = secure_sum.secagg_id(HIGH_NODE)
    assert client == HIGH_NODE - (1 << 63)  # what fedsd printed as "client …"
    assert exchange.name(client) == f"node {HIGH_NODE}" and exchange.name(7) == "node 7"
    owner = Identity()
    named = Exchange(None, 1, 1.0, [HIGH_NODE], Roster([Member("owner-a", owner.public)]))
    named.identified({owner.id: HIGH_NODE})
    assert named.name(owner.id) == "owner-a"


def test_each_rounds_log_line_names_its_clients(monkeypatch):
    said = []
    monkeypatch.setattr(strategy, "log", lambda level, text, *args: said.append(text % args))
    record = dict(round=2, trained=[101, 102], refused={"103": "budget"}, missed=[{"client": 104}], seconds=1.0)
    strategy.round_log(record, 4, 0.5, 1.0, {101: "owner-a", 102: f"node {HIGH_NODE}", 103: "owner-c"})
    assert said[0].endswith(f"trained owner-a, node {HIGH_NODE}, refused owner-c, missed 104")


def test_the_result_keeps_the_plan_and_the_clients_names():
    from fedsd.secure.distributed_noise import NoisePlan

    rounds = SecureRounds.__new__(SecureRounds)  # what a run leaves: the plan and the names it met
    plan = NoisePlan(0.8, 0.1, 0.05, 100.0, 2, 1000)
    rounds.distributed, rounds.noise, rounds.names = True, plan, {102: f"node {HIGH_NODE}", 101: "owner-a"}
    assert rounds.result_facts() == {"client_names": {"101": "owner-a", "102": f"node {HIGH_NODE}"},
                                     "noise": plan.to_dict()}
    assert rounds.named("101") == "owner-a" and rounds.named(f"node {HIGH_NODE}") == f"node {HIGH_NODE}"
    assert rounds.named("99") == "client 99"


def test_a_federations_result_carries_what_its_secure_rounds_kept():
    from fedsd.app.server.server_app import federation_result
    from fedsd.settings.federation import FedConfig
    from fedsd.settings.run import TrainConfig

    fed = FedConfig(num_clients=2, rounds=1)
    side = SimpleNamespace(cfg=TrainConfig(dataset="fmnist", method="dpsgd").resolved(), device="cpu", source="x",
                           test=(), strategy=SimpleNamespace(client_epsilon={101: 0.5}, round_clients={}),
                           book=SimpleNamespace(rounds=[], final_accuracy=lambda: 0.5,
                                                final_validation_accuracy=lambda: None))
    launch = SimpleNamespace(fed=fed, experiment_id="e", round=0)
    secure = SimpleNamespace(result_facts=lambda: {"client_names": {"101": "owner-a"}})
    assert federation_result(launch, side, 1.0, secure).to_dict()["client_names"] == {"101": "owner-a"}
    assert "client_names" not in federation_result(launch, side, 1.0).to_dict()
