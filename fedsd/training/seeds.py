"""Independent seeds for independent uses of one run's seed."""
import numpy as np

# What each derived seed is for: the initial model, a data holder's sampling and noise
# generator, DPKD's fresh stage-2 student, the noise of a central run's private feature
# normalisation (fedsd.data.features.private_statistics).
SEED_MODEL_INIT, SEED_CLIENT_RNG, SEED_KD_STUDENT, SEED_FEATURE_NORM = 0, 1, 2, 3


def derive_seed(seed: int, *purpose: int) -> int:
    """Independent seeds for independent uses (model init, a client's RNG, ...)."""
    return int(np.random.SeedSequence([seed, *purpose]).generate_state(1, dtype=np.uint32)[0])
