"""Shadow traffic (``routes[].mirror``): a copy of each call a route sends its backend goes
to another backend, whose answer is read, compared with the original's and dropped.

stage.py  the stage, and each route's copies in flight (``Shadow``)
"""
