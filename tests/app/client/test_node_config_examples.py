"""clients/examples/: the node configs an owner starts from are read as fedsd and Flower read them,
and every key in them is one the node reads, with a value it takes."""
import tomllib
from pathlib import Path

import numpy as np
import pytest

from fedsd.app.client.node_config import KEYS, NodeConfigError, owner_pairs, parse

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "clients" / "examples").glob("*.toml"))
PATH_KEYS = ("data", "state-dir", "secagg-roster", "service")


def test_there_are_examples_for_the_service_and_the_supernode():
    assert {p.name for p in EXAMPLES} >= {"owner-service.toml", "supernode.toml", "own-data-supernode.toml"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_an_example_node_config_parses_with_its_paths_made_real(example, tmp_path):
    pairs = owner_pairs(str(example))
    assert pairs == tomllib.loads(example.read_text()) and set(pairs) <= set(KEYS), sorted(set(pairs) - set(KEYS))
    real = dict(pairs)
    for key in PATH_KEYS:
        if key in real:
            real[key] = str(tmp_path / key)
    if "data" in real:
        real["data"] = str(tmp_path / "data.npz")
        np.savez(real["data"], x_train=np.zeros((4, 28, 28), np.uint8), y_train=np.arange(4))
    if "secagg-roster" in real:
        Path(real["secagg-roster"]).write_text("".join(f"owner-{k} {public_line()}\n" for k in range(3)))
        Path(real["secagg-roster"]).chmod(0o644)
    node = parse(real)
    assert node.partition_id == pairs["partition-id"]


def public_line() -> str:
    import base64

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return "ed25519:" + base64.b64encode(raw).decode()


def test_a_misspelt_key_in_an_example_would_be_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("partition-id = 0\nmax-epsilom = 3.0\n")
    with pytest.raises(NodeConfigError, match="max-epsilom"):
        parse(owner_pairs(str(bad)))
