"""The admin port: its routes (``routes``: health, readiness, metrics, the policy, reload, the
cache purge) and who may call them (``access``).  It reads the capabilities through the
registry, by keys typed in ``snapshot``, never by importing their modules."""
