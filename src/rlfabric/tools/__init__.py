"""Tools around the loop, not part of it: the ledger audit of a run's books and the tiny models the tests
and the demo build locally.
"""
