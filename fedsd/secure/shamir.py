"""Shamir's secret sharing (Shamir, CACM 1979), byte by byte over GF(2^8), for many bytes at once.

A secret of L bytes is L independent sharings: byte i is the constant term of its own polynomial
of degree t − 1 whose other t − 1 coefficients are uniform bytes from the operating system
(`secrets`), and the share at x (1 ≤ x ≤ 255) is that polynomial's value at x. Any t shares give
the secret back by Lagrange interpolation at 0; any t − 1 are uniform whatever the secret
(information-theoretically: for each value of the secret byte there is exactly one polynomial
through them). A share is as long as its secret.

Why fedsd holds its own: pycryptodome's `Shamir` (GF(2^128), pure Python) takes 17 ms to split one
16-byte secret 27-of-40 and 32 ms to rebuild it on this machine, and secure aggregation splits
three such secrets a client a round and rebuilds one a survivor: at 100 clients that is most of a
round's 37 s. Here the field's products come from its log and antilog tables (the AES field,
x^8 + x^4 + x^3 + x + 1, generator 3; as HashiCorp Vault's and SLIP-0039's byte-wise Shamir), and
numpy evaluates every byte's polynomial at every x in one pass: tens of microseconds. The field
and its tables are checked against the bit-by-bit product in tests/secure/test_shamir.py. Nothing
here is secret-dependent in its control flow; the table lookups are, which matters only to code
running on the owner's own machine.
"""
from __future__ import annotations

import secrets

import numpy as np

MAX_SHARES = 255  # the nonzero points of GF(2^8)
_POLYNOMIAL = 0x11B


def _tables() -> tuple[np.ndarray, np.ndarray]:
    exp, log = np.zeros(512, dtype=np.uint8), np.zeros(256, dtype=np.int64)
    x = 1
    for i in range(255):
        exp[i], log[x] = x, i
        doubled = x << 1
        x ^= doubled ^ (_POLYNOMIAL if doubled & 0x100 else 0)  # x · 3 = x ⊕ 2x
    exp[255:510] = exp[:255]
    return exp, log


_EXP, _LOG = _tables()
# _PRODUCTS_FLAT[256 a + b] = a · b: one lookup a product in split's Horner steps (512 KiB)
_PRODUCTS_FLAT = np.where((np.arange(256)[:, None] == 0) | (np.arange(256)[None, :] == 0), 0,
                          _EXP[(_LOG[:, None] + _LOG[None, :]) % 255]).astype(np.intp).ravel()


def _scaled(values: np.ndarray, log_factor: np.ndarray) -> np.ndarray:
    """`values` times the nonzero field elements whose logs are `log_factor` (broadcast)."""
    return np.where(values == 0, np.uint8(0), _EXP[_LOG[values] + log_factor])


def multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The field's product, elementwise (numpy broadcasting)."""
    a, b = np.asarray(a, dtype=np.uint8), np.asarray(b, dtype=np.uint8)
    return np.where(b == 0, np.uint8(0), _scaled(a, _LOG[b]))


def split(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """`count` shares of `secret`, any `threshold` of which rebuild it: share k (from 0) is the
    value at x = k + 1."""
    if any(not isinstance(v, int) or isinstance(v, bool) for v in (threshold, count)) or \
            not 1 <= threshold <= count <= MAX_SHARES:
        raise ValueError(f"Shamir: 1 ≤ threshold ({threshold}) ≤ shares ({count}) ≤ {MAX_SHARES}")
    data = np.frombuffer(bytes(secret), dtype=np.uint8)
    if not len(data):
        raise ValueError("Shamir: an empty secret")
    coefficients = np.frombuffer(secrets.token_bytes((threshold - 1) * len(data)), dtype=np.uint8)
    coefficients = coefficients.reshape(threshold - 1, len(data))
    x = np.arange(1, count + 1, dtype=np.intp)[:, None]
    value = np.zeros((count, len(data)), dtype=np.intp)
    for c in list(coefficients[::-1].astype(np.intp)) + [data.astype(np.intp)]:  # Horner, highest degree first
        value = _PRODUCTS_FLAT[(value << 8) | x] ^ c  # value · x + c
    return [row.tobytes() for row in value.astype(np.uint8)]


def combine(points: list[int], shares: list[bytes]) -> bytes:
    """The secret from shares at distinct `points` (as many as its threshold): Lagrange at 0."""
    xs = np.asarray(points, dtype=np.int64)
    if len(xs) != len(shares) or not len(xs) or len(set(points)) != len(points) or \
            xs.min() < 1 or xs.max() > MAX_SHARES:
        raise ValueError("Shamir: one share each at distinct points in [1, 255]")
    if len({len(s) for s in shares}) != 1:
        raise ValueError("Shamir: shares of one secret are of one length")
    rows = np.frombuffer(b"".join(bytes(s) for s in shares), dtype=np.uint8).reshape(len(xs), -1)
    # λ_i = Π_{m≠i} x_m / (x_m − x_i), subtraction being ⊕: in logs, Σ log x_m − Σ log(x_m ⊕ x_i)
    difference = xs[:, None] ^ xs[None, :]
    np.fill_diagonal(difference, 1)  # log 1 = 0: the m = i factor drops out
    log_lambda = (_LOG[xs].sum() - _LOG[xs] - _LOG[difference].sum(axis=1)) % 255
    return np.bitwise_xor.reduce(_scaled(rows, log_lambda[:, None]), axis=0).tobytes()
