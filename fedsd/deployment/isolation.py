"""`--isolate`: every client of a local deployment (fedsd/deployment/local_deployment.py) on a
machine of its own, as far as one machine allows: its own network namespace on a bridge that
isolates each client's port from the others', and its data owner and its SuperNode each under
a uid of their own, that reads only what its part needs."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

from fedsd.deployment.processes import DeploymentError

# --isolate: client k's data owner (its data service, its data, its state) runs under uid
# OWNER_UID_BASE + k and its SuperNode (Flower's processes and the app bundle's ClientApp) under
# NODE_UID_BASE + k: numeric uids, no accounts needed.
OWNER_UID_BASE, NODE_UID_BASE = 47000, 47500
# What --isolate runs: iproute2's ip and bridge, util-linux's setpriv and unshare.
ISOLATION_TOOLS = ("ip", "bridge", "setpriv", "unshare")


class Isolation:
    """Every client on a machine of its own, as far as one machine allows, and on it the data
    owner apart from the code the server ships. Client k has its own network namespace,
    reaching the SuperLink over its own veth pair through a bridge whose ports cannot reach one
    another (only the SuperLink's address, never loopback). Its data owner's folder (mode 0700:
    a copy of its data, its state and ledger) belongs to the owner's uid, which runs the data
    service (fedsd/app/client/owner_service.py) from the project's installation; its SuperNode, and so
    every ClientApp process of the app bundle, runs under a second uid with a folder of its own
    (its key, its Flower home) and reaches the data only through the service's socket. No
    client can read another's folders, and no ClientApp can read its own client's data. Needs
    root; `check` says so, before anything starts."""

    def __init__(self, work: Path, num_clients: int):
        # A subnet fixed by the work folder: a reused --work keeps its address and certificate.
        tag = int(hashlib.sha256(str(work.absolute()).encode()).hexdigest(), 16)
        self.net = 20 + tag % 200
        self.id = f"{tag % 100000:05d}"
        self.bridge = f"fsd{self.id}br"
        self.host = f"10.213.{self.net}.1"  # the SuperLink's address, on the bridge
        self.num_clients = num_clients

    def namespace(self, k: int) -> str:
        return f"fedsd-{self.id}-{k}"

    def address(self, k: int) -> str:
        return f"10.213.{self.net}.{k + 2}"

    @staticmethod
    def uid(k: int) -> int:
        """Client k's data owner: its data service, data and state."""
        return OWNER_UID_BASE + k

    @staticmethod
    def node_uid(k: int) -> int:
        """Client k's SuperNode and the ClientApp processes it starts."""
        return NODE_UID_BASE + k

    def check(self) -> None:
        if os.geteuid() != 0:
            raise DeploymentError("--isolate needs root: network namespaces, veth pairs and other uids")
        if not 1 <= self.num_clients <= 250:
            raise DeploymentError(f"--isolate: at most 250 clients on one subnet, got {self.num_clients}")
        for tool in ISOLATION_TOOLS:
            if shutil.which(tool) is None:
                raise DeploymentError(f"--isolate needs `{tool}` (iproute2, util-linux)")
        if _run(["ip", "link", "show", self.bridge]).returncode == 0:
            raise DeploymentError(f"--isolate: bridge {self.bridge} exists: another deployment uses this --work")

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for k in range(self.num_clients):
            ns, outside, inside = self.namespace(k), f"fsd{self.id}h{k}", f"fsd{self.id}c{k}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self.bridge)
            _run(["bridge", "link", "set", "dev", outside, "isolated", "on"], check=True)  # no client to client
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # the SuperNode's own local APIs

    def down(self) -> None:
        for k in range(self.num_clients):
            ns = self.namespace(k)
            for pid in _run(["ip", "netns", "pids", ns]).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns])  # takes its veth pair with it
        _run(["ip", "link", "del", self.bridge])

    def wrap(self, k: int, uid: int, cmd: list[str], env: dict, home: Path, needs: list[Path],
             from_env: tuple[str, ...] = ()) -> list[str]:
        """`cmd` as `uid` on client k's machine: in its network namespace and a mount namespace of
        its own, with only `env`. A folder on the way to what it `needs` (the interpreter, the
        project, its own folders) that other users cannot pass (a home such as /root, a private
        temporary folder) is covered there by an empty one, with just the needed paths put back:
        the process sees none of the rest, other clients' folders included. `env` is on the
        command line, which any uid can read (/proc/PID/cmdline); a variable named in `from_env`
        is passed on from the environment the wrapper is started in instead (a secret)."""
        script = ["set -e", "umask 022"]  # the folders made to put needed paths back must be passable
        for closed, paths in _closed_ancestors(needs).items():
            for i, path in enumerate(paths):
                script.append(f'stage{i}=$(mktemp -d) && mount --bind "{path}" "$stage{i}"')
            script.append(f'mount -t tmpfs -o mode=0755 fedsd-isolate "{closed}"')
            for i, path in enumerate(paths):
                script.append(f'mkdir -p "{path}" && mount --move "$stage{i}" "{path}" && rmdir "$stage{i}"')
        script.append(f'cd "{home}"')
        kept = "".join(f' {name}="${name}"' for name in from_env if name.isidentifier())
        script.append(f'exec setpriv --reuid={uid} --regid={uid} --clear-groups -- env -i{kept} "$@"')
        variables = [f"{name}={value}" for name, value in env.items()]
        return ["ip", "netns", "exec", self.namespace(k), "unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", "\n".join(script), "sh", *variables, *cmd]

    def prepare_node(self, k: int, owner_dir: Path, node_dir: Path, socket_dir: Path, key: Path, ca: Path,
                     data: Path | None) -> dict:
        """Client k's folders: the owner's (a copy of its data, its state; the owner's uid only),
        the SuperNode's (its key, the CA certificate, its home; the node's uid only) and the
        service's socket folder (the owner's, passable by anyone: the service answers by uid).
        Returns the paths they use."""
        paths = dict(key=node_dir / "node.key", ca=node_dir / "ca.crt", home=node_dir / "home",
                     state=owner_dir / "state", owner_home=owner_dir / "home",
                     data=owner_dir / "data" if data is not None else None, socket=socket_dir / "service.sock")
        for folder in (owner_dir, node_dir, socket_dir, paths["home"], paths["state"], paths["owner_home"]):
            folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(key, paths["key"])
        shutil.copyfile(ca, paths["ca"])
        if data is not None:  # the client's machine holds its data; copies keep their times and content
            (shutil.copytree(data, paths["data"], dirs_exist_ok=True) if data.is_dir()
             else shutil.copy2(data, paths["data"]))
        for root, uid, mode in ((owner_dir, self.uid(k), 0o700), (socket_dir, self.uid(k), 0o711),
                                (node_dir, self.node_uid(k), 0o700)):
            for path in [root, *root.rglob("*")]:
                os.chown(path, uid, uid, follow_symlinks=False)
            root.chmod(mode)
        paths["key"].chmod(0o600)
        for folder in {owner_dir.parent, owner_dir.parent.parent, socket_dir.parent}:  # passable, not listable
            folder.chmod(folder.stat().st_mode | 0o111)  # (a closed folder above them is covered: wrap)
        return paths

    def can_read(self, k: int, uid: int, path: Path, home: Path, needs: list[Path]) -> bool:
        """Whether `uid` on client k's machine can read `path` (a file's bytes, a folder's listing)."""
        test = ["test", "-r", str(path)] if path.is_file() else ["ls", str(path)]
        env = {"PATH": "/usr/bin:/bin"}
        return _run(self.wrap(k, uid, test, env, home, needs)).returncode == 0


def _closed_ancestors(paths: list[Path]) -> dict[Path, list[Path]]:
    """The highest folder on the way to each path that other users cannot pass (no o+x), and
    the paths under it: {closed folder: [paths]}; paths with an open way are left out."""
    closed: dict[Path, list[Path]] = {}
    for path in dict.fromkeys(Path(p).resolve() for p in paths):
        for parent in reversed(path.parents):
            if not parent.stat().st_mode & 0o001:
                closed.setdefault(parent, []).append(path)
                break
    return closed


def _run(cmd: list[str], check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise DeploymentError(f"--isolate: `{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


def _ip(*args: str) -> None:
    _run(["ip", *args], check=True)
