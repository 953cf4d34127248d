"""Parallel-layout search: a space of scenarios, a closed-form estimate of all of them, the
discrete-event simulation of the best, on a local process pool or a Dask cluster, with a
resumable SQLite store of results."""
