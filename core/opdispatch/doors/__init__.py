"""The front doors: the public call API (`_api`: `attention`, `explain`, `plan`, `define_front_door`, ...) and
the packed-QKV doors (`_packed`).

Builds on `compile`, `engine`, `ops` and `base`.
"""
