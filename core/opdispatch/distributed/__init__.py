"""opdispatch beyond one process: decisions agreed across a torch.distributed group, and context-parallel
attention over a sequence sharded across it.

- `consistent(group=None)` / ``OPDISPATCH_DISTRIBUTED=consistent``: every new decision is agreed across the group
  (the rule: `opdispatch.engine._agreement`); `local()` turns it off (for rank-specific code); `agree_tuned_table`
  makes one tuned table of every rank's measurements.
- `context_parallel_attention(q, k, v, group=..., causal=..., mode="ring"|"allgather")` with
  `shard_sequence`/`unshard_sequence` (zigzag or contiguous sharding).

Importing this module does not import torch.distributed; its functions do.
"""

from ._context_parallel import MODES, SHARDINGS, context_parallel_attention, shard_sequence, unshard_sequence
from ..engine._agreement import ENV_DISTRIBUTED, AgreementError, GroupAgreement, agree_tuned_table
from ._consistent import consistent, local

__all__ = ["ENV_DISTRIBUTED", "MODES", "SHARDINGS", "AgreementError", "GroupAgreement", "agree_tuned_table",
           "consistent", "context_parallel_attention", "local", "shard_sequence", "unshard_sequence"]
