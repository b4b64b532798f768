"""Single flight: identical in-flight requests share one upstream call (``singleflight``), and
its stage (``stage``)."""
