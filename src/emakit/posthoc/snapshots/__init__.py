"""The post-hoc snapshots on disk: their format and their folder.

* `format`: one snapshot file (its name, its header written and parsed field by field,
  `SnapshotInfo`, the atomic write of one step's set, reading its tensors back);
* `shards`: the rank files of a sharded snapshot (blocks, flat ranges, the
  ``shard_layout`` header, complete sets);
* `frozen`: the side files that store shared frozen weights once for many snapshots;
* `legacy`: ema-pytorch's ``<profile index>.<step>.pt`` files;
* `folder`: what a folder holds (`list_snapshots()`), which run wrote what, and the lock
  of the one run writing there;
* `writer`: one step's snapshots of a `PostHocEMA`, by one process or by every rank.

Imports go one way: `shards` <- `frozen` <- `format` (with `legacy`) <- `folder` <-
`writer`. Nothing here imports this package's ``__init__``.
"""
