"""Names of the record fields that hold test commands (no dependencies: the CLI help uses it)."""
from __future__ import annotations

# SWE-bench and its derivatives (SWE-Gym, SWE-smith, R2E, ...) use these
DEFAULT_FIELDS = (
    "test_cmd", "test_cmds", "test_command", "test_commands", "eval_script",
    "eval_cmd", "eval_command", "evaluation_script", "test_script", "run_tests",
)
INSTALL_FIELD = "tangram_install"
INSTALL_VALUE = "pip install pytest-xdist"
UNPATCHED_SUFFIX = "_unpatched"
