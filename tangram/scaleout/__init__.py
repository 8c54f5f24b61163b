"""Scale-out on existing engines (DESIGN.md §7).

* :mod:`.docker_nodes`: CPU nodes are Docker Engine endpoints (``unix://``,
  ``tcp://`` with TLS, ``ssh://``); topology discovered from the engine.
* :mod:`.ray_gpu`: GPU nodes are Ray actors holding their node's service
  cache and executing ``model`` actions (or the same host in-process).
* :mod:`.gate`: hides the pools of a node that is down from the policy.
* :mod:`.cluster` / :mod:`.health`: a runtime that fails a dead node's work
  with a clear error, a health loop that marks nodes down and back up.

Nothing here is imported by the core; docker and ray are imported lazily.
"""
