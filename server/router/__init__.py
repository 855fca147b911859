"""A standalone cache-aware router in front of N engine servers (data parallelism, as
SGLang's router does it):

    python -m server.router --worker-urls http://h1:30000 http://h2:30000 --port 30000

`policy.py` chooses the worker (cache-aware, round robin, shortest queue; pure and unit
tested), `tree.py` is the approximate radix tree the cache-aware policy keeps per worker,
`state.py` holds the workers, the shared client session and the health checks, `app.py` the
routes (proxied generation, aggregated endpoints), `broadcast.py` the admin calls sent to every
worker and `journal.py` the record of the state-changing ones, replayed on a worker that missed
them before it is routed to again. It never imports the engine (nor
torch): a router starts in a fraction of a second and holds no model.
"""

from server.router.state import RouterConfig

__all__ = ["RouterConfig"]
