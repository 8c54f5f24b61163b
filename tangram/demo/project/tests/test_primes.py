import pytest

from numkit import factorize, is_prime, primes_below


@pytest.mark.parametrize("block", range(16))
def test_sieve_agrees_with_trial_division(block):
    lo, hi = block * 100000, (block + 1) * 100000
    sieve = set(primes_below(hi))
    for n in range(lo, hi):
        assert (n in sieve) == is_prime(n)


@pytest.mark.parametrize("block", range(16))
def test_factorization_multiplies_back(block):
    for n in range(1 + block * 25000, 1 + (block + 1) * 25000):
        fs = factorize(n)
        prod = 1
        for f in fs:
            assert is_prime(f)
            prod *= f
        assert prod == n and fs == sorted(fs)
