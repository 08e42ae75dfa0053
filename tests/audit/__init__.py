"""Audit cases run as a user meets them (tests/audit/open_world.py): too slow for the suite."""
