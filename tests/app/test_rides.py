"""A second stage riding in one Flower exchange (fedsd.app.rides): the ClientApp hands the owner's service
the carrier, then the ride, each as a message of its own; what may ride on what is fixed, and a message
laid out otherwise is refused before anything is forwarded (what the server sends is hostile)."""
import pytest
from flwr.app import ConfigRecord, RecordDict

from fedsd.app import rides, secure_sum

UNMASK, MASKED, SETUP, DEAL, DELIVER = (secure_sum.KINDS[s] for s in ("mr_unmask", "mr_masked", "mr_setup",
                                                                       "mr_deal", "mr_deliver"))


def _records(**fields) -> RecordDict:
    return RecordDict({secure_sum.RECORD: ConfigRecord(fields)})


class Service:
    """What the owner's service was asked, in order; `refuse`: kinds it refuses."""

    def __init__(self, refuse=()):
        self.asked, self.refuse = [], set(refuse)

    def __call__(self, kind, content):
        self.asked.append((kind, dict(content[secure_sum.RECORD])))
        if kind in self.refuse:
            raise ValueError(f"refused {kind} (culprit: 5)")
        return _records(answer=kind)


def test_the_carrier_then_the_ride_each_alone_and_both_answered_in_one_reply():
    service = Service()
    content = rides.carry(_records(round=7), SETUP, _records(batch=2))
    reply = rides.answer(UNMASK, content, service)
    assert service.asked == [(UNMASK, {"round": 7}), (SETUP, {"batch": 2})]
    own, ride, refused = rides.reply_of(reply)
    assert own[secure_sum.RECORD]["answer"] == UNMASK and ride[secure_sum.RECORD]["answer"] == SETUP
    assert refused is None and set(own.keys()) == {secure_sum.RECORD}


@pytest.mark.parametrize("carrier, ride_kind", [(UNMASK, DEAL), (MASKED, SETUP), (MASKED, MASKED), (DEAL, SETUP),
                                                ("train", SETUP), (UNMASK, "train"), (UNMASK, UNMASK)])
def test_a_ride_its_carrier_may_not_carry_is_refused_before_anything_is_forwarded(carrier, ride_kind):
    service = Service()
    with pytest.raises(rides.RideError, match="carries no ride"):
        rides.answer(carrier, rides.carry(_records(round=7), ride_kind, _records(batch=2)), service)
    assert service.asked == []


@pytest.mark.parametrize("bend", [
    lambda c: RecordDict({k: v for k, v in c.items() if k != rides.RECORD}),  # a ride's records, no ride said
    lambda c: RecordDict({**dict(c.items()), rides.RECORD: ConfigRecord({"kind": SETUP, "more": 1})}),
    lambda c: RecordDict({**dict(c.items()), rides.PREFIX + rides.RECORD: ConfigRecord({"kind": SETUP})}),
    lambda c: RecordDict({**dict(c.items()), rides.PREFIX + rides.PREFIX + "x": ConfigRecord({})}),
    lambda c: RecordDict({k: v for k, v in c.items() if not k.startswith(rides.PREFIX)}),  # a ride of nothing
])
def test_a_ride_not_laid_out_as_one_or_carrying_another_is_refused_before_anything_is_forwarded(bend):
    service = Service()
    with pytest.raises(rides.RideError):
        rides.answer(UNMASK, bend(rides.carry(_records(round=7), SETUP, _records(batch=2))), service)
    assert service.asked == []


def test_nothing_rides_on_a_refused_carrier_and_a_refused_ride_leaves_the_carriers_answer():
    service = Service(refuse={UNMASK})
    with pytest.raises(ValueError, match="refused"):
        rides.answer(UNMASK, rides.carry(_records(round=7), DELIVER, _records(batch=2)), service)
    assert [k for k, _ in service.asked] == [UNMASK]
    service = Service(refuse={DELIVER})
    own, ride, refused = rides.reply_of(rides.answer(UNMASK, rides.carry(_records(round=7), DELIVER,
                                                                         _records(batch=2)), service))
    assert own[secure_sum.RECORD]["answer"] == UNMASK and ride is None and "refused" in refused
    assert "(culprit: 5)" in refused  # the server names it as its accuser's word (stage_exchange)


def test_a_message_without_a_ride_is_answered_as_before():
    service = Service()
    reply = rides.answer(UNMASK, _records(round=7), service)
    assert service.asked == [(UNMASK, {"round": 7})] and set(reply.keys()) == {secure_sum.RECORD}


@pytest.mark.parametrize("marker", [None, ConfigRecord({"answered": 1}), ConfigRecord({"answered": True, "x": 1}),
                                    ConfigRecord({"refused": 7}), ConfigRecord({"answered": True})])
def test_a_members_reply_whose_ride_is_not_laid_out_as_one_is_a_refused_ride(marker):
    reply = _records(answer=UNMASK)
    if marker is not None:
        reply[rides.RECORD] = marker
    own, ride, refused = rides.reply_of(reply)  # the last: answered, but no ride's records
    assert ride is None and isinstance(refused, str) and own[secure_sum.RECORD]["answer"] == UNMASK
