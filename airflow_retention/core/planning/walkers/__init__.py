"""The walkers: one per way of cutting a table into chunks and a chunk into batches."""
