"""``gateway serve --workers N``: N worker processes share the data port (``SO_REUSEPORT``)
under one supervisor that serves the admin port, restarts a worker that dies, forwards
SIGHUP and drains them all on SIGTERM.

``cpus`` (how many ``auto`` is), ``backoff`` (when a dead worker is started again),
``worker`` (one worker process and its private admin socket), ``admin`` (the supervisor's
admin app: readiness, the merged ``/metrics``, ``/workers``), ``supervisor``.
"""
