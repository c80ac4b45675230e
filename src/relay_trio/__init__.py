"""relay-trio: a push-delivery relay on PostgreSQL, built on trio."""

__version__ = "0.1.0"
