"""The tools: the command line (`_cli`, `_observe_cli`), tuning and benchmarking (`_tuning`, `_bench`,
`_timing`), conformance (`_validate`) and the typing stub's generator (`_stubs`).

May build on every layer.
"""
