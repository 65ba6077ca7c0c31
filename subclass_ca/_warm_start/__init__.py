"""Warm start: a restarted job reuses the compiled graphs of an earlier one, never stale ones.

The whole story is Note [Warm start through torch's caches] in ``cacheable.py``: CA graphs become
entries of torch's own AOTAutogradCache, keyed by what each of their call targets does
(``cacheable.py``), from stable, cross-process descriptions of code and values (``fingerprint.py``);
``traced.py`` keeps Dynamo's trace of each CA graph so a restart runs it untraced (Note [Skipping
Dynamo's trace of an unchanged CA graph]); ``files.py`` is ``save_cache``/``load_cache`` (torch's mega-cache behind a build header);
``trust.py`` makes sure nothing read back runs unless this user wrote it (Note [Trusting a compile
cache]: signatures, the key, owner-checked folders).  The torch
internals involved live in ``_compat/caches.py``.  docs/warm_start.md is the user's side.
"""
