"""The walkers: one per way of cutting a table, each planning its chunks and yielding its batches'
bounds (:mod:`.base` says what a walker is). Blocks of a table or a leaf (:mod:`.blocks`, with the
index-bounded spans of :mod:`.spans`); key ranges and tenant key ranges (:mod:`.keys`); whole
partitions and the leaves of a partitioned table (:mod:`.partitions`). docs/architecture.md has the
recipe for adding one.
"""
