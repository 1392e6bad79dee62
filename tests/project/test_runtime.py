"""fedsd changes nothing about a process when imported; fedsd.runtime.tune_process(), which its
entry points call, does: the environment for torch and libgomp, and glibc's malloc."""
import os
import json
import subprocess
import sys

import pytest

TUNED = ("THP_MEM_ALLOC_ENABLE", "GOMP_SPINCOUNT", "TORCHINDUCTOR_CACHE_DIR")
# What glibc's malloc does with a 64 MB block: mmap'd (glibc's default) or from the heap (tuned).
PROBE = r"""
import ctypes, json, os, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
def mmapped_blocks():
    before = libc.mallinfo2().hblks
    block = libc.malloc(64 << 20)
    n = libc.mallinfo2().hblks - before
    libc.free(ctypes.c_void_p(block))
    return n
before = dict(os.environ)
exec(sys.argv[1])
print(json.dumps({"changed": sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)),
                  "mmapped": mmapped_blocks()}))
"""


def probe(code: str, env_drop=TUNED) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in env_drop and k != "MALLOC_MMAP_MAX_"}
    done = subprocess.run([sys.executable, "-c", PROBE, code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_importing_the_library_changes_no_environment_and_no_allocator():
    imported = probe("import fedsd, fedsd.training.loop, fedsd.privacy.accounting, fedsd.clipping.bookkeeping, "
                     "fedsd.clipping.conv_kernel, fedsd.clipping.routes, fedsd.training.central, "
                     "fedsd.privacy.canary_audit")
    assert imported == {"changed": [], "mmapped": 1}  # glibc's own way: a large block is mmap'd


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_tune_process_sets_the_environment_and_keeps_freed_memory_unless_opted_out():
    tuned = probe("from fedsd.runtime import tune_process; tune_process()")
    assert tuned == {"changed": sorted(TUNED), "mmapped": 0}
    assert probe("import os; os.environ['FEDSD_TUNE_PROCESS'] = '0'\n"
                 "from fedsd.runtime import tune_process; tune_process()") == {"changed": ["FEDSD_TUNE_PROCESS"],
                                                                               "mmapped": 1}


def test_a_users_own_values_are_kept(monkeypatch):
    from fedsd import runtime

    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert "GOMP_SPINCOUNT" not in runtime.tune_process()
    import os

    assert os.environ["GOMP_SPINCOUNT"] == "123" and os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_the_entry_points_tune_their_process():
    """The fedsd command and the Flower apps (ClientApp, ServerApp) call tune_process on import."""
    for module in ("fedsd.cli.main", "fedsd.app.client.client_app", "fedsd.app.server.server_app"):
        assert probe(f"import {module}")["mmapped"] == 0, module


def test_the_inductor_cache_is_never_a_folder_another_user_could_write_in(tmp_path):
    """Inductor loads compiled libraries from its cache: a folder in the shared temporary folder
    that someone else made, or may write in, is not taken; a private one is made instead."""
    from fedsd.runtime import own_folder

    mine = own_folder(tmp_path / "cache")
    assert mine == tmp_path / "cache" and (mine.stat().st_mode & 0o777) == 0o700
    assert own_folder(mine) == mine  # kept from one process to the next
    planted = tmp_path / "planted"
    planted.mkdir()
    planted.chmod(0o777)  # made first, open to all
    other = own_folder(planted)
    assert other != planted and other.stat().st_uid == os.getuid() and (other.stat().st_mode & 0o777) == 0o700
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert own_folder(link) != link
    if os.getuid() == 0:  # as root the test can also make a folder another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        assert own_folder(theirs) != theirs
