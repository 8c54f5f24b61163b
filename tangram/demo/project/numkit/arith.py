"""Integer arithmetic."""
from __future__ import annotations


def gcd(a: int, b: int) -> int:
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


def lcm(a: int, b: int) -> int:
    return 0 if a == 0 or b == 0 else abs(a * b) // gcd(a, b)


def modpow(base: int, exp: int, mod: int) -> int:
    """base ** exp % mod by square-and-multiply."""
    if mod == 1:
        return 0
    result, base = 1, base % mod
    while exp > 0:
        if exp & 1:
            result = result * base % mod
        base = base * base % mod
        exp >>= 1
    return result


def collatz_length(n: int) -> int:
    """Steps for n to reach 1 under the Collatz map."""
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
