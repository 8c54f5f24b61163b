"""numkit: small number-theory routines; the demo's agent edits and tests this project."""
from numkit.primes import is_prime, primes_below, factorize
from numkit.arith import gcd, lcm, modpow, collatz_length

__all__ = ["is_prime", "primes_below", "factorize", "gcd", "lcm", "modpow", "collatz_length"]
