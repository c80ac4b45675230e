"""Peer systems (PgQueuer, Procrastinate) doing the same push job, for side-by-side numbers.

These modules run in bench/.work/peers-venv (never the project venv): see bench/peers/job.py.
"""
