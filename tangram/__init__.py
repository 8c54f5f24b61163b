"""ARL-Tangram: action-level elastic scheduling of agentic-RL external resources.

Importing this package is light on purpose: no aiohttp, docker, torch or verl.
"""
__version__ = "0.1.0"
