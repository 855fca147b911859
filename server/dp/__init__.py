"""Data parallelism: `python -m server --dp-size N` runs N engine replicas, each a whole
`python -m server` process with its own actors and KV pool, behind one routing front end
(the standalone router's app, `server/router/`), on this host or, with `--ray-address`, as Ray
actors on a cluster.

Modules, one job each: `replica_args.py` (a replica's command line from the user's argv),
`resources.py` (how replicas share threads, KV memory and GPUs), `process.py` (one replica
server process: log file, readiness, stop), `replica.py` (the `Replica` contract and the local
one), `ray_actor.py` / `ray_placement.py` (the Ray placement), `placement.py` (which one),
`supervisor.py` (start-up, restarts with back-off, shutdown), `frontend.py` (the router app plus
the `dp` section of /get_server_info), `metrics.py` (the front end's merged /metrics),
`controller.py` (the whole life, from the first line printed to the exit status).

Nothing here is imported by a single server: `server/launch.py` imports `controller` only when
`--dp-size` is above 1 or `--ray-address` is given.
"""
