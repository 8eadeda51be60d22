"""``attnfuse bench``: AttnFuse against SDPA, flex_attention and a hand-written FA2 kernel on a CUDA GPU.

Modules: ``cases`` (geometries, programs), ``baselines``, ``timing``, ``suites`` and ``measures`` (what is
measured), ``rows`` (results and their JSON), ``report`` (tables, the docs page), ``plot``, ``run`` and
``command`` (the command line).
"""
