"""The main job of a new user: a real agentic-coding rollout on this machine."""
