"""What `fedsd deploy-local` reports when a run stops, read from `flwr run --stream`'s output."""
from fedsd.deployment.local_deployment import server_error

REFUSED = """\x1b[91mERROR \x1b[0m:     ServerApp raised an exception
Traceback (most recent call last):
  File "fedsd/app/server/server_app.py", line 1, in main
fedsd.app.server.server_app.NoClientCanTrain: round 1: no client can train, so the run stops: client 0 refused: run asks ε=3
"""  # noqa: E501

BUG = """\x1b[92mINFO \x1b[0m:      [ROUND 2/3]
\x1b[91mERROR \x1b[0m:     ServerApp raised an exception
Traceback (most recent call last):
  File "fedsd/app/server/server_app.py", line 9, in main
    book.rounds[k]
IndexError: list index out of range
"""


def test_a_refusal_is_reported_with_the_servers_reason():
    assert server_error(REFUSED) == "round 1: no client can train, so the run stops: client 0 refused: run asks ε=3"


def test_any_other_exception_is_named_by_its_tracebacks_last_line():
    assert server_error(BUG) == "the ServerApp raised IndexError: list index out of range"


def test_output_without_an_exception_has_no_reason():
    assert server_error("\x1b[92mINFO \x1b[0m:      fedsd round 3/3: test accuracy 0.55\n") is None
