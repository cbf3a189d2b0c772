"""Speculative decoding: the n-gram proposer (engine core side) and its configuration.

Drafts are proposed in the engine core after P4, ride the scheduler's ``spec_token_ids`` seam
into the next step's budget, and are verified by the worker in one forward (``ModelRunner``:
``trillm/worker/spec_verify.py``).
"""
