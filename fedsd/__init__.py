"""fedsd: differentially private training with self-distillation (DP3SD, DPDSD) and baselines.

The algorithm library: data, models, losses, privacy accounting and the one DP training loop.
It imports nothing of Flower; `clients/` and `server/` adapt it to Flower.
"""
__version__ = "0.1.0"
