"""flwr-datasets partitioners over the local labels give the sizes and labels they claim."""
import numpy as np
import pytest
import torch

from fedsd.app.partition import shards
from fedsd.settings.federation import FedConfig
from tests.conftest import require


@pytest.fixture(scope="module")
def labels():
    return torch.from_numpy(np.repeat(np.arange(10), 600))  # 6,000 samples, 600 a class


def test_iid_shards_cover_the_data_once_and_are_balanced(labels):
    parts = shards(labels, FedConfig(num_clients=6, partition="iid"), seed=0)
    assert [len(p) for p in parts] == [1000] * 6
    joined = torch.cat(parts)
    assert sorted(joined.tolist()) == list(range(6000))
    for p in parts:
        assert torch.equal(p, p.sort().values)
        counts = torch.bincount(labels[p], minlength=10)
        assert counts.min() >= 60 and counts.max() <= 140  # ~100 a class: a random 1/6 of each


def test_one_client_gets_everything_in_order(labels):
    (only,) = shards(labels, FedConfig(num_clients=1, partition="iid"), seed=3)
    assert torch.equal(only, torch.arange(6000))


def test_dirichlet_is_skewed_and_seeded(labels):
    fed = FedConfig(num_clients=5, partition="dirichlet", dirichlet_alpha=0.1)
    a, b = shards(labels, fed, seed=1), shards(labels, fed, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert sorted(torch.cat(a).tolist()) == list(range(6000))
    top_share = [torch.bincount(labels[p], minlength=10).max().item() / len(p) for p in a]
    assert max(top_share) > 0.4  # α = 0.1: a client is dominated by few classes (IID would be 0.1)
    c = shards(labels, fed, seed=2)
    assert any(len(x) != len(y) or not torch.equal(x, y) for x, y in zip(a, c))


def test_pathological_gives_each_client_its_classes(labels):
    parts = shards(labels, FedConfig(num_clients=5, partition="pathological", classes_per_client=2), seed=0)
    for p in parts:
        assert len(torch.unique(labels[p])) == 2
    joined = torch.cat(parts)
    assert len(set(joined.tolist())) == len(joined)  # disjoint
    used = torch.unique(labels[joined])
    assert len(joined) == 600 * len(used)  # every sample of a class in use goes to some client


def test_inner_dirichlet_gives_equal_shards_with_skewed_labels_at_a_thousand_clients():
    """Dirichlet(0.3) over classes per client, equal sizes: the label-skewed split that still
    gives each of 1000 clients a usable shard (DirichletPartitioner cannot, and says what to use)."""
    from fedsd.errors import ConfigError

    labels = torch.from_numpy(np.repeat(np.arange(10), 6000))  # 60,000 samples
    parts = shards(labels, FedConfig(num_clients=1000, partition="inner-dirichlet", dirichlet_alpha=0.3), seed=0)
    assert [len(p) for p in parts] == [60] * 1000
    assert sorted(torch.cat(parts).tolist()) == list(range(60000))
    top_class_share = np.mean([torch.bincount(labels[p], minlength=10).max().item() / 60 for p in parts])
    assert top_class_share > 0.4  # IID would give ~0.17: most of a client's samples are of one or two classes
    with pytest.raises(ConfigError, match="use --partition inner-dirichlet"):
        shards(labels, FedConfig(num_clients=1000, partition="dirichlet", dirichlet_alpha=0.3), seed=0)


def test_dirichlet_redraws_are_said_once_in_fedsds_words():
    """flwr-datasets warns at every Dirichlet draw that leaves a client too small (ten here, 600
    clients under Dirichlet(0.3)); fedsd says it once, with the accepted draw's shard sizes."""
    import warnings

    from fedsd.data import datasets as data_lib
    from fedsd.errors import FedsdNote

    require("fmnist")
    labels = data_lib.load("fmnist").y_train
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts = shards(labels, FedConfig(num_clients=600, partition="dirichlet", dirichlet_alpha=0.3), 0)
    sizes = [len(p) for p in parts]
    assert [w.category for w in caught] == [FedsdNote], [str(w.message)[:120] for w in caught]
    assert str(caught[0].message).startswith("--partition dirichlet: 10 Dirichlet(α=0.3) draw(s) left a client with "
                                             f"too few samples before one fitted; "
                                             f"shard sizes {min(sizes)}–{max(sizes)}")
