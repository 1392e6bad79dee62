"""Random draws no one but the data's owner can predict: the Poisson batches and the Gaussian
noise of a client that holds its own data, against a server that may search for them.

Why not torch's generator with a secret seed: torch's CPU generator is a Mersenne Twister, and
`manual_seed` keeps only the low 32 bits of a seed, so a server that sees one noised update can
try every seed (2^32 candidates, about a hundred core-hours) and subtract the noise it finds.
Mersenne Twister is not a cryptographic generator in any case: its state follows from its
output.

What this is: AES-256 in counter mode, from `cryptography` (OpenSSL), used as a stream of
random bits. The key is 256 bits from the operating system's CSPRNG (`secrets`), and a stream
lives in memory only, for one training call: a client draws a fresh key at the start of every
call (fedsd/app/client/handler.py) and never writes one to its disk. So no copy of its state (a second
service on the same folder, a restored backup, the folder copied to another machine) can replay
a keystream: two calls share a key with probability 2^-256 whatever the disk holds. A reply
already released is kept and sent again as it was (no draw, no charge), which is all that
replaying a round needs. AES-CTR under a uniformly random key
is the generator of NIST SP 800-90A's CTR_DRBG (without its reseeding): its output cannot be
told from uniform bits by anyone without the key. (ChaCha20 would do as well; AES is chosen
for its 128-bit counter, which makes "block n" a plain nonce.)

How a Gaussian is drawn from it: Box-Muller on 53-bit uniforms, in float64. As under Opacus'
`secure_mode`, each noise value is the sum of 2n = 4 such draws divided by 2 (Holohan & Braghin,
2021, section 5.1: the same N(0, σ²), and a floating-point attack in the manner of Mironov
(2012) against the sum needs about 2^159 work instead of 2^53). The sum is formed in float64 and
rounded once to the gradient's dtype. This is a mitigation, as in Opacus, not an exact sampler.
"""
from __future__ import annotations

import math
import secrets

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32  # AES-256: a 256-bit secret
BLOCK = 16  # AES's block, the unit the stream's position counts in
SECURE_DRAWS = 4  # Gaussians summed for one noise value (Opacus' secure_mode: 2n with n = 2)
CHUNK = 1 << 20  # values drawn at a time for a large tensor (bounded float64 working memory)


class SecretStream:
    """A cryptographically secure stream of random numbers: AES-256-CTR under a key from the
    operating system. `position` counts the 16-byte blocks used; (key, position) is its whole
    state."""

    def __init__(self, key: bytes, position: int = 0):
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"a secret stream's key is {KEY_BYTES} bytes")
        if not isinstance(position, int) or not 0 <= position < 1 << 127:
            raise ValueError("a secret stream's position is a block count in [0, 2^127)")
        self._key, self.position = bytes(key), position

    @classmethod
    def fresh(cls) -> "SecretStream":
        """A new stream, keyed from the operating system's CSPRNG."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def __repr__(self) -> str:  # never the key
        return f"SecretStream(position={self.position})"

    def __deepcopy__(self, memo) -> "SecretStream":
        return SecretStream(self._key, self.position)

    # -- draws ---------------------------------------------------------------------------------
    def random_bytes(self, n: int) -> bytes:
        """The next n bytes of the stream (whole blocks are used: the rest of a block is skipped)."""
        blocks = -(-n // BLOCK)
        nonce = (self.position % (1 << 128)).to_bytes(BLOCK, "big")
        encryptor = Cipher(algorithms.AES(self._key), modes.CTR(nonce)).encryptor()
        out = encryptor.update(bytes(blocks * BLOCK))
        self.position += blocks
        return out[:n]

    def uniform(self, n: int) -> np.ndarray:
        """n float64 values uniform on (0, 1): 53 random bits each, centred in their cell (never 0)."""
        words = np.frombuffer(self.random_bytes(8 * n), dtype=np.uint64)
        return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53

    def bernoulli(self, n: int, p: float, device=None) -> torch.Tensor:
        """n independent booleans, each True with probability p (a Poisson batch's membership)."""
        return torch.from_numpy(self.uniform(n) < p).to(device)

    def standard_normal(self, n: int) -> np.ndarray:
        """n independent N(0, 1) values in float64 (Box-Muller: two uniforms give two normals)."""
        half = -(-n // 2)
        u = self.uniform(2 * half)
        radius, angle = np.sqrt(-2.0 * np.log(u[:half])), 2.0 * math.pi * u[half:]
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]

    def gaussian_like(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """N(0, std²) noise of `reference`'s shape, dtype and device, drawn as Opacus'
        secure_mode draws it: the sum of four standard normals, halved, times std."""
        n = reference.numel()
        out = np.empty(n, dtype=np.float64)
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            total = self.standard_normal(m)
            for _ in range(SECURE_DRAWS - 1):
                total += self.standard_normal(m)
            out[start:start + m] = total * (std / math.sqrt(SECURE_DRAWS))
        return torch.from_numpy(out).to(device=reference.device, dtype=reference.dtype).view(reference.shape)
