"""A real Flower deployment on this machine, the harness that `scripts/deploy-local.sh`
(fedsd/deployment/deploy_local.py), `fedsd bench deploy` and the deployment tests drive: one
`flower-superlink` and N `flower-supernode` processes on loopback, with TLS and SuperNode
authentication, runs submitted with `flwr run`, and the faults a deployment must survive (kill a
SuperNode, restart the SuperLink, bring an unknown key); with `isolate`, every client on a
machine of its own as far as one machine allows (`Isolation`).

Each process gets its own process group, so stopping one stops what it spawned (SuperExec,
the ServerApp / ClientApp processes); every process started is stopped on the way out, also
on failure, Ctrl-C or SIGTERM. Everything Flower writes (its home, the SuperLink's database,
the installed app, logs, credentials, each client's privacy state) goes under one work folder.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fedsd.deployment.processes import DeploymentError, descendants, stop_groups
from fedsd.deployment.isolation import Isolation
from fedsd.deployment.node_options import spread_pulls
from fedsd.deployment.shared_pages import SharedPages

ROOT = Path(__file__).resolve().parents[2]  # the repository (fedsd/deployment/ is two below it)
FLOOR_APP = ROOT / "scripts" / "floor"  # Flower's floor: a round that only sends and returns a model
FEDERATION = "fedsd"  # the SuperLink connection's name in the deployment's Flower config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_tool_env(flwr_home: Path) -> dict:
    """The environment Flower's command-line tools need here: the venv's bin on PATH (they
    start one another by name), their own FLWR_HOME, and no per-run `uv sync` of the app's
    dependencies (the venv already holds them, and a package index may not be reachable).
    SuperExec looks for a ClientApp to start every second by default; every round waits for
    that, so it looks every 0.5 s (0.1 s took CPU from the training clients: results/deploy-vs-sim.md).
    Flower's telemetry is off unless the caller turned it on (FLWR_TELEMETRY_ENABLED): an owner's
    machines report nothing of their runs to anyone, and these have no internet to report to."""
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "FLWR_HOME": str(flwr_home), "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.5"),
            "FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0")}


def node_threads(nodes: int, cores: int | None = None) -> int:
    """Threads for each of `nodes` nodes sharing `cores` (this machine's): their share, at least 1."""
    return max(1, (cores or os.cpu_count() or 1) // nodes)


def stop_on_sigterm() -> None:
    """A command's SIGTERM raises KeyboardInterrupt, so its LocalDeployment stops everything it
    started (processes, network namespaces) on the way out; the default action left them running."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def run_config_arg(values: dict) -> str:
    """A dict as `flwr run --run-config` reads it (TOML values)."""
    def toml(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return "'" + v.replace("'", "") + "'"
        return repr(v)
    return " ".join(f"{k}={toml(v)}" for k, v in values.items())


class LocalDeployment:
    """Start, inspect and stop a TLS + node-authenticated federation on this machine: on
    127.0.0.1, or with `isolate` each SuperNode in its own network namespace and uid."""

    def __init__(self, work: Path, num_clients: int, env: dict | None = None, client_data: Path | None = None,
                 node_config: str | list[str] = "", isolate: bool = False, warm_clientapps: bool = True,
                 pull_interval: float | str | None = "spread", durable_superlink: bool = True,
                 share_pages: bool = False):
        self.work = Path(work).absolute()
        # The SuperLink's state in work/superlink.db, so that a SuperLink started again within this
        # deployment (the resume test, the soak) still knows the registered nodes; False: Flower's
        # in-memory state (its default), for a deployment whose SuperLink starts once (`start`
        # empties the database anyway): each of the nodes' requests then costs no SQL
        # (results/deploy-distributed.md, "Where a stage's time goes").
        self.durable_superlink = durable_superlink
        # each SuperNode's ClientApp tasks forked from a warm process (fedsd/deployment/warm_supernode.py),
        # its pull loop's sleeps capped at pull_interval seconds (None: Flower's 3 s; "spread": PULL_SECONDS,
        # longer with many nodes, spread_pulls); cold: Flower's command
        self.warm_clientapps = warm_clientapps
        self._pull_interval = spread_pulls(num_clients) if pull_interval == "spread" else pull_interval
        self.num_clients = num_clients
        self.client_data = Path(client_data).absolute() if client_data else None  # client k: client_data/client-k
        # more k=v pairs for every SuperNode (max-epsilon=3 ...), or a list of them, one per SuperNode
        self.node_config = [node_config] * num_clients if isinstance(node_config, str) else list(node_config)
        self.isolation = Isolation(self.work, num_clients) if isolate else None
        if self.isolation is not None:
            self.isolation.check()
        # many clients in one machine's memory, for a trial (fedsd/deployment/shared_pages.py)
        self.shared_pages = SharedPages() if share_pages else None
        if self.shared_pages is not None:
            self.shared_pages.check()
        self.host = self.isolation.host if self.isolation else "127.0.0.1"
        self.port = free_port()
        self.address = f"{self.host}:{self.port}"
        self.credentials = self.work / "credentials"
        self.ca = self.credentials / "certificates" / "ca.crt"
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.flwr_home = self.work / "flwr-home"
        self.flwr_home.mkdir(exist_ok=True)
        self.env = {**flower_tool_env(self.flwr_home), **(env or {})}
        # Nodes on one machine share its cores: each SuperNode (its warm worker or its owner's data
        # service) takes cores ÷ nodes threads, as Ray gives a simulated client its CPUs, unless the
        # operator set OMP_NUM_THREADS. With torch's default each took every core (2 SuperNodes on
        # 2 cores: (deployed − floor) / simulated 1.89 where one thread each gave 1.17).
        # The SuperLink and the ServerApp it starts take every core (the operator's OMP_NUM_THREADS
        # where set): the ServerApp scores each round's model while the nodes wait for the next
        # round, and on one thread that took 0.85 s of a 4.5 s ten-owner round (the features recipe).
        self._server_env = {**self.env, "OMP_NUM_THREADS": self.env.get("OMP_NUM_THREADS",
                                                                         str(os.cpu_count() or 1)),
                            **self._group_env("server")}
        self.env.update(self._group_env("nodes"))
        self.env.setdefault("OMP_NUM_THREADS", str(node_threads(num_clients)))
        self.node_threads = int(self.env["OMP_NUM_THREADS"])
        self.superlink: subprocess.Popen | None = None
        self.supernodes: dict[int, subprocess.Popen] = {}
        self.node_ids: dict[int, int] = {}  # client k → the node id the SuperLink gave its key
        self.services: dict[int, subprocess.Popen] = {}  # --isolate: each client's data service
        self._all: list[subprocess.Popen] = []
        self._children: dict[int, list[tuple[int, str]]] = {}  # pid → its descendants when last looked at
        self._network_up = False
        self._staged = False  # this checkout's app copied for `flwr run` (_staged_app)

    # -- processes ---------------------------------------------------------------------------
    def _start(self, name: str, cmd: list[str], env: dict | None = None, client: bool = False) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        if self.shared_pages is not None:
            cmd = self.shared_pages.command(cmd, client)
        # its own group: stop it with its children
        proc = subprocess.Popen(cmd, env=self.env if env is None else env, cwd=self.work, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._all.append(proc)
        return proc

    def remember_children(self) -> None:
        """Notes each started process's descendants (pid and start time), so that a stop finds a
        child in a session of its own even after its parent died on its own (Flower's SuperExec
        left by a SuperLink that crashed is no longer anyone's descendant)."""
        for proc in self._all:
            if proc.poll() is None:
                self._children[proc.pid] = sorted({*self._children.get(proc.pid, []), *descendants(proc.pid)})

    @staticmethod
    def stop(proc: subprocess.Popen | None, grace: float = 5.0, known: list[tuple[int, str]] = ()) -> None:
        """Stops proc's process group, then its descendants outside the group that still run,
        those found now and those `known` from before (each checked by its start time)."""
        if proc is not None:
            stop_groups([(proc, list(known))], grace)

    def stop_all(self) -> None:
        try:
            stop_groups([(proc, self._children.get(proc.pid, [])) for proc in self._all], grace=2.0)
            if self.isolation is not None and self._network_up:
                self.isolation.down()
                self._network_up = False
        finally:  # also when a second Ctrl-C cuts the stop short
            if self.shared_pages is not None:
                self.shared_pages.stop()

    def _group_env(self, group: str) -> dict:
        """--share-pages: the hash secret of the group (owners, nodes, server) a process is in."""
        return self.shared_pages.env(group) if self.shared_pages is not None else {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()

    # -- set-up --------------------------------------------------------------------------------
    def make_credentials(self, extra_keys: int = 0) -> None:
        """CA, SuperLink certificate, and one key pair per client (+ extra_keys never registered);
        a --work used before keeps its credentials, as a machine keeps its keys."""
        if self.ca.is_file() and not _certificate_names(self.credentials / "certificates" / "server.pem", self.host):
            shutil.rmtree(self.credentials)  # made for another address: new ones (nodes register anew)
        if not self.ca.is_file():
            subprocess.run([sys.executable, str(ROOT / "server" / "make_credentials.py"), "--out",
                            str(self.credentials), "--nodes", str(self.num_clients + extra_keys),
                            "--host", self.host], check=True, capture_output=True)
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{FEDERATION}"\n\n[superlink.{FEDERATION}]\n'
            f'address = "{self.address}"\nroot-certificates = "{self.ca}"\n')

    def start_superlink(self, timeout: float = 60) -> None:
        certs = self.credentials / "certificates"
        self.superlink = self._start("superlink", [
            "flower-superlink", "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth", "--host", self.host,
            "--port", str(self.port),
            "--database", str(self.work / "superlink.db") if self.durable_superlink else ":flwr-in-memory:",
            "--disable-runtime-dependency-installation"], env=self._server_env)
        deadline = time.monotonic() + timeout
        while not self._tls_ready():
            if self.superlink.poll() is not None:
                raise DeploymentError(f"flower-superlink exited with code {self.superlink.returncode}; "
                                      f"see {self.logs / 'superlink.log'}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"flower-superlink did not listen on {self.address} within {timeout:.0f} s")
            time.sleep(0.3)

    def _tls_ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.ca))
        try:
            with socket.create_connection((self.host, self.port), timeout=2) as raw:
                with context.wrap_socket(raw, server_hostname=self.host):
                    return True
        except OSError:
            return False

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["flwr", *args], env=self.env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)

    def register(self, key_index: int) -> int:
        """Put node key `key_index` on the SuperLink's list; returns the node id Flower gave it."""
        pub = self.credentials / "keys" / f"node-{key_index}.pub"
        proc = self.flwr("supernode", "register", str(pub), FEDERATION, "--format", "json")
        if proc.returncode != 0:
            raise DeploymentError(f"flwr supernode register {pub.name} failed:\n{proc.stdout}{proc.stderr}")
        return int(json.loads(proc.stdout)["node-id"])

    def start_supernode(self, partition_id: int, key_index: int | None = None, max_retries: int | None = None,
                        name: str | None = None) -> subprocess.Popen:
        key = self.credentials / "keys" / f"node-{partition_id if key_index is None else key_index}"
        data = self.client_data / f"client-{partition_id}" if self.client_data is not None else None
        owner = f"partition-id={partition_id} num-partitions={self.num_clients}"
        if self.isolation is not None:  # the owner's data service, then its SuperNode as another user
            return self._start_isolated(partition_id, key, data, owner, key_index, max_retries, name)
        node_config = f"{owner} state-dir='{self.work / 'client-state' / str(partition_id)}'"
        if data is not None:  # its record outside its state folder: this work folder's machine, not the user's home
            node_config += f" data='{data}'"
            if "record-dir" not in self.node_config[partition_id]:
                node_config += f" record-dir='{self.work / 'client-records' / str(partition_id)}'"
        if self.node_config[partition_id]:
            node_config += " " + self.node_config[partition_id]
        proc = self._start(name or f"supernode-{partition_id}", self._supernode_cmd(key, self.ca, node_config,
                                                                                    max_retries), client=True)
        if key_index is None:
            self.supernodes[partition_id] = proc
        return proc

    @property
    def pull_interval(self) -> float | None:
        """The warm SuperNodes' --pull-interval; None: Flower's 3 s (cold ClientApps are Flower's command)."""
        return self._pull_interval if self.warm_clientapps else None

    def _supernode_cmd(self, key: Path, ca: Path, node_config: str, max_retries: int | None) -> list[str]:
        start = [sys.executable, "-P", "-m", "fedsd.deployment.warm_supernode"] if self.warm_clientapps else \
            ["flower-supernode"]
        if self.pull_interval is not None:
            start += [f"--pull-interval={self.pull_interval:g}"]
        cmd = start + ["--root-certificates", str(ca), "--superlink", self.address,
               "--auth-supernode-private-key", str(key), "--node-config", node_config, "--port", str(free_port())]
        return cmd + (["--max-retries", str(max_retries)] if max_retries is not None else [])

    def _start_isolated(self, k: int, key: Path, data: Path | None, owner: str, key_index, max_retries,
                        name) -> subprocess.Popen:
        """Client k as --isolate runs it: the owner's data service (the project's code, the
        owner's uid, the data and state) and a SuperNode (the node's uid) whose node config names
        only that service."""
        iso = self.isolation
        own, owner_config, env = self._owner(k, key, data, owner)
        if key_index is None:  # a stand-in with a stray key (tests) needs no service of its own
            service = [sys.executable, "-P", "-m", "fedsd.cli.main", "data-service", "--socket", str(own["socket"]),
                       "--node-config", owner_config, "--allow-uid", str(iso.node_uid(k))]
            self.services[k] = self._start(f"data-service-{k}", *self._as_client(
                k, iso.uid(k), service, env, self.owner_dir(k), self.owner_needs(k), "owners"), client=True)
            self._wait_for_socket(own["socket"], self.services[k], f"data-service-{k}")
        env = {"PATH": self.env["PATH"], "HOME": str(own["home"]), "FLWR_HOME": str(own["home"] / "flwr"),
               **self._kept_env()}
        node_config = f"{owner} service='{own['socket']}'"
        proc = self._start(name or f"supernode-{k}", *self._as_client(
            k, iso.node_uid(k), self._supernode_cmd(own["key"], own["ca"], node_config, max_retries), env,
            self.node_dir(k), self.node_needs(k), "nodes"), client=True)
        if key_index is None:
            self.supernodes[k] = proc
        return proc

    def _as_client(self, k: int, uid: int, cmd: list[str], env: dict, home: Path, needs: list[Path],
                   group: str) -> tuple[list[str], dict]:
        """`cmd` as `uid` on client k's machine (Isolation.wrap) and the environment to start that
        in: the group's hash secret (--share-pages) goes through it, never a command line."""
        secret = self._group_env(group)
        return (self.isolation.wrap(k, uid, cmd, env, home, needs, from_env=tuple(secret)), {**self.env, **secret})

    def _kept_env(self) -> dict:
        """What a client's processes keep of this one's environment; an owner's record folder is
        its own, in its home (fedsd.privacy.owner_record), never one FEDSD_RECORD_DIR names here."""
        return {k: v for k, v in self.env.items() if k.startswith(("FLWR_", "FEDSD_", "OMP_", "LANG"))
                and k not in ("FLWR_HOME", "FEDSD_RECORD_DIR")}

    def _owner(self, k: int, key: Path, data: Path | None, owner: str) -> tuple[dict, str, dict]:
        """Client k's folders (Isolation.prepare_node), and its owner's node config and
        environment, as its data service gets them."""
        own = self.isolation.prepare_node(k, self.owner_dir(k), self.node_dir(k), self.socket_dir(k), key, self.ca,
                                          data)
        owner_config = f"{owner} state-dir='{own['state']}'" + (f" data='{own['data']}'" if own["data"] else "")
        if self.node_config[k]:
            owner_config += " " + self.node_config[k]
        env = {"PATH": self.env["PATH"], "HOME": str(own["owner_home"]), "PYTHONPATH": str(ROOT), **self._kept_env()}
        return own, owner_config, env

    def identities(self) -> dict[int, str]:
        """--isolate: each owner's identity for secure aggregation's roster (fedsd.secure.identity), made
        by that owner: `fedsd data-service --identity` with the node config its service gets (a
        `secagg-roster` there is not read yet), as its uid, on its machine, so that the key is in
        its state folder, its alone (0600). Returns client k → its public line, `ed25519:<base64>`.
        Call it before `start`, so that the roster the services read can list them (`write_shared`);
        the network comes up here then."""
        iso = self.isolation
        if iso is None:
            raise DeploymentError("identities: an owner's identity is made by its own uid (--isolate)")
        self.make_credentials()
        self._network()
        commands = {}
        for k in range(self.num_clients):
            data = self.client_data / f"client-{k}" if self.client_data is not None else None
            _, owner_config, env = self._owner(k, self.credentials / "keys" / f"node-{k}", data,
                                               f"partition-id={k} num-partitions={self.num_clients}")
            # `fedsd data-service --identity` without the command line's imports (torch: 8 s an owner,
            # 11 minutes for a hundred made one after another)
            cmd = [sys.executable, "-P", "-c", "import sys; from fedsd.app.client.owner_service import identity_main; "
                   "sys.exit(identity_main(sys.argv[1:]))", owner_config]
            cmd, outer = self._as_client(k, iso.uid(k), cmd, env, self.owner_dir(k), self.owner_needs(k), "owners")
            commands[k] = (self.shared_pages.command(cmd, client=True) if self.shared_pages is not None else cmd,
                           outer)

        def identity(k: int) -> str:
            proc = subprocess.run(commands[k][0], env=commands[k][1], capture_output=True, text=True, timeout=120)
            if proc.returncode != 0 or not proc.stdout.strip():
                raise DeploymentError(f"owner {k}'s identity (fedsd data-service --identity): {proc.stderr.strip()}")
            return proc.stdout.strip().splitlines()[-1]

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # a process each, as many at once as cores
            lines = dict(zip(commands, pool.map(identity, commands)))
        return lines

    def write_roster(self) -> Path:
        """Each owner's identity (`identities`: made by its own uid, kept from one start to the
        next) on one roster, shared_dir()/roster; returns its path."""
        lines = self.identities()
        return self.write_shared("roster", "# the federation's owners, one identity each (made by the owner's own "
                                 "uid)\n" + "".join(f"owner-{k} {lines[k]}\n" for k in sorted(lines)))

    def shared_dir(self) -> Path:
        """work/shared: files every client may read and none may write (a federation's roster),
        this (root's) process's, in every client's view under --isolate."""
        return self.work / "shared"

    def write_shared(self, name: str, text: str) -> Path:
        """shared_dir()/name, mode 0644 in a 0755 folder: readable by every client's owner and
        SuperNode, writable by none (what `read_roster` asks of a roster)."""
        folder = self.shared_dir()
        folder.mkdir(mode=0o755, exist_ok=True)
        folder.chmod(0o755)  # (a closed folder above it is covered in a client's view: wrap)
        path = folder / name
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(path)
        return path

    def _network(self) -> None:
        """What the clients' machines share, up before the first process starts: the bridge and
        namespaces (--isolate), the kernel's page merging (--share-pages)."""
        if self.shared_pages is not None:
            self.shared_pages.start()  # idempotent; stop_all restores ksmd's settings
        if self.isolation is not None and not self._network_up:
            self._network_up = True  # from here on stop_all takes the network down, whatever fails
            self.isolation.up()

    def _wait_for_socket(self, socket_path: Path, proc: subprocess.Popen, name: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not socket_path.exists():
            if proc.poll() is not None:
                raise DeploymentError(f"{name} exited with code {proc.returncode}; see {self.logs / (name + '.log')}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"{name} did not listen within {timeout:.0f} s; see {self.logs}")
            time.sleep(0.2)

    def owner_dir(self, k: int) -> Path:
        """Client k's data owner's folder under --isolate: its data and its state."""
        return self.work / "nodes" / str(k)

    def node_dir(self, k: int) -> Path:
        """Client k's SuperNode's folder under --isolate: its key and its Flower home."""
        return self.work / "supernodes" / str(k)

    def socket_dir(self, k: int) -> Path:
        return self.work / "sockets" / str(k)

    def _public_needs(self) -> list[Path]:
        """What every client process must reach: the interpreter and its environment, the project
        (the code both the service and the app bundle's copy run), the public data sets, and the
        federation's shared files (`write_shared`: a roster)."""
        needs = [Path(sys.base_prefix), Path(sys.prefix), ROOT]
        return needs + [Path(p) for p in (self.env.get("FEDSD_DATA_DIR"), self.shared_dir()) if p and Path(p).is_dir()]

    def owner_needs(self, k: int) -> list[Path]:
        return self._public_needs() + [self.owner_dir(k), self.socket_dir(k)]

    def node_needs(self, k: int) -> list[Path]:
        return self._public_needs() + [self.node_dir(k), self.socket_dir(k)]

    def client_can_read(self, k: int, path: Path, as_owner: bool = False) -> bool:
        """Whether client k's SuperNode (and its ClientApps), or with `as_owner` its data
        service, can read `path` under --isolate (for tests and the guide)."""
        iso = self.isolation
        if as_owner:
            return iso.can_read(k, iso.uid(k), Path(path), self.owner_dir(k), self.owner_needs(k))
        return iso.can_read(k, iso.node_uid(k), Path(path), self.node_dir(k), self.node_needs(k))

    def node_statuses(self) -> dict[int, str]:
        """The SuperLink's word on each registered node ("online", "offline", ...) by node id;
        empty when `flwr supernode list` could not say."""
        proc = self.flwr("supernode", "list", FEDERATION, "--format", "json")
        if proc.returncode != 0:
            return {}
        return {int(n["node-id"]): n.get("status") for n in json.loads(proc.stdout).get("nodes", [])}

    def online_nodes(self) -> int:
        return sum(status == "online" for status in self.node_statuses().values())

    def wait_online(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.online_nodes() < count:
            dead = [k for k, p in self.supernodes.items() if p.poll() is not None]
            if dead:
                raise DeploymentError(f"SuperNode(s) {dead} exited; see {self.logs}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"fewer than {count} SuperNodes online after {timeout:.0f} s; see {self.logs}")
            time.sleep(1)

    def start(self) -> None:
        """Credentials, SuperLink, every client registered and online. The SuperLink starts from
        an empty database; what a client keeps (its state-dir: ledgers, privacy state, prepared
        data) stays from one start to the next."""
        for old in self.work.glob("superlink.db*"):
            old.unlink()
        self.make_credentials()
        self._network()
        self.start_superlink()
        for k in range(self.num_clients):
            self.node_ids[k] = self.register(k)
        for k in range(self.num_clients):
            self.start_supernode(k)
            if self.shared_pages is not None:  # each client once the merging has caught up
                self.shared_pages.pace()
        self.wait_online(self.num_clients)
        self.remember_children()

    def submit(self, run_config: dict, app: Path = ROOT) -> subprocess.Popen:
        """`flwr run <app> <federation> --stream` in the background; the app is fedsd's, or
        another (fedsd bench deploy's floor). Its output goes to logs/flwr-run-<n>.log for the
        work folder's n-th submission (the process's `.log`): one file each, because an earlier
        `flwr run` whose SuperLink was stopped may still be printing while a later one runs."""
        n = 1 + max((int(p.stem.rpartition("-")[2]) for p in self.logs.glob("flwr-run-*.log")
                     if p.stem.rpartition("-")[2].isdigit()), default=0)  # the work folder may be reused
        if Path(app) == ROOT:
            app = self._staged_app()
        proc = self._start(f"flwr-run-{n}", ["flwr", "run", str(app), FEDERATION, "--stream",
                                             "--run-config", run_config_arg(run_config)], env=self._server_env)
        proc.log = self.logs / f"flwr-run-{n}.log"
        return proc

    def _staged_app(self) -> Path:
        """This checkout's app as `flwr run` bundles it (pyproject.toml and the fedsd package, whose
        fab-include and fab-exclude it reads), copied to work/app at a deployment's first submission:
        `flwr run` on the checkout itself walks and resolves every file under it before it filters
        (the venv's, the results'; 53,000 files, 4.5 CPU-seconds a submission here), for the same bundle."""
        staged = self.work / "app"
        if not self._staged:  # once a deployment: a work folder used again gets the checkout as it is now
            shutil.rmtree(staged, ignore_errors=True)
            shutil.copytree(ROOT / "fedsd", staged / "fedsd", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            shutil.copy(ROOT / "pyproject.toml", staged / "pyproject.toml")
            self._staged = True
        return staged

    def run(self, run_config: dict, timeout: float = 3600, echo=None, app: Path = ROOT) -> None:
        """Submit the run and wait for it. `echo(line)` gets each round's line as the ServerApp
        logs it (fedsd round k/R: accuracy, ε, who trained, refused or missed)."""
        proc = self.submit(run_config, app)
        log, seen = proc.log, 0
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                self.stop(proc)
                raise DeploymentError(f"the run did not end within {timeout:.0f} s; see {self.logs}")
            seen = self._echo_rounds(log, seen, echo)
            time.sleep(0.5)
        self._echo_rounds(log, seen, echo)
        # flwr run exits 0 even when the ServerApp raised: its output says so
        output = log.read_bytes().decode(errors="replace")
        if proc.returncode != 0 or "ServerApp raised an exception" in output:
            reason = server_error(output)
            raise DeploymentError((f"the run stopped: {reason}" if reason else
                                   f"the run failed (flwr run exit code {proc.returncode})") + f" (log: {log})")

    def run_floor(self, shapes: list[list[int]], rounds: int, out: Path, timeout: float = 3600) -> list[float]:
        """Flower's floor (scripts/floor) on this deployment: `rounds` rounds, each sending every node
        float32 arrays of `shapes` and waiting for them back; each round's seconds (also out/floor.json)."""
        self.run({"num-server-rounds": rounds, "num-clients": self.num_clients, "out-dir": str(out),
                  "shapes": json.dumps(shapes, separators=(",", ":"))}, timeout=timeout, app=FLOOR_APP)
        return json.loads((Path(out) / "floor.json").read_text())["round_seconds"]

    @staticmethod
    def _echo_rounds(log: Path, seen: int, echo) -> int:
        if echo is None or not log.exists():
            return seen
        with open(log, "rb") as f:
            f.seek(seen)
            new = f.read()
        done = new.rfind(b"\n") + 1  # whole lines only
        for line in new[:done].decode(errors="replace").splitlines():
            if "fedsd round " in line:
                echo(line[line.index("fedsd round "):].strip())
        return seen + done


# The errors with which fedsd's ServerApp stops a run, each with a reason a person can act on.
SERVER_ERRORS = ("NoClientCanTrain", "ClientsFailed", "TrainingDiverged", "ConfigError", "DataError", "BudgetError")


def server_error(log: str) -> str | None:
    """The reason fedsd's ServerApp gave for stopping the run, from `flwr run --stream`'s output."""
    import re

    found = re.findall(rf"\b(?:{'|'.join(SERVER_ERRORS)}): (.+)", log)
    if found:
        return found[-1].strip()
    # Anything else it raised (a bug, not a refusal): the traceback's last line names it.
    other = re.findall(r"^\s*((?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*)$", log, re.MULTILINE)
    return f"the ServerApp raised {other[-1].strip()}" if other else None


def _certificate_names(pem: Path, host: str) -> bool:
    """Whether the certificate in `pem` names `host` (an IP address) among its subject's names."""
    import ipaddress

    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ipaddress.ip_address(host) in names.get_values_for_type(x509.IPAddress)


