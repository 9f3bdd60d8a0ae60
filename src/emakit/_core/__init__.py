"""The parts every EMA kind is built from (facades in ``ema.py``, ``multi.py``, ...):

* `tracker`: counters, decay rule, plan and runner (the update path);
* `shadow`: the EMA copy of a module and its layout;
* `sharding`: the EMA copy of an FSDP2 model;
* `tree`: pytrees as EMA sources;
* `state`: the versioned state-dict codec;
* `swap`: the EMA weights in the online model, and back.

This package re-exports nothing: import from the modules.
"""
