"""scripts/deploy-local.sh's options, before any process starts: a secure, distributed-noise
trial on this machine takes what it needs from the data it hands out (and says so), each owner
can have its own node config, a recipe gives the settings, and what cannot run is refused with
the option to change. A finished run that trained nothing is an error, with each reason."""
import argparse
import json

import numpy as np
import pytest

from fedsd.app.client.node_config import owner_pairs

from fedsd.deployment import deploy_local as dl
from fedsd.errors import ConfigError
from fedsd.training.summary import nothing_trained


def folders(tmp_path, sizes) -> str:
    """Client folders as `fedsd split-data --format npz` writes them (the records counted, not read)."""
    for k, n in enumerate(sizes):
        (tmp_path / f"client-{k}").mkdir()
        np.savez_compressed(tmp_path / f"client-{k}" / "data.npz", x_train=np.zeros((n, 28, 28, 1), np.uint8),
                            y_train=np.zeros(n, np.int64))
    return str(tmp_path)


def parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    dl.add_deploy_arguments(p)
    return p.parse_args([*argv, "--out", "o"])


def secure(data: str, *more: str) -> argparse.Namespace:
    return parsed("--clients", "3", "--rounds", "4", "--secure-aggregation", "--noise", "distributed", "--isolate",
                  "--client-data", data, "--node-config", "max-epsilon=10", *more)


def test_distributed_noise_takes_its_sample_rate_from_the_records_handed_out(tmp_path):
    args, said = secure(folders(tmp_path, (500, 300, 200)), "--batch-size", "50"), []
    values = dl.run_config_from_args(args)
    assert dl.secure_owners(args, values, echo=said.append) is True  # identities and a roster, under --isolate
    assert values["sample-rate"] == 50 / 1000 and values["secure-sum"] == "multi-round"
    assert said[0].startswith("deploy-local: secure-sum=multi-round: the owners set secure aggregation up once")
    said = said[1:]
    assert "sample-rate=0.05" in said[0] and "1000 training records" in said[0]
    # each owner's bound on its records, its folder's count (its pad: q times that)
    assert dl.node_configs(args) == [f"max-epsilon=10 max-records={n}" for n in (500, 300, 200)]
    assert "max-records=500,300,200 for client(s) 0,1,2" in said[1]
    (tmp_path / "same").mkdir()
    same, said = secure(folders(tmp_path / "same", (100,) * 4), "--batch-size", "50", "--clients", "4"), []
    dl.secure_owners(same, dl.run_config_from_args(same), echo=said.append)
    assert "deploy-local: max-records=100 for each of the 4 clients: each owner's bound" in said[2]  # said once
    given = secure(str(tmp_path), "--batch-size", "50", "--run-config", "sample-rate=0.01 secure-sum=protocol",
                   "--node-config-for", "1", "max-records=900")
    values, said = dl.run_config_from_args(given), []
    dl.secure_owners(given, values, echo=said.append)
    assert values["sample-rate"] == "0.01" and dl.node_configs(given)[1] == "max-epsilon=10 max-records=900"
    assert values["secure-sum"] == "protocol"  # the user's own protocol kept, unsaid
    assert said == ["deploy-local: max-records=500,200 for client(s) 0,2: each owner's bound on its records, its "
                    "folder's count; its step is padded to q times that many and its draw rate set from it, "
                    "whatever it holds (--node-config-for K 'max-records=…' sets another)"]  # the user's own kept


def test_client_level_takes_dpsgd_and_an_epoch_of_the_largest_owners_records(tmp_path):
    args, said = secure(folders(tmp_path, (500, 300, 200)), "--privacy-unit", "client", "--update-clip", "0.5",
                        "--batch-size", "32"), []
    values = dl.run_config_from_args(args)
    dl.secure_owners(args, values, echo=said.append)
    assert values["method"] == "dpsgd" and values["local-steps"] == 16  # ⌈500 / 32⌉, the same for all
    assert "sample-rate" not in values  # every owner every round
    with pytest.raises(ConfigError, match="method=dp3sd"):  # one the user chose is checked as the server checks it
        bad = secure(str(tmp_path), "--privacy-unit", "client", "--update-clip", "0.5", "--method", "dp3sd")
        dl.secure_owners(bad, dl.run_config_from_args(bad), echo=said.append)


@pytest.mark.parametrize("drop, needle", [("--isolate", "add --isolate"), ("--client-data", "--client-data DIR")])
def test_distributed_noise_that_cannot_run_here_names_what_to_add(tmp_path, drop, needle):
    argv = ["--clients", "3", "--rounds", "4", "--secure-aggregation", "--noise", "distributed", "--isolate",
            "--client-data", folders(tmp_path, (10, 10, 10)), "--node-config", "max-epsilon=10"]
    at = argv.index(drop)
    argv = argv[:at] + argv[at + (2 if drop == "--client-data" else 1):]
    args = parsed(*argv)
    with pytest.raises(ConfigError, match=needle):
        dl.secure_owners(args, dl.run_config_from_args(args))


def test_each_owner_can_have_its_own_node_config(tmp_path):
    args = secure(folders(tmp_path, (10, 10, 10)), "--node-config-for", "2", "max-epsilon=1",
                  "--node-config-for", "0", "max-delta=1e-6")
    configs = dl.node_configs(args)
    assert configs == ["max-epsilon=10 max-delta=1e-6", "max-epsilon=10", "max-epsilon=1"]
    # the owner's own in place of the common pair: an owner's data service refuses a key given twice
    assert [owner_pairs(c)["max-epsilon"] for c in configs] == [10, 10, 1]
    for bad, needle in ((("3", "max-epsilon=1"), "--node-config-for 3: a client's index, 0 to 2"),
                        (("x", "max-epsilon=1"), "--node-config-for x"),
                        (("1", "max-epsilon=one"), "--node-config-for 1: .*max-epsilon")):
        with pytest.raises(ConfigError, match=needle):
            dl.node_configs(secure(str(tmp_path), "--node-config-for", *bad))
    no_budget = parsed("--clients", "2", "--rounds", "1", "--client-data", str(tmp_path),
                       "--node-config-for", "0", "max-epsilon=3")
    with pytest.raises(ConfigError, match="client 1 has none"):  # every owner of its own data needs a budget
        dl.node_configs(no_budget)


def test_a_recipe_gives_the_settings_and_the_flags_take_its_place(tmp_path, capsys):
    args = parsed("--recipe", "distributed-features", "--rounds", "3")
    dl.with_recipe(args, "simulate")
    values = dl.run_config_from_args(args)
    assert values["num-clients"] == 10 and values["num-server-rounds"] == 3 and values["noise"] == "distributed"
    assert values["batch-size"] == 8192 and values["features"] == "scatter"
    assert dl.main(["--rounds", "2", "--out", str(tmp_path / "o")]) == 2  # no --clients, no recipe
    assert "--clients is required (or a --recipe that sets it)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_run_that_trained_nothing_says_why_with_each_reasons_count(tmp_path):
    rounds = [dict(round=r, trained=[], refused={"0": "budget: run asks ε=3", "1": "budget: run asks ε=3"},
                   rejected={}, missed=[dict(client=2, reason="no reply before the timeout")], skipped=[])
              for r in (1, 2)]
    result = dict(num_clients=3, rounds=rounds)
    (tmp_path / "secure-aggregation.json").write_text(json.dumps([{"round": 1, "abandoned": "2 of 3 refused"}]))
    why = nothing_trained(result, tmp_path)
    assert why.startswith("no client trained in any of the 2 rounds, so the model is the initial one")
    assert "refused: budget: run asks ε=3 (4×)" in why and "missed: no reply before the timeout (2×)" in why
    assert "secure aggregation abandoned the round: 2 of 3 refused" in why
    rounds[1]["trained"] = [2]
    assert nothing_trained(result, tmp_path) is None
    assert nothing_trained(dict(num_clients=None, rounds=[]), tmp_path) is None  # central: not a federation's
    # a simulated secure sum's rounds count their survivors: a run that trained said it trained nothing, exit 1
    simulated = [dict(round=1, survivors=0), dict(round=2, survivors=10)]
    assert nothing_trained(dict(num_clients=10, rounds=simulated), tmp_path) is None
    assert nothing_trained(dict(num_clients=10, rounds=simulated[:1]), tmp_path).startswith("no client trained")


def test_the_nodes_pulls_are_spread_with_their_number():
    """--pull-interval's default: 0.5 s up to twenty nodes, then long enough that all of them pull
    the SuperLink 40 times a second at most (a hundred at 0.5 s broke a two-core SuperLink's first
    push), and never longer than Flower's own 3 s."""
    from fedsd.deployment.node_options import spread_pulls

    assert [spread_pulls(n) for n in (1, 10, 20, 40, 100, 1000)] == [0.5, 0.5, 0.5, 1.0, 2.5, 3.0]
