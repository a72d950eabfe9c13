"""The default policy with one implementation's attention options set, for benchmarks that time an opt-in path
(nvidia.cudnn_frontend's `half`, `fp8_dpa`, `autotune`): the options as a policy layer over the shipped default,
with the environment's overrides and quarantine read as a policy file's would be."""

from __future__ import annotations

import json
import os
from typing import Any

import opdispatch
from opdispatch.policies import parse_policy


def use_attention_options(impl: str, options: dict[str, Any]) -> None:
    """From now on the process-wide manager decides under the default policy with `options` for `impl`."""
    text = ("version: 1\nextends: default\nops:\n  attention:\n    options:\n"
            f"      {impl}: {json.dumps(options)}\n")
    opdispatch.get_manager().set_policy(parse_policy(text, f"<{impl} options {options}>", environ=os.environ))
