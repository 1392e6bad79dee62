"""fedsd.secure.shamir: the field against its definition, sharing against its two promises (t shares
rebuild the secret; t − 1 shares are the same for every secret), and bad arguments refused."""
import itertools
import secrets

import numpy as np
import pytest

from fedsd.secure import shamir


def _product(a: int, b: int) -> int:
    """GF(2^8) modulo x^8 + x^4 + x^3 + x + 1, bit by bit (the AES field's definition)."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        a, b = a << 1, b >> 1
        if a & 0x100:
            a ^= 0x11B
    return out


def test_the_tables_multiply_as_the_field_does():
    a, b = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    table = shamir.multiply(a.astype(np.uint8), b.astype(np.uint8))
    reference = np.array([[_product(i, j) for j in range(256)] for i in range(256)], dtype=np.uint8)
    assert np.array_equal(table, reference)


@pytest.mark.parametrize("threshold,count", [(1, 1), (2, 3), (7, 10), (43, 64), (128, 128), (170, 255)])
def test_any_threshold_of_the_shares_rebuild_the_secret(threshold, count):
    secret = secrets.token_bytes(48)
    shares = shamir.split(secret, threshold, count)
    assert len(shares) == count and all(len(s) == len(secret) for s in shares)
    rng = np.random.default_rng(threshold)
    for _ in range(5):
        chosen = sorted(rng.choice(count, size=threshold, replace=False).tolist())
        assert shamir.combine([k + 1 for k in chosen], [shares[k] for k in chosen]) == secret


def test_fewer_than_the_threshold_rebuild_something_else():
    secret = secrets.token_bytes(32)
    shares = shamir.split(secret, 5, 9)
    assert shamir.combine([1, 2, 3, 4], shares[:4]) != secret  # 2^-256 to collide by chance


def test_threshold_minus_one_shares_fit_every_secret_equally():
    """Perfect secrecy, exhaustively for t = 2 at one point and t = 3 at two: over all coefficient
    choices, each secret byte gives each tuple of t − 1 share values equally often."""
    for t, points in [(2, [5]), (3, [7, 200])]:
        counts = {}
        for secret in (0, 1, 0x53, 0xFF):
            seen = {}
            for coefficients in itertools.product(range(256), repeat=t - 1):
                values = []
                for x in points:
                    value, power = secret, 1
                    for c in coefficients:
                        power = _product(power, x)
                        value ^= _product(c, power)
                    values.append(value)
                seen[tuple(values)] = seen.get(tuple(values), 0) + 1
            counts[secret] = seen
        assert all(len(seen) == 256 ** (t - 1) and set(seen.values()) == {1} for seen in counts.values())


def test_a_share_is_the_polynomial_the_tables_evaluate():
    """split's shares lie on one polynomial of degree t − 1: t of them predict the rest."""
    shares = shamir.split(b"\x2a" * 4, 3, 8)
    for k in range(3, 8):
        rebuilt = shamir.combine([1, 2, 3], shares[:3])
        assert rebuilt == b"\x2a" * 4
        # Lagrange at x = k + 1 from the first three, by hand with the reference product
        x, xs = k + 1, [1, 2, 3]
        for byte in range(4):
            value = 0
            for i, xi in enumerate(xs):
                num = den = 1
                for m, xm in enumerate(xs):
                    if m != i:
                        num, den = _product(num, x ^ xm), _product(den, xi ^ xm)
                inverse = next(v for v in range(1, 256) if _product(den, v) == 1)
                value ^= _product(shares[i][byte], _product(num, inverse))
            assert value == shares[k][byte]


@pytest.mark.parametrize("threshold,count", [(0, 3), (4, 3), (2, 256), (True, 3)])
def test_impossible_sharings_are_refused(threshold, count):
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(b"secret", threshold, count)


@pytest.mark.parametrize("points,shares", [([1, 1], [b"a", b"b"]), ([0, 1], [b"a", b"b"]), ([1, 256], [b"a", b"b"]),
                                           ([1, 2], [b"a", b"bb"]), ([1], [b"a", b"b"]), ([], [])])
def test_malformed_shares_are_refused(points, shares):
    with pytest.raises(ValueError, match="Shamir"):
        shamir.combine(points, shares)
