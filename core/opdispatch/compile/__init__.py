"""torch.compile support: attention decided at trace time (`_compile`) and an opaque custom op for any other op
(`_compile_ops`).

Builds on `engine`, `ops` and `base`; the front doors hand calls to it while Dynamo traces.
"""
