"""A simulated federation's data side, as every party computes it from the public data set
(seeded, so the ServerApp, every ClientApp and the command line agree): the shards of a
built-in data set and each client's privacy plan. Clients that hold their own data
(client-data=own) do not use it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsd.data import datasets as data_lib
from fedsd.data.client_data import input_stats, run_images, task_for, with_custom_task
from fedsd.privacy import accounting as privacy
from fedsd.settings.run import TrainConfig, validate
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig, client_config
from fedsd.models.networks import feature_source

from fedsd.app.partition import shards


@dataclass
class Federation:
    """The data side of a federation, as every party computes it (seeded, so all agree)."""

    cfg: TrainConfig
    fed: FedConfig
    images: data_lib.ImageData
    train_indices: torch.Tensor  # into the full training set (a --subset, or all of it)
    shards: list[torch.Tensor]  # per client: positions into train_indices

    def shard_sizes(self) -> list[int]:
        return [len(s) for s in self.shards]

    def client_data(self, partition_id: int, device) -> data_lib.TensorData:
        return data_lib.prepare(self.images, self.train_indices[self.shards[partition_id]], device,
                                input_stats(self.cfg), feature_source(self.cfg))

    def client_test_share(self, partition_id: int) -> torch.Tensor:
        """A simulated client's own test split, for federated evaluation: an IID share of the
        public test split (seeded; positions into it, ascending)."""
        order = torch.randperm(len(self.images.y_test), generator=torch.Generator().manual_seed(self.cfg.seed))
        return order[partition_id::self.fed.num_clients].sort().values

    def client_plan(self, partition_id: int) -> privacy.PrivacyPlan:
        c = self.cfg
        return privacy.plan(c.epsilon, c.delta, len(self.shards[partition_id]), c.batch_size, c.epochs, c.accountant)

    def check_plans(self) -> None:
        """Every client's σ calibrated (BudgetError for one whose plan cannot fit), one search per
        distinct shard size: clients of equal size share it (privacy.plan's caches), and the
        Ray workers later find it on disk instead of searching again."""
        first_of_size = {len(shard): k for k, shard in enumerate(self.shards)}
        for k in first_of_size.values():
            self.client_plan(k)


def cut_shards(cfg: TrainConfig, fed: FedConfig) -> tuple[data_lib.ImageData, torch.Tensor, list[torch.Tensor]]:
    """The data set, the training samples a run takes (--subset, less --validation) and
    each client's shard of them (positions into those samples), as every party cuts them."""
    images = run_images(cfg)
    indices = data_lib.training_indices(images, cfg.subset, cfg.seed, cfg.validation, cfg.public_first)
    if fed.num_clients > len(indices):
        raise ConfigError(f"--clients: {fed.num_clients} clients but only {len(indices)} training samples")
    return images, indices, shards(images.y_train[indices], fed, cfg.seed)


def build_federation(cfg: TrainConfig, fed: FedConfig) -> Federation:
    """Load, subset and partition the data; check every client's shard against the settings.

    Raises ConfigError (naming the option, or the client and its size) before any training."""
    fed.validate()
    cfg = client_config(with_custom_task(cfg), fed)  # a custom data set's task, read from its files
    task_for(cfg)  # the model takes the task's images, before any data is read
    images, indices, parts = cut_shards(cfg, fed)
    for k, part in enumerate(parts):
        if len(part) < cfg.batch_size:
            raise ConfigError(f"client {k}'s shard has {len(part)} samples, fewer than --batch-size "
                              f"{cfg.batch_size}; lower --batch-size or use fewer clients")
    validate(cfg, min(len(p) for p in parts))  # δ < 1/n_k for every client
    return Federation(cfg, fed, images, indices, parts)
