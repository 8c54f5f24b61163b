"""Primes: a sieve, trial division and factorisation."""
from __future__ import annotations


def primes_below(n: int) -> list[int]:
    """All primes p < n (sieve of Eratosthenes)."""
    if n < 3:
        return []
    sieve = bytearray([1]) * n
    sieve[0] = sieve[1] = 0
    p = 2
    while p * p < n:
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
        p += 1
    return [i for i in range(n) if sieve[i]]


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def factorize(n: int) -> list[int]:
    """Prime factors of n >= 1 in ascending order, with multiplicity."""
    if n < 1:
        raise ValueError("n must be >= 1")
    out, d = [], 2
    while d * d <= n:
        while n % d == 0:
            out.append(d)
            n //= d
        d += 1
    if n > 1:
        out.append(n)
    return out
