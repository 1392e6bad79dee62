"""Flower ServerApp adapter: strategies, central evaluation, result files."""
