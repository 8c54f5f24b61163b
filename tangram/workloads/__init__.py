"""Built-in simulator workloads (YAML, package data). Every parameter names its source."""
