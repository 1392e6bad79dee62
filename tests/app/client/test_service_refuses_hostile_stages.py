"""Attacks on secure aggregation as the owner's data service answers it
(fedsd/app/client/secure_stages.py), by a server that chooses every message the service receives
and runs clients of its own. Each test FAILS while its attack works on the code it was written
against; it passes once the service refuses the attack (the fix is named in each docstring)."""
import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from fedsd.app.client import handler as local
from fedsd.app.client import secure_stages as service
from fedsd.app.client.secure_owner import StageRefused
from fedsd.secure import secagg
from fedsd.secure.secagg_server import SecAggServer
from fedsd.app import secure_sum
from tests.app.client.test_secure_aggregation import (EXPERIMENT, IDS, dealt, keys_message, masked_message,  # noqa: F401
                                           owners, stage, state_files, up_to_shares, with_map)


def only_kept_input(tmp_path):
    """Owner 0's one kept input (secagg-keep-inputs), whatever its file's name."""
    (path,) = (tmp_path / "state-0" / "secagg").glob("*.npy")
    return np.load(path)


@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_a_plain_train_message_does_not_release_the_update_a_secure_round_summed(owners):
    """CRITICAL. After a secure round's masked input, the server sends the same round as an
    ordinary `train` message (the same config and model, which it chose itself): the service
    finds the request in its kept last reply and answers it as a replay, in the clear and
    uncharged: each honest client's individual update, the one thing secure aggregation hid.
    Fix: keep_reply records that the reply was released into a secure sum (contribution passes
    it down), and train_reply refuses to replay such a reply (a refusal, nothing released);
    symmetric with contribution's refusal of a replayed reply."""
    contexts, flat, arrays, tmp_path = owners
    base, server = up_to_shares(contexts, 1, flat)
    service.masked_reply(masked_message(base, flat, arrays, server.shares_for(101)), contexts[101])
    summed = only_kept_input(tmp_path)
    before = state_files(tmp_path)
    plain = RecordDict({"arrays": arrays, "config": ConfigRecord({**flat, "server-round": 1})})
    reply = local.HANDLERS["train"](plain, contexts[101])
    if "arrays" in reply:
        leaked = secure_sum.update_vector(arrays, reply["arrays"])
        assert not np.array_equal(leaked, summed), \
            "the plain train reply is exactly the update client 101 sent into the secure sum"
        pytest.fail("a plain train message was answered after the round went into a secure sum")
    assert state_files(tmp_path) == before


def _sybil_attack(contexts, flat, arrays, tmp_path, cohort, survivors):
    """The server's one client (102, a SecAggClient it runs) with honest owner 101 (min=2, f=1):
    whatever survivors list it tells them, the sum is 101's update plus 102's zeros."""
    contexts[101].node_config.update({"secagg-min-clients": 2, "secagg-max-colluders": 1})
    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    rid = secure_sum.round_id(7, EXPERIMENT, 1)
    length = secure_sum.vector_length(arrays)
    server = SecAggServer(rid, [101, 102], length)
    sybil = secagg.SecAggClient(102, rid, min_cohort=2)
    setup = {"cohort": cohort, "neighbours": [101, 102], "threshold": 2}
    keys = {101: dict(service.advertise_reply(stage(base, **setup), contexts[101])["secagg"]),
            102: sybil.advertise(cohort, [101, 102], 2)}
    server.collect_keys(keys)
    server.collect_shares({101: dealt(service.share_reply(keys_message(base, server, 101), contexts[101])),
                           102: sybil.share_keys(server.keys_for(102))})
    masked = {101: service.masked_reply(masked_message(base, flat, arrays, server.shares_for(101)),
                                        contexts[101])["secagg"]["masked"].numpy(),
              102: sybil.masked_input(*server.shares_for(102).values(), np.zeros(length, dtype=np.uint64))}
    server.collect_masked(masked)
    view = {"survivors": survivors, "dropped": []}
    signatures = {101: service.confirm_reply(stage(base, **view), contexts[101])["secagg"]["sig"],
                  102: sybil.confirm(survivors, [])}
    reply = service.unmask_reply(with_map(base, confirmations={102: signatures[102]}), contexts[101])["secagg"]
    answers = {101: {"b": secure_sum.read_map(reply, "b"), "s": secure_sum.read_map(reply, "s")},
               102: sybil.unmask({101: signatures[101]})}
    return server.finish(answers), only_kept_input(tmp_path)


@pytest.mark.parametrize("cohort, survivors", [
    ([101, 102], [101, 102, 999]),  # a survivor that is in no cohort at all
    ([101, 102, 999], [101, 102, 999]),  # a cohort member that never advertised to this client
], ids=["outside-the-cohort", "not-a-neighbour"])
@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_phantom_survivors_do_not_satisfy_the_owners_max_colluders(owners, cohort, survivors):
    """HIGH. An owner with secagg-min-clients=2, secagg-max-colluders=1 reveals its shares only
    when 2 + 1 clients survive, so that 2 honest inputs are in the sum. The check counts the
    survivors *list* the server sends (SecAggClient.confirm: len(survivors) ≥ min + f), not the
    survivors this client can verify: a made-up id 999 (outside the cohort, or a cohort member
    that is not its neighbour and never sent it a key or a share) makes the count 3 with the
    server's single client 102, and the sum is the honest client's update, exactly. (The module
    doc says t + f of its neighbours must confirm the view; unmask checks max(t, min) only.)
    Fix (fedsd/secure/secagg.py): survivors and dropped ⊆ cohort; in confirm, `len(local) ≥ min_cohort +
    max_colluders` (local = survivors it masked with); in unmask, `agreed ≥ max(threshold,
    min_cohort + max_colluders)` (MAC-verified neighbours); and, so no budget is charged for a
    round that cannot pass, advertise's neighbours and check_masked's senders ≥ min + f too."""
    contexts, flat, arrays, tmp_path = owners
    try:
        total, summed = _sybil_attack(contexts, flat, arrays, tmp_path, cohort, survivors)
    except StageRefused:
        return  # refused before anything was revealed
    assert not np.array_equal(total, summed), "the server recovered client 101's update from a 'sum' of one"
    pytest.fail("the honest client unmasked with one server client and a phantom survivor")


@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_an_owner_with_max_colluders_is_not_charged_for_a_round_too_small_to_unmask(owners):
    """LOW (budget burnt). secagg-max-colluders=1, secagg-min-clients=2: a cohort of 2 can never
    pass the confirm stage (survivors ≥ 3), yet advertise takes it and the masked stage trains
    and charges the ledger. Fix: advertise refuses len(neighbours) < min_cohort + max_colluders
    (and check_masked the senders likewise), before any charge."""
    contexts, flat, arrays, tmp_path = owners
    contexts[101].node_config.update({"secagg-min-clients": 2, "secagg-max-colluders": 1})
    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    rid = secure_sum.round_id(7, EXPERIMENT, 1)
    server = SecAggServer(rid, [101, 102], secure_sum.vector_length(arrays))
    sybil = secagg.SecAggClient(102, rid, min_cohort=2)
    try:
        keys = {101: dict(service.advertise_reply(stage(base, **server.setup(101)), contexts[101])["secagg"]),
                102: sybil.advertise(*server.setup(102).values())}
        server.collect_keys(keys)
        server.collect_shares({101: dealt(service.share_reply(keys_message(base, server, 101), contexts[101])),
                               102: sybil.share_keys(server.keys_for(102))})
        service.masked_reply(masked_message(base, flat, arrays, server.shares_for(101)), contexts[101])
    except StageRefused:
        assert not list(tmp_path.glob("state-0/ledger-*.json"))
        return
    assert not list(tmp_path.glob("state-0/ledger-*.json")), "charged for a round its owner can never unmask"


@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_a_later_release_does_not_overwrite_the_owners_kept_input(owners):
    """LOW (the owner's audit). secagg-keep-inputs names the file <run>-<round> by the round
    number the stage message carries: another experiment id (or another node id in the header,
    or the same round number after its session ended) with the same number releases a second,
    different update and overwrites the owner's copy of the first: its record of what it
    released is gone. Fix (keep_input): name the file by the whole session key (run, experiment,
    round, node) and open it exclusively ("xb"), refusing, before the charge, a round whose file
    exists."""
    contexts, flat, arrays, tmp_path = owners
    contexts[101].node_config["max-epsilon"] = 50.0  # room for two rounds
    base, server = up_to_shares(contexts, 1, flat)
    service.masked_reply(masked_message(base, flat, arrays, server.shares_for(101)), contexts[101])
    first = {p.name: p.read_bytes() for p in (tmp_path / "state-0" / "secagg").glob("*.npy")}
    other = {"experiment-id": "another", "server-round": 1}
    server2 = SecAggServer(secure_sum.round_id(7, "another", 1), list(IDS), 10)
    settings = ConfigRecord({**flat, **other, "server-round": 2})  # a fresh training round of the run (charged)

    def advertised(n):
        content = stage(other, **server2.setup(n))
        content["config"] = settings  # the round's settings, as the server sends them with stage 0
        return content
    server2.context = secure_sum.settings_digest(settings)  # what each advert signs
    server2.collect_keys({n: dict(service.advertise_reply(advertised(n), contexts[n])["secagg"]) for n in IDS})
    server2.collect_shares({n: dealt(service.share_reply(keys_message(other, server2, n), contexts[n])) for n in IDS})
    content = masked_message(other, flat, arrays, server2.shares_for(101))
    content["config"] = settings
    try:
        service.masked_reply(content, contexts[101])
    except StageRefused:
        pass
    kept = {p.name: p.read_bytes() for p in (tmp_path / "state-0" / "secagg").glob("*.npy")}
    for name, data in first.items():
        assert kept.get(name) == data or data in kept.values(), "the owner's copy of its first release was overwritten"
