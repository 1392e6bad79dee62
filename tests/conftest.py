import os
import warnings
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "FEDSD_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["FEDSD_DATA_DIR"] = str(SHARED_DATA)
warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs one worker a core), each worker and what it starts
    takes its share of the cores: torch's default of every core in each would oversubscribe them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", share)
        os.environ.setdefault("MKL_NUM_THREADS", share)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def owner_records_of_the_session(tmp_path_factory):
    """The owners' records (fedsd.privacy.owner_record, kept outside their state folders) of these
    tests, never the user's own state home: for fixtures wider than a test."""
    patch = pytest.MonkeyPatch()
    patch.setenv("FEDSD_RECORD_DIR", str(tmp_path_factory.mktemp("owner-records")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def owner_records(tmp_path_factory, monkeypatch):
    """A folder of owners' records a test: two tests' owners of the same data are two owners,
    not one whose state folder the other restored."""
    folder = tmp_path_factory.mktemp("owner-records")
    monkeypatch.setenv("FEDSD_RECORD_DIR", str(folder))
    return folder


def require(dataset: str):
    """Skip a test whose data set is not on this machine; with FEDSD_REQUIRE_DATA=1 (CI) fail
    instead, so a machine without the data cannot pass on little coverage."""
    from fedsd.data.datasets import locate

    if locate(dataset) is None:
        if os.environ.get("FEDSD_REQUIRE_DATA") == "1":
            pytest.fail(f"{dataset} not found and FEDSD_REQUIRE_DATA=1: tests need the real data")
        pytest.skip(f"{dataset} not available here")


def write_idx_dataset(folder, n_train: int = 120, n_test: int = 40, seed: int = 0) -> dict:
    """A small data set in MNIST's own files (four gzipped IDX files) made by the test:
    random 28×28 uint8 images and labels 0–9. Returns the arrays written."""
    import gzip

    import numpy as np

    from fedsd.data.datasets import IDX_FILES

    rng = np.random.default_rng(seed)
    arrays = {"train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
              "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8)}
    folder.mkdir(parents=True, exist_ok=True)
    for key, name in IDX_FILES.items():
        a = arrays[key]
        header = bytes([0, 0, 8, a.ndim]) + b"".join(d.to_bytes(4, "big") for d in a.shape)
        with gzip.open(folder / name, "wb") as f:
            f.write(header + a.tobytes())
    return arrays


def write_cifar_shaped(root, n_train: int = 600, n_test: int = 200):
    """A CIFAR-10-shaped set made by the test, in CIFAR-10's npz layout (uint8 NHWC 32×32×3,
    labels 0–9) at root/cifar10/cifar10.npz, so every CIFAR-10 code path (loader, cifar-cnn,
    its statistics) runs where CIFAR-10 itself is not: real Fashion-MNIST images, padded to
    32×32 and repeated over three channels, so training on it learns. Returns `root`."""
    import numpy as np

    from fedsd.data import datasets as data_lib

    require("fmnist")
    images = data_lib.load("fmnist")
    rgb = lambda x: np.repeat(np.pad(x.numpy()[:, 0], ((0, 0), (2, 2), (2, 2)))[..., None], 3, axis=3)  # noqa: E731
    (root / "cifar10").mkdir(parents=True, exist_ok=True)
    np.savez(root / "cifar10" / "cifar10.npz", x_train=rgb(images.x_train[:n_train]),
             y_train=images.y_train[:n_train].numpy().astype(np.uint8), x_test=rgb(images.x_test[:n_test]),
             y_test=images.y_test[:n_test].numpy().astype(np.uint8))
    return root


def write_image_folder(folder, classes: dict[str, int], per_class: int):
    """An ImageFolder of real Fashion-MNIST images as PNG files, `per_class` of each label under
    train/<name>/<n>.png (no test split), as a user's own data would be. Returns `folder`."""
    from torchvision.io import write_png

    from fedsd.data import datasets as data_lib

    require("fmnist")
    images = data_lib.load("fmnist")
    for name, label in classes.items():
        (folder / "train" / name).mkdir(parents=True)
        for n, i in enumerate((images.y_train == label).nonzero().flatten()[:per_class].tolist()):
            write_png(images.x_train[i], str(folder / "train" / name / f"{n}.png"))
    return folder


def read_tensorboard(folder: Path) -> tuple[dict, dict]:
    """A TensorBoard log as TensorBoard reads it: {tag: [(step, value)]}, and the hparams."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    return scalars, hparams


def bookkeeping_clipped_sum(model: str, kernel: bool, conv_ways: dict[int, str] | None = None) -> list:
    """Each parameter's clipped sum from book-keeping on a fixed batch of 37 samples, clipping
    active (C = 0.05, below most samples' norms); kernel=False: PyTorch's patches and products;
    conv_ways: each conv layer's way forced (fedsd.clipping.bookkeeping.CONV_WAYS)."""
    import torch

    from fedsd.clipping.bookkeeping import BookKeepingEngine
    from fedsd.models.networks import build_model

    net = build_model(model, seed=0).to(memory_format=torch.channels_last)
    clipper = BookKeepingEngine(net, max_grad_norm=0.05, kernel=kernel, conv_ways=conv_ways)
    shape = (1, 28, 28) if model == "mnist-cnn" else (3, 32, 32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, *shape, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (37,), generator=g)
    clipper.backward(torch.nn.functional.cross_entropy(net(x), y), 37)
    return [p.grad.clone() for p in net.parameters()]


@pytest.fixture
def flower_task():
    """What Flower's runtime sets before it calls an app or builds a Message."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 11, 1


def stop_processes_mentioning(marker: str):
    """Kill every process whose command line contains `marker` (a test's private folder), and
    their descendants (Flower's SuperExec and app processes)."""
    import signal
    import subprocess

    def pgrep(*args):
        return [int(p) for p in subprocess.run(["pgrep", *args], capture_output=True, text=True).stdout.split()]

    found, todo = set(), [p for p in pgrep("-f", marker) if p != os.getpid()]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += pgrep("-P", str(pid))
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def flower_env(tmp_path):
    """Environment for Flower's own command-line tools: the venv's bin on PATH (they start one
    another by name), a private FLWR_HOME and free ports (so the managed local SuperLink that
    `flwr run` starts is this test's own, not a user's), and no per-run `uv sync` of the app's
    dependencies (the venv already has them and CI has no route to every index). Whatever
    Flower left running under that home is stopped afterwards."""
    from fedsd.deployment.local_deployment import flower_tool_env, free_port

    home = tmp_path / "flwr-home"
    home.mkdir()
    env = {**flower_tool_env(home),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    yield env
    stop_processes_mentioning(str(home))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """A data root with the three data sets at their real sizes: each where this machine has it,
    else a stand-in of the same shape and size made from Fashion-MNIST (MNIST: its files as they
    are; CIFAR-10: its images padded to 32×32 over three channels). A dry run checks the data's
    presence, sizes and the σ they give, not its pixels, so the README's commands for the
    papers' other data sets pass their checks on a machine that has only what `make` installs."""
    from fedsd.data import datasets as data_lib

    require("fmnist")
    root = tmp_path_factory.mktemp("data")
    (root / "fashion-mnist").symlink_to(data_lib.locate("fmnist"))
    (root / "mnist").symlink_to(data_lib.locate("mnist") or data_lib.locate("fmnist"))
    cifar = data_lib.locate("cifar10")
    if cifar is not None:
        (root / "cifar10").mkdir()
        (root / "cifar10" / cifar.name).symlink_to(cifar)
    else:
        write_cifar_shaped(root, n_train=50000, n_test=10000)
    # the README's ~/my-images (HOME is root/home): ten classes, 40 images each
    write_image_folder(root / "home" / "my-images", {f"class-{k}": k for k in range(10)}, per_class=40)
    return root
