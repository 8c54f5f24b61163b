"""Core of the scheduler: the action model and the clock-injected engine.

Nothing here imports aiohttp, docker, torch or verl.
"""
from tangram.core.errors import DemandError, TangramError, UnschedulableError
from tangram.core.model import (
    Action,
    Demand,
    Elasticity,
    Profile,
    render_command,
)

__all__ = [
    "Action",
    "Demand",
    "DemandError",
    "Elasticity",
    "Profile",
    "TangramError",
    "UnschedulableError",
    "render_command",
]
