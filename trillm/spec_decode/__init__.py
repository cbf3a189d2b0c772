"""Speculative decoding: ``speculative_config`` (``config.py``), the proposers (n-gram in the
engine core: ``ngram.py``; a draft model in the worker: ``draft_model.py``, set up by
``draft_setup.py``; an EAGLE / EAGLE-3 head in the worker: ``eagle_proposer.py`` with
``eagle_head.py``, set up by ``eagle_config.py``; ``drafter.py`` picks the worker's), which
requests get drafts (``policy.py``) and the back-off (``backoff.py``).

Drafts ride the scheduler's ``spec_token_ids`` seam into the next step's budget, and are
verified by the worker in one forward (``ModelRunner``: ``trillm/worker/spec_verify.py``).
"""
