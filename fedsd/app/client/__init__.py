"""Flower ClientApp adapter: runs fedsd's training loop on one client's shard."""
