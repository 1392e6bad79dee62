"""No tracked file holds a private key: anyone with the repository could sign with it.

Three forms: an owner's identity file (fedsd.secure.identity: `identity.key`, an Ed25519 private
key as 32 raw bytes), any other file of 32 bytes (they load as such a key, whatever the file is
called), and a PEM private key of any kind (`-----BEGIN ... PRIVATE KEY-----`, OpenSSH's too).
A test that needs a key makes one at test time, in its tmp_path; scripts/deployed-run-state.sh
saves none in results/ (the last test).
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedsd.secure.identity import IDENTITY_FILE, KEY_BYTES

ROOT = Path(__file__).resolve().parents[2]
PEM_PRIVATE = re.compile(rb"-{5}BEGIN ([A-Z0-9]+ )*PRIVATE KEY-{5}")  # (written so as not to match itself)


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"{ROOT}: not a git checkout (git ls-files failed)")
    return [name for name in out.decode("utf-8", "surrogateescape").split("\0") if name]


def private_key_in(name: str, raw: bytes) -> str | None:
    """Why the tracked file `name`, holding `raw`, is a private key; None when it is not one."""
    if Path(name).name == IDENTITY_FILE:
        return f"an owner's identity file ({IDENTITY_FILE})"
    if len(raw) == KEY_BYTES:
        Ed25519PrivateKey.from_private_bytes(raw)  # what load_identity reads from identity.key
        return f"{KEY_BYTES} bytes, which load as an Ed25519 private key (as identity.key is stored)"
    if PEM_PRIVATE.search(raw):
        return "a PEM private key"
    return None


def test_no_tracked_file_holds_a_private_key():
    found = []
    for name in tracked_files():
        path = ROOT / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # deleted here, not yet from the index: not in the next commit's tree
            continue
        if not stat.S_ISREG(st.st_mode):  # a link or a submodule: its target is checked where it is tracked
            continue
        why = private_key_in(name, path.read_bytes())
        if why:
            found.append(f"{name}: {why}")
    assert not found, ("tracked files hold private keys; remove them (`git rm --cached`) and make such keys "
                       "at test time:\n" + "\n".join(found))


@pytest.mark.parametrize("name, raw", [
    ("results/x/owners/0/identity.key", b""),
    ("results/x/seed.bin", Ed25519PrivateKey.generate().private_bytes_raw()),
    ("deploy/node.pem", b"x\n-----" b"BEGIN PRIVATE KEY-----\nMC4CAQ...\n"),
    ("deploy/ca.key", b"-----" b"BEGIN EC PRIVATE KEY-----\n"),
    ("home/.ssh/id_ed25519", b"-----" b"BEGIN OPENSSH PRIVATE KEY-----\n"),
], ids=lambda v: v if isinstance(v, str) else "")  # a fresh key's bytes would name the test anew in each worker
def test_each_form_of_a_private_key_is_found(name, raw):
    assert private_key_in(name, raw)


@pytest.mark.parametrize("name, raw", [
    ("results/roster", b"owner-0 ed25519:" + b"A" * 44 + b"\n"),
    ("deploy/ca.pem", b"-----" b"BEGIN CERTIFICATE-----\n"),
    ("deploy/node.pub", b"-----" b"BEGIN PUBLIC KEY-----\n"),
    ("results/x/ledger-0.json", b"{}\n"),
])
def test_public_files_pass(name, raw):
    assert private_key_in(name, raw) is None


def test_a_saved_run_keeps_the_owners_public_files_alone(tmp_path):
    """scripts/deployed-run-state.sh save puts an owner's ledgers and admitted plans in DIR, never its
    identity key, train state or kept reply; a private key in the run's out folder is refused."""
    if shutil.which("bash") is None or shutil.which("pgrep") is None:
        pytest.skip("bash and pgrep are needed to run scripts/deployed-run-state.sh")
    work, out, saved = tmp_path / "w", tmp_path / "o", tmp_path / "saved"
    state = work / "deployment" / "nodes" / "0" / "state"
    for name, raw in {IDENTITY_FILE: Ed25519PrivateKey.generate().private_bytes_raw(), "ledger-ab12.json": b"{}",
                      "task.json": b"{}", "secagg-joined.json": b"{}", "identity.key.lock": b"",
                      "exp/client-0.pt": b"state", "exp/client-0-last-reply.pt": b"reply",
                      "exp/client-0-plan.json": b"{}", "data-cache/x.npz": b"data"}.items():
        (state / name).parent.mkdir(parents=True, exist_ok=True)
        (state / name).write_bytes(raw)
    (work / "deployment" / "shared").mkdir()
    (work / "deployment" / "shared" / "roster").write_text("owner-0 ed25519:" + "A" * 44 + "\n")
    (work / "rounds.jsonl").write_text('{"round": 1}\n')
    out.mkdir()
    (out / "result.json").write_text("{}")
    (out / "secagg-sum-1.npy").write_bytes(b"sum")
    save = [str(ROOT / "scripts" / "deployed-run-state.sh"), "save", str(work), str(out), str(saved)]

    subprocess.run(save, check=True, capture_output=True)
    kept = sorted(str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file())
    assert kept == ["out/result.json", "owners/0/exp/client-0-plan.json", "owners/0/ledger-ab12.json", "roster",
                    "rounds.jsonl"]

    (out / "node.txt").write_bytes(b"-----" b"BEGIN OPENSSH PRIVATE KEY-----\n")
    refused = subprocess.run(save, capture_output=True, text=True)
    assert refused.returncode == 1 and f"{saved}/out/node.txt" in refused.stderr
    assert not (saved / "out" / "node.txt").exists()
