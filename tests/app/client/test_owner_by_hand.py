"""An owner run by hand, as a new user types it from the deployment guide: its identity made
from a state folder alone, a path given without TOML's quotes, a roster too short for the
colluders it allows refused with the arithmetic, a server's default t that owners left at their
defaults take, and the service saying when it is ready."""
import os

import pytest

from fedsd.app.client import owner_service
from fedsd.app.client.node_config import (KEYS, NodeConfigError, fewest_clients, identity_config, owner_pairs,
                                          pairs_of, parse)
from fedsd.secure.identity import Identity, parse_public


def run_main(capsys, *argv) -> tuple[int, str, str]:
    from fedsd.cli.main import main

    umask = os.umask(0o022)
    try:  # the service sets its own umask (0077): this process's is put back
        code = main(list(argv))
    finally:
        os.umask(umask)
    said = capsys.readouterr()
    return code, said.out, said.err


def test_an_identity_needs_only_the_state_folder_and_a_path_may_go_unquoted(tmp_path, capsys):
    """`fedsd data-service --identity --node-config "max-epsilon=3 state-dir=/some/path"` was refused
    twice: the path was not TOML (unquoted) and partition-id was required. The identity is made in
    the state folder alone; a string's value unquoted is that string."""
    state = tmp_path / "state"
    code, line, err = run_main(capsys, "data-service", "--identity", "--node-config",
                               f"max-epsilon=3 state-dir={state}")
    assert code == 0, err
    assert len(parse_public(line.strip())) == 32 and (state / "identity.key").stat().st_mode & 0o777 == 0o600
    code, again, err = run_main(capsys, "data-service", "--identity", "--node-config", f"state-dir='{state}'")
    assert code == 0 and again == line, err  # the same key, quoted or not, without a budget
    code, _, err = run_main(capsys, "data-service", "--identity", "--node-config", f"state-dri={state}")
    assert code == 2 and "node-config state-dri: not a key fedsd reads" in err  # a misspelt key is still refused
    assert identity_config({"state-dir": str(state), "data": str(tmp_path / "not-yet")}).owns_data  # not read


def test_unquoted_strings_are_taken_and_what_cannot_be_read_shows_the_form_to_type(tmp_path):
    pairs = pairs_of("partition-id=0 max-epsilon=inf state-dir=/srv/owner/state data='/srv/my data' "
                     "randomness=secret federated-evaluation=true max-delta=1e-6")
    assert pairs == {"partition-id": 0, "max-epsilon": float("inf"), "state-dir": "/srv/owner/state",
                     "data": "/srv/my data", "randomness": "secret", "federated-evaluation": True, "max-delta": 1e-6}
    assert KEYS["state-dir"].type is str and KEYS["max-epsilon"].type is float
    for text, said in (("max-epsilon=three", "max-epsilon=three is not a number, true or false, or a string in quotes"),
                       ("state-dir=/srv/my data", "'data' is not a key=value pair (a value with a space goes in "
                                                  "quotes: data='/srv/owner data')"),
                       ("max-epsilon=3 max-epsilon=4", "max-epsilon given twice")):
        with pytest.raises(NodeConfigError, match="--node-config") as e:
            owner_pairs(text)
        assert said in str(e.value)
    (tmp_path / "owner.toml").write_text("max-epsilon = 3\nstate-dir = '/srv/owner/state'\n")
    assert owner_pairs(str(tmp_path / "owner.toml")) == {"max-epsilon": 3, "state-dir": "/srv/owner/state"}
    with pytest.raises(NodeConfigError, match="partition-id: required .*--identity` needs only state-dir"):
        parse(owner_pairs("max-epsilon=3 state-dir=/srv/owner/state"))


def roster(tmp_path, members: int):
    path = tmp_path / f"roster-{members}"
    path.write_text("".join(f"owner-{k} {Identity().line()}\n" for k in range(members)))
    path.chmod(0o644)
    return path


def test_a_roster_too_short_for_the_colluders_an_owner_allows_is_refused_with_the_arithmetic(tmp_path):
    """Three owners, each with secagg-max-colluders=1: no round could pass an owner's checks (it
    needs t + 2f = 4 clients, and more than 3f), which the service said only at the first round,
    as a threshold out of range. Refused at start, saying what is needed."""
    config = {"partition-id": 0, "state-dir": str(tmp_path / "state"), "secagg-max-colluders": 1}
    with pytest.raises(NodeConfigError) as e:
        parse({**config, "secagg-roster": str(roster(tmp_path, 3))})
    said = str(e.value)
    assert "secagg-max-colluders=1 with secagg-min-clients=2: a round needs at least 4 clients" in said
    assert "the roster lists 3 owner(s): add owners to the roster, or lower secagg-max-colluders to 0" in said
    assert parse({**config, "secagg-roster": str(roster(tmp_path, 4))}).secagg_max_colluders == 1
    assert parse({**config, "secagg-max-colluders": 0, "secagg-roster": str(roster(tmp_path, 3))})


@pytest.mark.parametrize("t, f", [(2, 0), (2, 1), (3, 1), (2, 2), (4, 2)])
def test_the_fewest_clients_are_those_an_owners_own_checks_take(t, f):
    """fewest_clients agrees with SecAggClient.advertise: at that many clients some threshold
    passes every check of an owner with these t and f, and at one fewer none does."""
    from fedsd.secure.secagg import ProtocolError, SecAggClient

    def some_threshold_passes(n: int) -> bool:
        cohort = list(range(1, n + 1))
        for threshold in range(1, n + 1):
            try:
                SecAggClient(1, b"round", min_cohort=t, max_colluders=f).advertise(cohort, cohort, threshold)
                return True
            except ProtocolError:
                pass
        return False

    n = fewest_clients(t, f)
    assert some_threshold_passes(n) and not some_threshold_passes(n - 1)


def test_a_deployments_default_t_is_one_every_owner_left_at_its_defaults_takes():
    """honest-clients 0 meant every client in a deployment too: with three owners the plan's t was
    3, and each owner, at its default secagg-min-clients=2, refused a t above its own."""
    from fedsd.app.client.node_config import NodeConfig
    from fedsd.app.server.secure_plans import distributed_plan
    from fedsd.settings.federation import FedConfig, client_config, deployed_honest_clients
    from fedsd.settings.run import TrainConfig

    fed = FedConfig(num_clients=3, rounds=2, client_data="own", secure_aggregation=True, noise="distributed",
                    sample_rate=0.1)
    cfg = client_config(TrainConfig(dataset="fmnist", method="dpsgd", batch_size=50, epsilon=2.0, threads=1), fed)
    plan, _ = distributed_plan(cfg, fed, 10)
    assert plan.honest == deployed_honest_clients(fed) == NodeConfig().secagg_min_clients == 2
    assert distributed_plan(cfg, FedConfig(**{**fed.__dict__, "honest_clients": 3}), 10)[0].honest == 3


def test_the_owners_service_says_once_where_it_listens_when_it_is_ready(tmp_path, capsys, monkeypatch):
    class Ready(Exception):
        pass

    class Listener:
        def accept(self):
            raise Ready  # the line is said before the first connection is waited for

    monkeypatch.setenv("FEDSD_TUNE_PROCESS", "0")
    monkeypatch.setattr(owner_service.faulthandler, "register", lambda *args, **kwargs: None)  # this process's own
    monkeypatch.setattr(owner_service.DataService, "_listen", lambda self: Listener())
    node = parse({"partition-id": 1, "state-dir": str(tmp_path / "state"), "max-epsilon": 3.0})
    service = owner_service.DataService(tmp_path / "owner.sock", node, (65533,))
    with pytest.raises(Ready):
        service.serve()
    err = capsys.readouterr().err
    assert err.count("fedsd data-service: ready:") == 1
    assert (f"ready: listening at {tmp_path / 'owner.sock'} (the SuperNode's service='{tmp_path / 'owner.sock'}') "
            f"for partition-id=1, state folder {tmp_path / 'state'}, data none") in err
    assert f"answering uid {os.geteuid()} and 65533" in err
