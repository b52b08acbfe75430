"""Planning a run: the frozen cutoffs (the run's and each tenant's), the walkers that cut a table into
chunks (:mod:`.walkers`), the chunk sizing, and the entry points :func:`.planner.plan_run` and
:func:`.planner.compute_plan`.
"""
