"""Candidate retrieval: from a user to the ads worth ranking, over the user model's own next-item space.

``eligibility`` (which ads a request may see), ``index`` (the ANN index and its search; versions checked),
``query`` (a request's query: fresh, cached or cold start), ``service`` (the current snapshot, swapped whole).
"""
