"""The ops: what each op means and accepts — its spec, call record, validator and capabilities (`_attention`,
`_rms_norm`, `_rotary`), attention's sinks epilogue and tuning cases.

Builds on `base`.
"""
