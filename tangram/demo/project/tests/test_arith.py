import math

import pytest

from numkit import collatz_length, gcd, lcm, modpow


@pytest.mark.parametrize("block", range(12))
def test_gcd_lcm_match_math(block):
    for a in range(block * 40, (block + 1) * 40):
        for b in range(1, 400):
            assert gcd(a, b) == math.gcd(a, b)
            assert lcm(a, b) == (a * b // math.gcd(a, b) if a else 0)


@pytest.mark.parametrize("mod", [2, 3, 7, 97, 1_000_003, 2**31 - 1])
def test_modpow_matches_pow(mod):
    for base in range(0, 400, 3):
        for exp in range(0, 300, 7):
            assert modpow(base, exp, mod) == pow(base, exp, mod)


@pytest.mark.parametrize("block", range(8))
def test_collatz_known_lengths(block):
    for n in range(1 + block * 30000, 1 + (block + 1) * 30000):
        assert collatz_length(n) >= 0
    assert collatz_length(27) == 111
