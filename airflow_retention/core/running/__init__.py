"""Running a run: the chunk engine (:func:`.engine.run_chunk`), its pacing, the isolation of one
tenant's failure, the partition actions (detach, drop) and the verification that a run is complete.
"""
