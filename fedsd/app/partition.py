"""Client shards with flwr-datasets' partitioners over the locally loaded labels.

Only an index column and the labels go into a Hugging Face Dataset; the images stay tensors.
Each shard's indices come back sorted, so one client's shard is the whole training set in
its original order (the single-client identity).
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np
import torch

from fedsd.errors import ConfigError, FedsdNote
from fedsd.settings.federation import FedConfig


def _partitioner(fed: FedConfig, seed: int, num_samples: int):
    # Imported here: Hugging Face datasets takes over a second to import, and a deployed client
    # with its own data, a fresh process for every message, never partitions anything.
    from flwr_datasets.partitioner import (DirichletPartitioner, IidPartitioner, InnerDirichletPartitioner,
                                           PathologicalPartitioner)

    if fed.partition == "iid":
        return IidPartitioner(num_partitions=fed.num_clients)
    if fed.partition == "inner-dirichlet":
        size, extra = divmod(num_samples, fed.num_clients)
        return InnerDirichletPartitioner(partition_sizes=[size + (k < extra) for k in range(fed.num_clients)],
                                         partition_by="label", alpha=fed.dirichlet_alpha, shuffle=True, seed=seed)
    if fed.partition == "dirichlet":
        return DirichletPartitioner(num_partitions=fed.num_clients, partition_by="label",
                                    alpha=fed.dirichlet_alpha,
                                    shuffle=True, seed=seed)
    return PathologicalPartitioner(num_partitions=fed.num_clients, partition_by="label",
                                   num_classes_per_partition=fed.classes_per_client,
                                   class_assignment_mode="first-deterministic", shuffle=True, seed=seed)


@lru_cache(maxsize=8)
def _all_shards(labels_key: bytes, num_clients: int, partition: str, alpha: float, classes: int,
                seed: int) -> tuple[np.ndarray, ...]:
    from datasets import Dataset

    labels = np.frombuffer(labels_key, dtype=np.int64)
    fed = FedConfig(num_clients=num_clients, partition=partition, dirichlet_alpha=alpha,
                     classes_per_client=classes)
    table = Dataset.from_dict({"index": np.arange(len(labels)), "label": labels})
    if partition == "iid":  # IidPartitioner cuts contiguous shards: shuffle first, as FederatedDataset does
        table = table.shuffle(seed=seed)
    partitioner = _partitioner(fed, seed, len(labels))
    partitioner.dataset = table
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parts = tuple(np.sort(np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64))
                          for i in range(num_clients))
    except ValueError as e:  # DirichletPartitioner: no draw gave every client its minimum size
        raise ConfigError(f"--partition {partition}: {num_clients} clients at --dirichlet-alpha {alpha:g} cannot "
                          f"all get a usable shard ({e}); use --partition inner-dirichlet (equal shard sizes, each "
                          f"client's labels drawn from Dirichlet(α)), fewer clients or a larger α") from None
    _say_redraws(caught, parts, alpha)
    return parts


def _say_redraws(caught: list, parts: tuple, alpha: float) -> None:
    """flwr-datasets' DirichletPartitioner warns at every draw that left a client below its
    minimum size (eleven warnings, some thirty lines, at 1,000 clients under Dirichlet(0.3));
    fedsd says it once, with the shard sizes the accepted draw gave. Other warnings pass on."""
    redraws = 0
    for w in caught:
        if "min_partition_size" in str(w.message) and "was not satisfied" in str(w.message):
            redraws += 1
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if redraws:
        sizes = [len(p) for p in parts]
        warnings.warn(f"--partition dirichlet: {redraws} Dirichlet(α={alpha:g}) draw(s) left a client with too few "
                      f"samples before one fitted; shard sizes {min(sizes)}–{max(sizes)} (--partition "
                      f"inner-dirichlet gives every client the same size)", FedsdNote, stacklevel=3)


def shards(labels: torch.Tensor, fed: FedConfig, seed: int) -> list[torch.Tensor]:
    """Every client's shard: positions into `labels`, sorted ascending (cached per process)."""
    key = labels.numpy().astype(np.int64).tobytes()
    parts = _all_shards(key, fed.num_clients, fed.partition, float(fed.dirichlet_alpha),
                        int(fed.classes_per_client), int(seed))
    return [torch.from_numpy(p.copy()) for p in parts]
