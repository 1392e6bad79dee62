"""The warm SuperNode's changes to Flower's waits and to each task's start
(fedsd/deployment/warm_supernode.py), each run as the node runs it: the warm process's prelude
and the node's patch in an interpreter of their own (they change the process they run in)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedsd.deployment import warm_supernode

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, env: dict | None = None, pass_fds=(), stderr: list | None = None) -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})}, pass_fds=pass_fds)
    assert out.returncode == 0, out.stderr[-3000:]
    if stderr is not None:
        stderr.append(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # an interpreter of its own, importing Flower
def test_a_bundle_installed_and_checked_once_is_not_unzipped_again(tmp_path):
    """Flower's install_from_fab unzips and checks the whole bundle at every task; the warm
    process's tasks leave that to Flower once a bundle (by its full SHA-256), and get the folder
    Flower installed. Another bundle, or a folder gone, is Flower's again."""
    probe = warm_supernode.ZYGOTE_PRELUDE + r'''
import json, io, zipfile, shutil
from flwr.cli.build import build_fab_from_disk
calls = []
real = flower_install
def counted(fab, *a, **k):
    calls.append(len(fab))
    return real(fab, *a, **k)
flower_install = counted
fab = build_fab_from_disk(pathlib.Path(sys.argv[1]))
first, second = install_once(fab, skip_prompt=True), install_once(fab, skip_prompt=True)
after_two = len(calls)
shutil.rmtree(first)
third = install_once(fab, skip_prompt=True)
after_three = len(calls)
memo = next((get_flwr_home() / "apps" / ".installed").iterdir())
kept = memo.read_text()
for elsewhere in ("", "/", str(get_flwr_home())):  # a memo naming another folder is not taken
    memo.write_text(elsewhere)
    install_once(fab, skip_prompt=True)
memo.write_text(kept)
print(json.dumps(dict(same=str(first) == str(second) == str(third), calls=[after_two, after_three],
                      cli=str(task_module.install_from_fab is install_once), exists=third.is_dir(),
                      elsewhere=len(calls) - after_three)))
'''
    seen = run_python(probe.replace("sys.argv[1]", repr(str(ROOT))), env={"FLWR_HOME": str(tmp_path / "flwr")})
    assert seen == dict(same=True, calls=[1, 2], cli="True", exists=True, elsewhere=3)
    marks = list((tmp_path / "flwr" / "apps" / ".installed").iterdir())
    assert len(marks) == 1 and len(marks[0].name) == 64  # the bundle's full SHA-256, nothing half-written


@pytest.mark.slow  # an interpreter of its own, importing Flower
@pytest.mark.slow  # an interpreter of its own, importing Flower
def test_a_task_waits_briefly_for_an_object_its_node_has_not_stored_yet():
    """The node rings its SuperExec before it pulls a message's objects, so a task may ask its node
    for one not stored yet: Flower's first wait for it is 1 s; a warm task's is 0.05 s."""
    probe = warm_supernode.ZYGOTE_PRELUDE + r'''
import json, time
from flwr.app import RecordDict, ConfigRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError
content = RecordDict({"c": ConfigRecord({"a": 1})})
stored = {k: v.deflate() for k, v in get_all_nested_objects(content).items()}
asked = []
def from_node(object_id):
    asked.append(object_id)
    if len(asked) == 1:
        raise ObjectUnavailableError(object_id)
    return stored[object_id]
t = time.monotonic()
got = task_module.pull_and_inflate_object_from_tree(get_object_tree(content), from_node, lambda i: None,
                                                   return_type=RecordDict)
print(json.dumps(dict(value=got["c"]["a"], seconds=time.monotonic() - t)))
'''
    seen = run_python(probe)
    assert seen["value"] == 1 and seen["seconds"] < 0.5


def test_the_warm_process_has_imported_what_every_task_imported_on_its_own():
    probe = warm_supernode.ZYGOTE_PRELUDE + r'''
import json
print(json.dumps(sorted(m for m in ("httpcore", "h11", "tomllib", "getpass", "fedsd") if m in sys.modules)))
'''
    assert run_python(probe) == ["getpass", "h11", "httpcore", "tomllib"]  # and nothing of fedsd


@pytest.mark.slow  # an interpreter of its own, importing Flower
@pytest.mark.parametrize("enabled", ["0", "1"])
def test_a_task_builds_no_telemetry_event_that_is_not_sent(enabled):
    """Flower builds an event whole (a `file` subprocess among it) and a task waits for it at its
    exit, sent or not: with FLWR_TELEMETRY_ENABLED=0 a task's events are done at once and nothing
    builds them; with telemetry on, Flower's own event. And the warm process collects nothing,
    freezes its heap before it forks (a task's collections do not walk it), and a task collects again."""
    probe = warm_supernode.ZYGOTE_PRELUDE + r'''
import json, gc
from flwr.supercore import telemetry
built = []
telemetry.create_event = lambda *a, **k: built.append(1) or "built"
result = task_module.event(telemetry.EventType.FLWR_CLIENTAPP_RUN_ENTER).result(timeout=10)
exit_result = exit_module.event(telemetry.EventType.FLWR_CLIENTAPP_RUN_LEAVE).result(timeout=10)
print(json.dumps(dict(result=result, exit_result=exit_result, built=len(built), collecting=gc.isenabled())))
'''
    seen = run_python(probe, env={"FLWR_TELEMETRY_ENABLED": enabled})
    if enabled == "0":
        assert seen["result"] == seen["exit_result"] == "disabled" and seen["built"] == 0
    else:
        assert seen["result"] == seen["exit_result"] == "built" and seen["built"] == 2
    assert seen["collecting"] is False  # the warm process collects nothing
    loop = warm_supernode.ZYGOTE_LOOP  # frozen once before the first fork; collecting again in the task only
    assert loop.index("gc.freeze()") < loop.index("for line in") < loop.index("os.fork()") < loop.index("gc.enable()")


@pytest.mark.slow  # an interpreter of its own, importing Flower
def test_the_node_rings_when_a_pull_stored_a_message_and_waits_for_its_own_reply_briefly():
    """The node's patch: once a pulled message is stored (its objects next), the bell rings, and
    an object not pushed yet is asked for again after 0.05 s (Flower's first wait: 1 s); its wait
    after an empty pull is capped at the interval, its waits for its own task's reply (Flower's
    0.5 s) at 0.05 s; a bell that cannot ring is said once."""
    bell, ringer = os.pipe()
    probe = warm_supernode.NODE_PATCH.replace("interval, bell = float(sys.argv.pop(1)), int(sys.argv.pop(1))",
                                              f"interval, bell = 1.0, {ringer}") + r'''
import json
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError
tries = []
def late_object(object_id):  # as the SuperLink answers while the sender still pushes the object
    tries.append(time.monotonic())
    if len(tries) == 1:
        raise ObjectUnavailableError(object_id)
    return b"x"
t = time.monotonic(); pulled_objects = loop.pull_objects(["a"], pull_object_fn=late_object); late = time.monotonic() - t
t = time.monotonic(); loop.time.sleep(3); empty = time.monotonic() - t
t = time.monotonic(); loop.time.sleep(0.5); reply = time.monotonic() - t
os.close(bell)
ring(); ring()  # a bell that cannot ring: said once
print(json.dumps(dict(empty=empty, reply=reply, late=late, objects=len(pulled_objects))))
'''
    said = []
    seen = run_python(probe, pass_fds=(ringer,), stderr=said)
    os.close(ringer)
    os.set_blocking(bell, False)
    assert os.read(bell, 64) == b"."  # one ring: the stored message's objects about to be pulled
    os.close(bell)
    assert seen["objects"] == 1 and seen["late"] < 0.5  # an object pushed late: Flower's first wait is 1 s
    assert 0.9 < seen["empty"] < 2.0 and seen["reply"] < 0.15  # Flower's: 3 s, and 0.5 s (min of it and 1.0)
    assert said[0].count("the node's bell does not ring") == 1


def test_the_serverapp_waits_briefly_for_a_replys_objects_pushed_late(monkeypatch):
    """A reply is seen once its node's PushMessages is in, before its objects: Flower's Grid
    waited 1 s for an object not there yet; the ServerApp's is 0.05 s, doubling as Flower's."""
    from flwr.superlink.grid import http_grid
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    from fedsd.app.server.grid import shorten_object_backoff

    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)  # put back after the test
    tries = []

    def late_object(object_id):
        tries.append(object_id)
        if len(tries) < 3:
            raise ObjectUnavailableError(object_id)
        return b"x"

    shorten_object_backoff()
    shorten_object_backoff()  # once: the second call changes nothing
    t = time.monotonic()
    assert http_grid.pull_objects(["a"], pull_object_fn=late_object) == {"a": b"x"}
    assert time.monotonic() - t < 0.6 and len(tries) == 3  # Flower's waits: 1 s, then 2 s


def test_the_superexec_waits_for_the_bell_and_a_ring_during_an_ask_is_kept(monkeypatch):
    monkeypatch.setattr(warm_supernode, "BELL_FALLBACK", 1.0)
    bell, ringer = os.pipe()
    rung = threading.Event()
    threading.Thread(target=warm_supernode.listen, args=(bell, rung), daemon=True, name="bell").start()
    t = time.monotonic()
    threading.Timer(0.1, os.write, args=(ringer, b".")).start()
    warm_supernode.wait_for(rung, 0.5)  # a fallback of at least BELL_FALLBACK: the ring ends it
    assert time.monotonic() - t < 0.8
    os.write(ringer, b".")  # a ring while no one waits (the SuperExec asking): the next wait is none
    time.sleep(0.1)
    t = time.monotonic()
    warm_supernode.wait_for(rung, 0.5)
    assert time.monotonic() - t < 0.1
    t = time.monotonic()
    warm_supernode.wait_for(rung, 0.1)  # no ring: the fallback
    assert time.monotonic() - t >= warm_supernode.BELL_FALLBACK - 0.05
    listening = [t for t in threading.enumerate() if t.name == "bell"]
    os.close(ringer)  # the node gone: its listener ends, nothing spins
    listening[0].join(timeout=2)
    assert not listening[0].is_alive()
